"""The block protocol (truncsens.engine.block.plan, block_protocol, block_runs): plan arithmetic by
hand, every block measurement equal to a single-target re-encode of the same tokens, fits on actual
windows, agreement with the exact protocol on the synthetic source, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.fits.curves import curves_of
from truncsens.divergences import all_metrics
from truncsens.engine.block.plan import (
    Blocks, actual_contexts, actual_windows, block_length, blocks_of, check_block_windows, chunks,
    block_passes, exact_forward_tokens, forward_tokens, shortest_context, targets_per_pass,
)
from truncsens.engine.block.passes import measure_blocks
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.forward import next_token_logprobs
from truncsens.fits.fitting import FitConfig, fit_curve, fit_datasets
from truncsens.models import load_model
from truncsens.targets import TokenDoc, draw_blocks, select_block_targets


# ----------------------------------------------------------------------------- plans by hand


def test_targets_per_pass_by_hand():
    # K = max(1, min(block_size, floor(w * fraction)))
    assert [targets_per_pass(w, 0.125, 64) for w in (1, 7, 8, 15, 16, 64, 512, 1024, 4096)] == [1, 1, 1, 1, 2, 8, 64, 64, 64]
    assert targets_per_pass(1000, 0.125, 200) == 125
    assert targets_per_pass(10, 1.0, 4) == 4
    assert block_length(1024, 0.125, 64) == 64 and block_length(256, 0.125, 64) == 32


def test_chunks_windows_contexts_by_hand():
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(3, 8) == [(0, 3)]
    blocks = Blocks(np.array([0, 10]), np.array([10, 3]))
    # window 20, 4 per pass: 20,21,22,23 | 20..23 | 20,21 then the 3-target block: 20,21,22
    assert actual_windows(blocks, 20, 4).tolist() == [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 20, 21, 22]
    # N = 100, no room: contexts N - size + 1 + j
    assert actual_contexts(blocks, 100).tolist() == [91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 98, 99, 100]
    # room for 2 more positions: e = min(size - 1, 2)
    assert actual_contexts(blocks, 100, room=2).tolist() == [93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 100, 101, 102]
    assert shortest_context(100, 10, 0) == 91 and shortest_context(100, 10, 50) == 100


def test_forward_tokens_by_hand():
    # one block of 4 targets, N = 16, windows 2 and 8, fraction 1/4, cap 4: K(2) = 1, K(8) = 2
    # reference 16; window 2: four passes of 2 tokens; window 8: two passes of 8 + 2 - 1 = 9
    assert forward_tokens([4], 16, [2, 8], 0, 0.25, 4) == 16 + 4 * 2 + 2 * 9
    assert forward_tokens([4], 16, [2, 8], 1, 0.25, 4, room=10) == 19 + 4 * 3 + 2 * 10
    assert exact_forward_tokens(4, 16, [2, 8], 1) == 4 * (16 + 3 + 9)
    # the passes behind the first count: reference (16 tokens, 4 targets), w = 2 one target per pass
    # (K = max(1, 2 * 0.25)), w = 8 two targets per pass (8 + 2 - 1 tokens)
    assert block_passes(4, 16, [2, 8], 0, 0.25, 4) == [(16, 4), (2, 1), (2, 1), (2, 1), (2, 1), (9, 2), (9, 2)]


def test_block_windows_must_fit_the_shortest_context():
    check_block_windows([1, 56], 64, 0, 8)  # shortest context 57
    with pytest.raises(MeasureError, match="window 57 does not fit"):
        check_block_windows([57], 64, 0, 8)
    with pytest.raises(MeasureError, match="sinks"):
        check_block_windows([56], 64, 2, 8)
    check_block_windows([63], 64, 0, 8, room=100)  # shortest context N when there is room


def test_draw_blocks_by_hand():
    blocks = draw_blocks(1300, 1024, 100, 64, 0, "a")
    assert sum(n for _, n in blocks) == 100 and all(s >= 1024 and s + n <= 1300 for s, n in blocks)
    assert sorted(n for _, n in blocks) == [36, 64]
    every = draw_blocks(1300, 1024, None, 64, 0, "a")
    covered = sorted(p for s, n in every for p in range(s, s + n))
    assert covered == list(range(1024, 1300)) and max(n for _, n in every) == 64
    assert draw_blocks(1030, 1024, 8, 64, 0, "a") == [(1024, 6)]
    assert draw_blocks(1024, 1024, 8, 64, 0, "a") == []
    assert draw_blocks(1300, 1024, 100, 64, 0, "a") == blocks  # seeded per document
    # 100 eligible positions, 80 asked, blocks of 64: one full slot at most (the offset decides the
    # rest), so the longest partial slots fill up to 80, whatever the seed
    for seed in range(6):
        short = draw_blocks(1124, 1024, 80, 64, seed, "a")
        assert sum(n for _, n in short) == 80 and all(s >= 1024 and s + n <= 1124 for s, n in short), (seed, short)
        assert all(a + m <= b for (a, m), (b, _) in zip(short, short[1:]))  # disjoint, in position order
    with pytest.raises(ValueError):
        draw_blocks(1300, 1024, 8, 0, 0, "a")


def test_block_sizes_of_results_by_hand():
    from truncsens.engine.block.runs import block_sizes

    # doc a: a block of 3 (contexts 8, 9, 10: room beyond N) then one of 2 (8, 9); doc b: a block of 2
    # starting at the context where doc a's stopped; an exact file (no actual_context): one per target
    ds = xr.Dataset(coords={"doc": ("target", ["a", "a", "a", "a", "a", "b", "b"]),
                            "actual_context": ("target", [8, 9, 10, 8, 9, 10, 11]),
                            "window": [1]}, attrs={"reference_context": 8})
    assert block_sizes(ds) == [3, 2, 2]
    assert block_sizes(ds.drop_vars("actual_context")) == [1] * 7
    assert block_sizes(ds.drop_vars("window").assign_coords(budget=[4])) == [3, 2, 2]  # a policy sweep


def test_blocks_of_groups_and_checks_consecutive():
    b = blocks_of(["a"] * 5 + ["b"] * 2, np.array([10, 11, 12, 20, 21, 10, 11]), np.array([10, 10, 10, 20, 20, 10, 10]))
    assert b.start.tolist() == [0, 3, 5] and b.size.tolist() == [3, 2, 2]
    with pytest.raises(ValueError, match="not consecutive"):
        blocks_of(["a", "a"], np.array([10, 12]), np.array([10, 10]))


# ----------------------------------------------------------------------------- equality with single-target re-encodes


def single_target_logprobs(model, doc: torch.Tensor, t: int, context: int, window: int | None, n_sink: int,
                           positions: str) -> torch.Tensor:
    """The exact protocol's distribution for target t, one sequence at a time: the reference with
    ``context`` tokens (``window=None``), or the window of ``window`` tokens after the first
    ``n_sink`` tokens of that context. [1, V] float64."""
    if window is None:
        return next_token_logprobs(model, doc[t - context : t][None], torch.arange(context)[None])
    ids = torch.cat([doc[t - context : t - context + n_sink], doc[t - window : t]])[None]  # [1, S + a]
    pos = (torch.cat([torch.arange(n_sink), torch.arange(context - window, context)]) if positions == "original"
           else torch.arange(n_sink + window))[None]
    return next_token_logprobs(model, ids, pos)


def check_equal_to_single_targets(model, docs, N, windows, n_sink, positions, fraction, size, room, tpd):
    B = block_length(N, fraction, size)
    targets = select_block_targets(docs, N, tpd, 0, B)
    out = measure_blocks(model, targets, windows, n_sink, positions, fraction, size, "cpu", 4096, room=room)
    by_id = {d.id: d.ids for d in docs}
    assert len(set(targets.block.tolist())) < len(targets)  # several targets per block
    for i in range(len(targets)):
        doc, t, c = by_id[targets.doc[i]], int(targets.position[i]), int(out.actual_context[i])
        ref = single_target_logprobs(model, doc, t, c, None, n_sink, positions)
        for j, w in enumerate(windows):
            kept = single_target_logprobs(model, doc, t, c, int(out.actual_window[i, j]), n_sink, positions)
            want, _ = all_metrics(ref, kept, doc[t : t + 1])
            for name in ("tv", "kl", "js", "nll_ref", "nll_kept"):
                assert abs(float(out.metrics[name][i, j]) - float(want[name][0])) <= 1e-5, (i, w, name)
    return out


@pytest.mark.parametrize("n_sink,positions,room", [(0, "original", 0), (2, "original", 3), (1, "reindexed", 0)])
def test_block_measurements_equal_single_target_reencodes_tiny(tiny_llama_dir, n_sink, positions, room):
    loaded = load_model(tiny_llama_dir)
    g = torch.Generator().manual_seed(1)
    docs = [TokenDoc("d0", torch.randint(0, 250, (80,), generator=g))]
    out = check_equal_to_single_targets(loaded.model, docs, 48, [1, 8, 20], n_sink, positions, 0.25, 8, room, 10)
    assert out.actual_window[:, 2].max() == 24  # window 20, 5 per pass: 20..24
    assert out.actual_context.min() == 48 - 8 + 1 + min(7, room)


def test_block_measurements_equal_single_target_reencodes_reference():
    loaded = load_model("reference")
    g = torch.Generator().manual_seed(2)
    docs = [TokenDoc("r0", torch.randint(0, 4096, (160,), generator=g))]
    out = check_equal_to_single_targets(loaded.model, docs, 128, [2, 40], 0, "original", 0.125, 16, 0, 10)
    # one block of 10 targets (B = 16, 10 per document); K(40) = 5: two passes; K(2) = 1
    assert out.actual_window[:, 1].tolist() == [40, 41, 42, 43, 44] * 2 and out.actual_window[:, 0].tolist() == [2] * 10
    assert out.actual_context.tolist() == list(range(128 - 10 + 1, 129))  # no room: N - 10 + 1 .. N


# ----------------------------------------------------------------------------- fits use actual windows


def _results_with_actual(values: np.ndarray, actual: np.ndarray, windows: list[int], docs: list[str]) -> xr.Dataset:
    metrics = {m: values for m in ("tv", "kl", "kl_reverse", "js", "nll_ref", "nll_kept")}
    metrics["top1_agree"] = np.ones_like(values, dtype=np.int8)
    attrs = {a: "" for a in results.REQUIRED_ATTRS} | {"semantics": "reencode", "reference_context": 1024, "n_sink": 0,
                                                      "seed": 0, "protocol": "block"}
    ds = results.make_results(metrics, "window", windows, docs, np.arange(len(docs)), np.zeros(len(docs), np.int64), attrs)
    return ds.assign_coords(actual_window=(("target", "window"), actual.astype(np.int32)))


def test_fit_uses_mean_actual_windows_by_hand():
    windows = [4, 8, 16, 32, 64]
    docs = ["a", "a", "b", "b"]
    # each target measured at w + 3 (the same shift for every target): D = 1 / (w + 3) exactly
    actual = np.array([[w + 3 for w in windows]] * 4)
    values = 1.0 / actual
    ds = _results_with_actual(values.astype(np.float32), actual, windows, docs)
    curve = curves_of(ds, ["tv"])[0]
    assert curve.fit_x.tolist() == [7, 11, 19, 35, 67]
    fits = fit_curve(curve, FitConfig(metrics=("tv",), families=("power",), fit_range=(4, 64), n_boot=0))
    params = fits.fits[0]["params"]
    assert abs(params["alpha"]["value"] - 1.0) < 1e-5 and abs(params["C"]["value"] - 1.0) < 1e-4
    # the same values at nominal windows (an exact file) are no power law with exponent 1
    exact = curves_of(ds.drop_vars("actual_window"), ["tv"])[0]
    assert exact.x is None and exact.fit_x.tolist() == windows
    off = fit_curve(exact, FitConfig(metrics=("tv",), families=("power",), fit_range=(4, 64), n_boot=0))
    assert abs(off.fits[0]["params"]["alpha"]["value"] - 1.0) > 0.05


# ----------------------------------------------------------------------------- agreement with the exact protocol


def test_block_and_exact_alphas_agree_on_the_synthetic_source(tmp_path):
    from truncsens.engine.measure import run_measure

    alphas, samples = {}, {}
    for protocol in ("exact", "block"):
        cfg = MeasureConfig(model="synthetic:0.5:512", reference_context=128, max_docs=24, protocol=protocol,
                            block_size=8 if protocol == "block" else 64, windows=[2, 4, 8, 16, 32, 64],
                            out=str(tmp_path / f"{protocol}.nc"), progress=False, docs_per_shard=64)
        run_measure(cfg)
        report = fit_datasets([results.load(cfg.out)], FitConfig(metrics=("tv",), families=("power",), fit_range=(4, 32), n_boot=200),
                              [cfg.out])
        fit = report.results[0].fits[0]
        alpha = fit["params"]["alpha"]
        alphas[protocol] = (alpha["value"], alpha["ci"])
        samples[protocol] = np.asarray([alpha["value"], *fit["bootstrap_samples"]["alpha"]])  # [1 + 200]
    (ve, ce), (vb, cb) = alphas["exact"], alphas["block"]
    assert ce[0] <= vb <= ce[1] or cb[0] <= ve <= cb[1], alphas  # one estimate inside the other's interval
    assert max(ce[0], cb[0]) <= min(ce[1], cb[1]), alphas  # the intervals overlap
    # paired: both fits resample the same 24 documents (same seed, same order), so the difference of
    # the resampled exponents is a document bootstrap of alpha_block - alpha_exact; it must cover 0
    # and be narrow (measured: +0.010 [-0.018, +0.039]; the unpaired intervals are each ~0.045 wide)
    diff = samples["block"] - samples["exact"]
    lo, hi = np.percentile(diff[1:], [2.5, 97.5])
    assert lo <= 0.0 <= hi and hi - lo < 0.1, (diff[0], lo, hi)
    ds = results.load(tmp_path / "block.nc")
    assert ds.attrs["protocol"] == "block" and ds.attrs["block_length"] == 8
    assert ds["actual_context"].values.min() == 128  # room beyond N: contexts N .. N + 7
    assert ds["actual_window"].sel(window=64).values.max() == 64 + 7


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args,fragment", [
    (["--protocol", "block", "--block-fraction", "0"], "block_fraction (--block-fraction) must be in (0, 1]"),
    (["--protocol", "block", "--block-fraction", "1.5"], "block_fraction (--block-fraction) must be in (0, 1]"),
    (["--protocol", "block", "--block-size", "0"], "block_size (--block-size) must be at least 1"),
    (["--protocol", "block", "--policy", "suffix", "--semantics", "streaming", "--chunk", "4"], "needs chunk=1 (--chunk 1)"),
    (["--protocol", "block", "--policy", "suffix,random", "--semantics", "reencode"], "use --protocol exact"),
    (["--protocol", "nope"], "protocol (--protocol) must be one of"),
    (["--block-size", "8"], "block_size (--block-size) sets the block protocol's passes; they need --protocol block"),
    (["--block-fraction", "0.25", "--block-size", "8"], "block_fraction (--block-fraction) and block_size (--block-size) set the block protocol"),
])
def test_bad_block_options_exit_2_with_one_line(tmp_path, args, fragment):
    result = CliRunner().invoke(app, ["measure", "--out", str(tmp_path / "x.nc"), "--no-progress", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert not (tmp_path / "x.nc").exists()


def test_exact_fingerprint_unchanged_and_block_fingerprint_differs():
    exact = MeasureConfig(out="x.nc").fingerprint()
    assert "protocol" not in exact and "block_size" not in exact
    block = MeasureConfig(out="x.nc", protocol="block").fingerprint()
    assert block["protocol"] == "block" and block["block_fraction"] == 0.125 and block["block_size"] == 64


# ----------------------------------------------------------------------------- long documents offline


def test_long_documents_concatenate_whole_packages(tmp_path):
    from truncsens.corpora.builtin import long_documents

    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text('"""The package docstring, long enough to be kept as prose."""\n')
    (tmp_path / "pkg" / "b.py").write_text("x = 2\n")
    (tmp_path / "pkg" / "sub" / "a.py").write_text('def f():\n    """A function docstring, long enough to be kept too."""\n')
    (tmp_path / "loose.py").write_text("y = 1\n")  # not in a package: not a long document
    (tmp_path / "nopkg").mkdir()
    (tmp_path / "nopkg" / "c.py").write_text("z = 3\n")  # a folder without __init__.py
    docs = {d.id: d.text for d in long_documents(tmp_path)}
    assert docs["long/code/pkg"] == ('# file: pkg/__init__.py\n"""The package docstring, long enough to be kept as prose."""\n\n'
                                     "# file: pkg/b.py\nx = 2\n\n"
                                     '# file: pkg/sub/a.py\ndef f():\n    """A function docstring, long enough to be kept too."""\n')
    assert docs["long/nl/pkg"] == ("The package docstring, long enough to be kept as prose.\n\n"
                                   "A function docstring, long enough to be kept too.")
    assert not any("loose" in i or "nopkg" in i for i in docs)
    assert "long/nl/pydoc-topics" in docs


def test_stdlib_long_heldout_has_documents_of_8k_tokens():
    from truncsens.corpora import load_corpus

    corpus = load_corpus("stdlib-long", "code")
    assert corpus.split == "heldout" and corpus.domain == "long"
    tokenizer = load_model("reference").tokenizer
    candidates = sorted((d for d in corpus.documents if len(d.text) > 8192), key=lambda d: len(d.text))
    longest = 0
    for d in candidates:  # the shortest candidates first: tokenizing the largest package takes long
        longest = max(longest, len(tokenizer(d.text[:200_000], add_special_tokens=False)["input_ids"]))
        if longest >= 8192:
            break
    assert longest >= 8192


def test_suffix_and_sink_recent_budget_sweeps_equal_window_sweeps(tmp_path):
    from truncsens.engine.measure import run_measure

    def run(name, **kw):
        cfg = MeasureConfig(model="synthetic:0.5:256", reference_context=64, max_docs=3, protocol="block", block_size=4,
                            out=str(tmp_path / f"{name}.nc"), progress=False, **kw)
        run_measure(cfg)
        return results.load(cfg.out)

    windows = run("windows", windows=[4, 16, 32], n_sink=2)
    budgets = run("budgets", policies=["sink_recent"], budgets=[6, 18, 34], semantics="reencode", n_sink=2)
    assert np.array_equal(budgets["tv"].values, windows["tv"].values)
    assert np.array_equal(budgets["actual_budget"].values, windows["actual_window"].values + 2)
    assert np.array_equal(budgets["kept_tokens"].values, budgets["actual_budget"].values)
    curve = curves_of(budgets, ["tv"])[0]
    assert np.allclose(curve.fit_x, windows["actual_window"].values.mean(0) + 2)
    suffix = run("suffix", policies=["suffix"], budgets=[4, 16, 32], semantics="reencode")
    plain = run("plain", windows=[4, 16, 32])
    assert np.array_equal(suffix["kl"].values, plain["kl"].values)


def test_show_header_names_the_block_protocol():
    from truncsens.report.printed import format_results_header

    attrs = {"model": "m", "corpus": "c", "domain": "d", "semantics": "reencode", "positions": "original", "n_sink": 0,
             "reference_context": np.int64(1024), "protocol": "block", "block_length": np.int64(64),
             "block_extra_context": np.int64(0), "block_size": 64, "block_fraction": 0.125}
    line = format_results_header("f.nc", attrs, 10, contexts=(961, 1024))
    assert line.endswith("10 targets; protocol block (blocks of up to 64 consecutive targets, K = max(1, min(64, floor(0.125 w))) per pass; "
                         "actual windows w..w+K-1, reference contexts 961..1024)")
    exact = {k: v for k, v in attrs.items() if not k.startswith(("protocol", "block"))}
    assert format_results_header("f.nc", exact, 10).endswith("reference context 1024, 10 targets")
    stream = format_results_header("f.nc", {**attrs, "semantics": "streaming"}, 10, contexts=(1024, 1087))
    assert stream.endswith("protocol block (blocks of up to 64 consecutive targets, one stream per block and budget, "
                           "shared by its targets (and, for random policies, its draws); reference contexts 1024..1087)")
    prefill = format_results_header("f.nc", {**attrs, "semantics": "prefill_evict"}, 0)  # no targets: no contexts
    assert prefill.endswith("one prefill per block, one decode of its targets per budget; reference contexts none)")


def test_block_passes_build_no_square_mask(monkeypatch):
    """A pass is a plain causal forward: SDPA gets no [L, L] mask (is_causal), also with sinks in front."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from truncsens.engine.block.passes import pass_logprobs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 100, (2, 50))
    pos = torch.cat([torch.arange(2), torch.arange(20, 68)]).expand(2, 50)  # 2 sinks, then a window at 20..67
    lp = pass_logprobs(model, ids, pos, 5)
    assert lp.shape == (2, 5, 100) and seen and all(mask is None and causal for mask, causal in seen)


