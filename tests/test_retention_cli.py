"""Policy sweeps end to end: reencode equals measure, the CLI (measure --policy, compare-policies),
resume, and bad input (clear message, non-zero exit, nothing already written lost)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import requires_reference
from truncsens import results
from truncsens.cli.main import app
from truncsens.divergences import METRICS
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.measure import run_measure
from truncsens.engine.run.shards import MeasureInterrupted
from engine_calls import retention_targets
from truncsens.engine.forward import next_token_logprobs
from truncsens.models import load_model
from truncsens.policies import PolicyError, make_policy
from truncsens.targets import TargetSet, doc_seed

N = 64


def measure_cfg(model_dir, corpus_dir, out, **kw) -> MeasureConfig:
    return MeasureConfig(**{"model": model_dir, "corpus": corpus_dir, "reference_context": N, "targets_per_doc": 3,
                            "docs_per_shard": 4, "out": str(out), "progress": False, **kw})


def retention_cfg(model_dir, corpus_dir, out, **kw) -> MeasureConfig:
    return MeasureConfig(**{"model": model_dir, "corpus": corpus_dir, "reference_context": N, "targets_per_doc": 3,
                              "docs_per_shard": 4, "out": str(out), "progress": False, **kw})


@pytest.mark.parametrize("positions", ["original", "reindexed"])
def test_reencode_suffix_equals_measure(tiny_llama_dir, corpus_dir, tmp_path, positions):
    windows = [1, 4, 16, 40]
    run_measure(measure_cfg(tiny_llama_dir, corpus_dir, tmp_path / "m.nc", windows=windows, positions=positions))
    run_measure(retention_cfg(tiny_llama_dir, corpus_dir, tmp_path / "r.nc", policies=["suffix"], budgets=windows,
                                semantics="reencode", positions=positions))
    m, r = results.load(tmp_path / "m.nc"), results.load(tmp_path / "r.nc")
    assert r["kl"].dims == ("target", "budget") and r.attrs["policy"] == "suffix" and r.attrs["semantics"] == "reencode"
    for c in ("doc", "position", "token_id"):
        np.testing.assert_array_equal(m[c].values, r[c].values)
    for name in METRICS:
        np.testing.assert_allclose(r[name].values, m[name].values, atol=1e-5, rtol=0, err_msg=name)
    assert m["kl"].values.min() >= 0 and m["kl"].values[:, 0].mean() > 1e-2


@requires_reference
def test_reencode_suffix_equals_measure_reference(tmp_path):
    loaded = load_model("reference")
    common = dict(model="reference", domain="code", reference_context=96, targets_per_doc=2, max_docs=2, progress=False)
    run_measure(MeasureConfig(windows=[4, 16, 64], out=str(tmp_path / "m.nc"), **common), loaded)
    run_measure(MeasureConfig(policies=["suffix"], budgets=[4, 16, 64], semantics="reencode",
                                  out=str(tmp_path / "r.nc"), **common), loaded)
    m, r = results.load(tmp_path / "m.nc"), results.load(tmp_path / "r.nc")
    for name in METRICS:
        np.testing.assert_allclose(r[name].values, m[name].values, atol=1e-5, rtol=0, err_msg=name)


def test_reencode_sink_recent_equals_measure_with_sinks(tiny_llama_dir, corpus_dir, tmp_path):
    run_measure(measure_cfg(tiny_llama_dir, corpus_dir, tmp_path / "m.nc", windows=[2, 6, 30], n_sink=2))
    run_measure(retention_cfg(tiny_llama_dir, corpus_dir, tmp_path / "r.nc", policies=["sink_recent"], n_sink=2,
                                budgets=[4, 8, 32], semantics="reencode"))
    m, r = results.load(tmp_path / "m.nc"), results.load(tmp_path / "r.nc")
    for name in METRICS:
        np.testing.assert_allclose(r[name].values, m[name].values, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("positions", ["original", "reindexed"])
def test_reencode_random_equals_per_target_loop(tiny_llama_dir, positions):
    """Per-row kept sets: each target re-encoded alone from its own kept tokens."""
    model = load_model(tiny_llama_dir).model
    n = 5
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, model.config.vocab_size, (n, N), generator=g)
    targets = TargetSet([f"d{i % 2}" for i in range(n)], np.arange(n) + N, ctx, torch.randint(0, 50, (n,), generator=g))
    policy = make_policy("random")
    metrics, extras, _ = retention_targets(model, targets, [policy], [8], "reencode", positions, 3, "cpu", 100)
    for i in range(n):
        kept = policy.keep(N, 8, torch.tensor([N - 1]), [doc_seed(3, f"{targets.doc[i]}:{N + i}:random:0")]).keep[0, 0]
        idx = torch.nonzero(kept).flatten()
        pos = idx if positions == "original" else torch.arange(8)
        ref = next_token_logprobs(model, ctx[i : i + 1], torch.arange(N).unsqueeze(0))
        lp = next_token_logprobs(model, ctx[i : i + 1, idx], pos.unsqueeze(0))
        want = float((ref.exp() * (ref - lp)).sum())
        assert metrics["kl"][0, i, 0] == pytest.approx(want, abs=1e-5)
        assert want > 1e-3
    assert np.all(extras["kept_tokens"] == 8) and "evicted_attention_mass" not in extras


runner = CliRunner()


def cli(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    return result


def test_cli_policies_then_compare(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "results" / "policies.nc"
    r = cli("measure", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", N, "--targets-per-doc", 3,
            "--policy", "sink_recent,random", "--budgets", "8,16,32", "--semantics", "streaming", "--out", out, "--no-progress",
            "--docs-per-shard", 2)
    assert r.exit_code == 0, r.output
    assert "policies sink_recent, random, semantics streaming" in r.output
    ds = results.load(out)
    assert ds["kl"].dims == ("policy", "target", "budget")
    assert list(ds["policy"].values) == ["sink_recent", "random"] and list(ds["budget"].values) == [8, 16, 32]
    assert ds.attrs["semantics"] == "streaming" and ds.attrs["n_sink"] == 4 and ds.attrs["policy"] == "sink_recent,random"
    assert json.loads(ds.attrs["policy_params"])["random"] == {"per_query": False}
    mass = ds["evicted_attention_mass"].values
    assert mass.shape == ds["kl"].shape and np.all((mass >= 0) & (mass <= 1 + 1e-5)) and mass.max() > 0.05
    assert np.all(ds["kept_tokens"].sel(budget=16).values == 16)
    assert ds.sizes["target"] == 18 and not Path(str(out) + ".shards").exists()

    js = tmp_path / "cmp.json"
    r = cli("compare-policies", out, "--bootstrap", 200, "--fit-range", "8:32", "--json-out", js, "--plot-out", tmp_path / "fig")
    assert r.exit_code == 0, r.output
    assert "ratio random / sink_recent of mean kl" in r.output and "alpha =" in r.output
    assert (tmp_path / "fig.png").stat().st_size > 1000 and (tmp_path / "fig.pdf").is_file()
    doc = json.loads(js.read_text())
    assert doc["policies"] == ["sink_recent", "random"] and doc["budgets"] == [8, 16, 32]
    kl_rs = {r_["budget"]: r_ for r_ in doc["ratios"] if r_["metric"] == "kl"}
    means = ds["kl"].mean("target")
    for k, row in kl_rs.items():
        want = float(means.sel(policy="random", budget=k) / means.sel(policy="sink_recent", budget=k))
        assert row["value"] == pytest.approx(want, rel=1e-5)
        assert row["ci"][0] <= row["value"] <= row["ci"][1]
    fits = [f for f in doc["fits"] if f["metric"] == "kl"]
    assert {f["policy"] for f in fits} == {"sink_recent", "random"} and all(f["status"] == "ok" for f in fits)

    # the truncation alpha beside the policies'
    trunc = tmp_path / "trunc.nc"
    run_measure(measure_cfg(tiny_llama_dir, corpus_dir, trunc, windows=[4, 8, 16, 32]))
    r = cli("compare-policies", out, "--bootstrap", 50, "--fit-range", "4:32", "--truncation", trunc, "--no-plot")
    assert r.exit_code == 0, r.output
    assert "truncation" in r.output


def test_single_policy_prefill_evict_and_resume(tiny_llama_dir, corpus_dir, tmp_path):
    kw = dict(policies=["poisson"], budgets=[8, 16], semantics="prefill_evict", n_sink=2, docs_per_shard=2)
    full = run_measure(retention_cfg(tiny_llama_dir, corpus_dir, tmp_path / "full.nc", **kw))
    part = tmp_path / "part.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(retention_cfg(tiny_llama_dir, corpus_dir, part, **kw), stop_after_shards=1)
    with pytest.raises(MeasureError, match="--resume"):
        run_measure(retention_cfg(tiny_llama_dir, corpus_dir, part, **kw))
    resumed = run_measure(retention_cfg(tiny_llama_dir, corpus_dir, part, resume=True, **kw))
    assert resumed.shards_reused == 1 and full.n_targets == resumed.n_targets == 18
    a, b = results.load(tmp_path / "full.nc"), results.load(part)
    assert a["kl"].dims == ("target", "budget") and a.attrs["policy"] == "poisson"
    for name in (*METRICS, "kept_tokens", "evicted_attention_mass"):
        np.testing.assert_array_equal(a[name].values, b[name].values)
    assert a["kept_tokens"].values.std() > 0  # Poisson draws: the kept count varies around the budget
    r = cli("compare-policies", part, "--bootstrap", 50, "--fit-range", "8:16", "--no-plot")
    assert r.exit_code == 0, r.output
    assert "ratio random/sink_recent skipped" in r.output


def zero_key_model(src: str, dst: Path) -> str:
    loaded = load_model(src)
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            layer.self_attn.k_proj.weight.zero_()
    loaded.model.save_pretrained(dst)
    loaded.tokenizer.save_pretrained(dst)
    return str(dst)


def test_bad_input_clear_message_and_nothing_lost(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "kept.nc"
    run_measure(retention_cfg(tiny_llama_dir, corpus_dir, out, policies=["suffix"], budgets=[8], semantics="reencode"))
    before = out.read_bytes()
    base = ["measure", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", N, "--out", out, "--no-progress",
            "--overwrite"]  # past the existing-file check: each bad option must still be caught before anything is written
    zero = zero_key_model(tiny_llama_dir, tmp_path / "zero_keys")
    cases = [
        (["--policy", "sink_recent", "--budgets", "16,128"], "budget 128 is larger than the available context of 64 tokens"),
        (["--policy", "lru", "--budgets", "16"], "unknown policy 'lru'"),
        (["--policy", "poisson", "--budgets", "16", "--semantics", "reencode"], "policy poisson cannot be run with semantics reencode"),
        (["--policy", "random", "--budgets", "16", "--semantics", "sliding"], "unknown semantics 'sliding'"),
        (["--policy", "suffix", "--budgets", "16", "--positions", "reindexed"], "positions='reindexed' (--positions reindexed) works only with semantics (--semantics) reencode"),
        (["--policy", "sink_recent", "--budgets", "3"], "below its minimum of 5"),
        (["--policy", "suffix", "--windows", "4,8"], "windows (--windows) is for suffix truncation"),
        (["--budgets", "16"], "error: budgets (--budgets) needs policies (--policy NAME)"),  # names only what was given
        (["--budgets", "16", "--semantics", "streaming"], "error: budgets (--budgets) and semantics (--semantics) need policies"),
        (["--policy", "suffix", "--budgets", "16", "--docs-per-shard", "0"], "docs_per_shard (--docs-per-shard) must be at least 1"),
        (["--policy", "suffix", "--budgets", "16", "--max-docs", "0"], "max_docs (--max-docs) must be at least 1"),
        (["--policy", "suffix", "--budgets", "16", "--reference-context", "0"], "reference_context (--reference-context) must be at least 1"),
        (["--policy", "poisson", "--budgets", "16", "--score", "key_norm", "--model", zero], "poisson scores are all zero"),
    ]
    for extra, message in cases:
        r = cli(*base, *extra)
        assert r.exit_code == 2, (extra, r.output)
        assert "error:" in r.output and message in r.output, (extra, r.output)
        assert out.read_bytes() == before, extra
    r = cli("compare-policies", tmp_path / "missing.nc")
    assert r.exit_code == 2 and "not found" in r.output
    trunc = tmp_path / "trunc.nc"
    run_measure(measure_cfg(tiny_llama_dir, corpus_dir, trunc, windows=[4, 8]))
    r = cli("compare-policies", trunc)
    assert r.exit_code == 2 and "needs a policy results file" in r.output
    with pytest.raises(PolicyError, match="larger than the available context"):
        run_measure(retention_cfg(tiny_llama_dir, corpus_dir, tmp_path / "x.nc", policies=["random"], budgets=[65]))


def test_compare_policies_refuses_an_explicit_policy_not_in_the_file(tmp_path):
    from typer.testing import CliRunner

    m = {name: np.full((1, 2, 2), 0.1) for name in METRICS}
    ds = results.make_results(m, "budget", [16, 32], ["a", "b"], [64, 65], [0, 0],
                              {**{k: "" for k in results.REQUIRED_ATTRS}, "semantics": "streaming", "positions": "original", "n_sink": 0,
                               "reference_context": 64, "seed": 0, "policy": "suffix"}, policies=["suffix"])
    path = results.save(ds, tmp_path / "p.nc")
    out = CliRunner().invoke(app, ["compare-policies", str(path), "--numerator", "bogus", "--no-plot", "--bootstrap", "0"])
    assert out.exit_code == 2
    assert "error: numerator (--numerator) 'bogus' is not a policy of" in out.output and "(it has suffix)" in out.output