def test_block_run_from_the_command_line_names_its_protocol(tmp_path):
    out = tmp_path / "b.nc"
    result = CliRunner().invoke(app, ["measure", "--protocol", "block", "--reference-context", "64", "--windows", "8,16,32",
                                      "--max-docs", "1", "--targets-per-doc", "8", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "from 1 document (" in result.output and "block protocol, windows 8, 16, 32" in result.output
    ds = results.load(out)
    assert ds.attrs["protocol"] == "block" and ds.sizes["target"] == 8
    # a block of B = K(64) = 8 consecutive targets; window 8 runs K(8) = 1 target per pass (exact), window 32 four
    assert list(np.diff(np.sort(ds["position"].values))) == [1] * 7
    assert (ds["actual_window"].sel(window=8).values == 8).all()
    assert sorted(set(ds["actual_window"].sel(window=32).values.tolist())) == [32, 33, 34, 35]
    shown = CliRunner().invoke(app, ["show", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "reference contexts 64..71)" in shown.output  # the file's own: N .. N+7 (the model has room beyond N = 64)
    fitted = CliRunner().invoke(app, ["fit", str(out), "--bootstrap", "0", "--fit-range", "8:32"])
    assert fitted.exit_code == 0, fitted.output
    assert "protocol block, fitted at the mean actual window of each bin" in fitted.output, fitted.output


def test_block_saving_and_the_note_on_partly_filled_blocks_by_hand():
    from truncsens.engine.block.plan import block_saving, larger_blocks_note

    # N = 8, windows 1 and 2, no sinks, fraction 0.5, at most 4 per pass: B = K(8) = 4, K(1) = K(2) = 1.
    # exact: N + sum(w) = 11 tokens per target; a block of m: N + m * (1 + 2) tokens.
    args = (8, [1, 2], 0, 0.5, 4)
    assert block_saving(2, *args) == pytest.approx(22 / 14)
    assert block_saving(4, *args) == pytest.approx(44 / 20)
    assert block_saving(6, *args) == pytest.approx(66 / (20 + 14))  # blocks of 4 and 2
    note = larger_blocks_note(2, *args)
    assert "2 targets per document reads 1.6x fewer" in note and "--targets-per-doc 4 (full blocks) would read 2.2x" in note
    assert larger_blocks_note(4, *args) is None and larger_blocks_note(6, *args) is None
