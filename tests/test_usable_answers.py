"""Answers a user can act on: one --device default for every command that runs a model, ..."""

from __future__ import annotations

import importlib
import inspect

import pytest

import truncsens

MODEL_COMMANDS = ("measure", "plan", "certify", "certify_attribution")


def _default(function, name: str = "device"):
    default = inspect.signature(function).parameters[name].default
    return getattr(default, "default", default)  # typer.Option(...) holds its default


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_command_that_runs_a_model_defaults_to_device_auto(command):
    from truncsens.certificates.config import CertifyConfig
    from truncsens.engine.config import MeasureConfig

    cli = getattr(importlib.import_module(f"truncsens.cli.{command}"), command)
    assert _default(cli) == "auto"
    api = _default(getattr(truncsens, command))
    assert api in ("auto", None)  # None: the default below
    for cls in (MeasureConfig, CertifyConfig):
        assert cls.__dataclass_fields__["device"].default == "auto"


def test_resume_from_another_working_directory_with_relative_paths(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch):
    import os

    from truncsens.engine.config import MeasureConfig
    from truncsens.engine.measure import run_measure
    from truncsens.engine.run.shards import MeasureInterrupted

    def config(cwd, resume=False):
        monkeypatch.chdir(cwd)
        return MeasureConfig(model=os.path.relpath(tiny_llama_dir), corpus=os.path.relpath(corpus_dir), reference_context=64,
                             windows=[1, 4, 16], targets_per_doc=3, docs_per_shard=2, out=str(tmp_path / "r.nc"),
                             resume=resume, progress=False)

    (tmp_path / "a" / "b").mkdir(parents=True)
    with pytest.raises(MeasureInterrupted):
        run_measure(config(tmp_path / "a"), stop_after_shards=1)
    resumed = run_measure(config(tmp_path / "a" / "b", resume=True))  # other relative paths to the same files
    assert resumed.shards_reused == 1 and resumed.n_targets == 18


def test_a_refused_resume_says_which_values_differ(tmp_path):
    import json

    from truncsens.engine.config import MeasureError
    from truncsens.engine.run.shards import prepare_shard_dir

    shards = tmp_path / "r.nc.shards"
    shards.mkdir()
    (shards / "shard-00000.nc").write_bytes(b"")
    (shards / "run.json").write_text(json.dumps({"model": "tiny", "corpus": "docs", "seed": 0}))
    with pytest.raises(MeasureError) as err:
        prepare_shard_dir(shards, {"model": "/data/tiny", "corpus": "docs", "seed": 0}, resume=True)
    assert ("(model differ); the shards have model = 'tiny', this run model = '/data/tiny'; "
            "rerun with the same options or delete the folder") in str(err.value)


def _tiny_llama(**extra):
    """A random 2-layer Llama object (4 heads of 8 dims, 2 key/value heads, 64 positions) and the test tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **extra))
    return model.eval(), tok


def _texts(n: int = 3, words: int = 120) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [" ".join(rng.choice("alpha beta gamma delta def return class import self".split(), size=words)) for _ in range(n)]


def test_kv_memory_of_a_model_measured_in_memory_is_read_from_its_config():
    model, tok = _tiny_llama()
    ds = truncsens.measure(model, tok, texts=_texts(), reference_context=32, windows=[1, 4, 16], targets_per_doc=4,
                           progress=False)
    assert ds.attrs["model_config"]["num_key_value_heads"] == 2  # kept in the file: it is on no disk
    [rec] = truncsens.recommend_window(ds, 0.9, bootstrap=0)
    # 2 (K, V) x 2 layers x 2 kv heads x 8 head dims x 4 bytes = 256 bytes per cached token
    assert rec.window is not None and rec.kv_bytes == 256 * rec.window
    assert not any("not available" in n for n in rec.notes)
    assert any(n.startswith("KV bytes = 2 x 2 layers x 2 kv heads x 8 head dim x 4 bytes") for n in rec.notes)


def _tiny_mistral():
    """A random 2-layer Mistral object, both layers sliding with window 4, and the test tokenizer."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from conftest import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             sliding_window=4, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval(), tok


def test_reencode_with_sinks_on_a_sliding_window_model_records_its_window_rule(tmp_path):
    import numpy as np

    from truncsens import results
    from truncsens.report.printed import format_results_header

    model, tok = _tiny_mistral()
    run = dict(texts=_texts(), reference_context=16, windows=[4, 8], targets_per_doc=2, progress=False)
    with_sinks = truncsens.measure(model, tok, sinks=2, **run)
    without = truncsens.measure(model, tok, sinks=0, **run)
    assert with_sinks.attrs["sliding_window_distance"] == "original_position"
    # every layer slides with W = 4 <= w: by original-position distance the sinks (positions 0, 1) are out of
    # every window, so keeping them changes nothing
    # (equal to float32 rounding: the two passes have other lengths, so AVX2 and AVX-512 kernels round them
    # apart by up to 2e-7; a sink a layer could see would move TV by orders of magnitude more)
    np.testing.assert_allclose(with_sinks["tv"].values, without["tv"].values, rtol=0, atol=1e-6)
    header = format_results_header("r.nc", with_sinks.attrs, with_sinks.sizes["target"])
    assert header.endswith("; sliding-window layers apply their window W by original-position distance "
                           "(the 2 sinks are seen only within W of the query)")
    reindexed = truncsens.measure(model, tok, sinks=2, positions="reindexed", **run)
    assert reindexed.attrs["sliding_window_distance"] == "reindexed_position"
    assert float(np.abs(reindexed["tv"].values - without["tv"].values).max()) > 1e-3  # there the sinks are read

    llama, ltok = _tiny_llama()
    plain = truncsens.measure(llama, ltok, **run)
    assert "sliding_window_distance" not in plain.attrs  # no sliding layers: no rule, no words in the header
    assert "sliding" not in format_results_header("r.nc", plain.attrs, plain.sizes["target"])

    old = with_sinks.copy()
    del old.attrs["sliding_window_distance"]  # a file from before the attr still loads
    results.save(old, tmp_path / "old.nc")
    assert "sliding_window_distance" not in results.load(tmp_path / "old.nc").attrs
    bad = with_sinks.copy()
    bad.attrs["sliding_window_distance"] = "sequence index"
    with pytest.raises(results.ResultsError, match="sliding_window_distance.*original_position"):
        results.save(bad, tmp_path / "bad.nc")  # refused on save, or else on load
        results.load(tmp_path / "bad.nc")


POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_a_window_beyond_the_reference_context_is_no_recommendation():
    import json
    import math
    import re

    from truncsens.budget.recommend import recommend
    from truncsens.fits.fitting import FitConfig, fit_datasets
    from truncsens.report.printed import format_recommendations
    from truncsens.results.constructed import curve_results

    f = lambda w: 0.01 * (1599.5 / w) ** 0.5  # noqa: E731 - D(w) = 0.01 at w = 1599.5, beyond N = 1024
    ds = curve_results({"tv": f}, POW2, n_docs=6, seed=2, reference_context=1024, attrs={"max_context": 4096})
    doc = fit_datasets([ds], FitConfig(metrics=("tv",), families=("power",), n_boot=20), ["x.nc"]).to_json()
    beyond, inside, tiny = recommend(doc, [0.01, f(100.0) * 1.001, 1e-30], "tv")  # crossing just below 100
    assert beyond.basis == "law" and beyond.window == 1600 and beyond.context_limit == 1024
    assert beyond.within_context is False and beyond.to_json()["within_context"] is False
    assert inside.basis == "measured" and inside.window == 100 and inside.within_context is True
    assert inside.to_json()["within_context"] is True
    rows = format_recommendations([beyond, inside, tiny]).splitlines()[2:5]
    assert "> N = 1024 (law extrapolates 1,600 [" in rows[0] and "measured" not in rows[0]
    assert "100 [" in rows[1] and " measured " in rows[1]
    # eps = 1e-30: w = 1599.5 * (0.01 / 1e-30)^2 = 1.5995e59 tokens, a 60-digit integer: printed in scientific notation
    assert tiny.window == pytest.approx(1.5995e59, rel=1e-3) and tiny.window == math.ceil(tiny.w_law)
    assert re.search(r"> N = 1024 \(law extrapolates 1\.\d+e\+59 \[\S+e\+\d+, \S+e\+\d+\]\)", rows[2])
    assert not re.search(r"\d{10}", "\n".join(rows)) and rows[0].rstrip().endswith("-") and rows[2].rstrip().endswith("-")
    js = json.loads(json.dumps(tiny.to_json()))
    assert js["within_context"] is False and isinstance(js["window"], float) and js["window"] == pytest.approx(1599.5e56, rel=1e-3)


def test_token_counts_are_printed_capped():
    import math

    from truncsens.budget.windows import format_tokens, format_tokens_short

    assert [format_tokens(n) for n in (949, 66662, 10**9 - 1, 10**9, 55664275880476504863, math.inf, None)] == [
        "949", "66,662", "999,999,999", "1e+09", "5.566e+19", "inf", "-"]
    assert [format_tokens_short(x) for x in (743.0, 9999.0, 27900.0, 166800.0, 4.1e6, 2.952e64, math.inf, 948.3)] == [
        "743", "9999", "27.9k", "167k", "4.1M", "2.95e+64", "inf", "948.3"]


def _curve_file(path):
    from truncsens import results
    from truncsens.results.constructed import curve_results

    ds = curve_results({"tv": lambda w: 0.5 * w**-0.5, "kl": lambda w: 2.0 * w**-0.7}, POW2, n_docs=6, seed=2,
                       reference_context=1024, doc_noise=0.1)
    results.save(ds, path)
    return path


def test_fit_and_recommend_window_say_each_stage_in_a_log(tmp_path):
    from typer.testing import CliRunner

    from truncsens.cli.main import app

    nc = _curve_file(tmp_path / "c.nc")
    r = CliRunner().invoke(app, ["fit", str(nc), "-m", "tv,kl", "--family", "power", "--bootstrap", "20",
                                 "--out", str(tmp_path / "c.fit.json")])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == ["fit: reading 1 results file",
                                     "fit: fitting c tv: 1 family, 20 bootstrap resamples (1/2)",
                                     "fit: fitting c kl: 1 family, 20 bootstrap resamples (2/2)"]
    quiet = CliRunner().invoke(app, ["fit", str(nc), "-m", "tv,kl", "--family", "power", "--bootstrap", "20",
                                     "--out", str(tmp_path / "q.fit.json"), "--no-progress"])
    assert quiet.stderr == "" and quiet.stdout.replace("q.fit.json", "c.fit.json") == r.stdout  # stdout unchanged
    rec = CliRunner().invoke(app, ["recommend-window", str(nc), "--eps", "0.1", "--bootstrap", "20"])
    # the progress line, then the recommendation's notes (stderr, as warnings are)
    assert rec.exit_code == 0 and rec.stderr.splitlines()[0] == "recommend-window: fitting c tv: 3 families, 20 bootstrap resamples (1/1)"
    assert all(line.startswith(("note: ", "warning: ")) for line in rec.stderr.splitlines()[1:])
    from_fit = CliRunner().invoke(app, ["recommend-window", str(tmp_path / "c.fit.json"), "--eps", "0.1"])
    # nothing long: no progress said, only the notes
    assert from_fit.exit_code == 0 and all(line.startswith(("note: ", "warning: ")) for line in from_fit.stderr.splitlines())


def test_stages_are_a_bar_on_a_terminal(monkeypatch):
    import io

    from truncsens.engine.run.progress import StageProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    with StageProgress("fit") as stages:
        stages("fitting a tv", 1, 2)
        stages("fitting a kl", 2, 2)
    text = err.getvalue()
    assert "\r" in text and "fitting a kl" in text and "2/2" in text and "(1/2)" not in text  # frames, not lines


def test_measure_says_what_it_does_before_its_first_shard(tiny_llama_dir, corpus_dir, tmp_path, capsys):
    from truncsens.engine.config import MeasureConfig
    from truncsens.engine.measure import run_measure

    run_measure(MeasureConfig(model=tiny_llama_dir, corpus=corpus_dir, reference_context=64, windows=[1, 4], max_docs=2,
                              targets_per_doc=1, out=str(tmp_path / "r.nc"), progress=True))
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == f"measure: loading model {tiny_llama_dir}"
    assert lines[1].startswith("measure: tokenizing ") and lines[1].endswith(f" documents of corpus {corpus_dir}")
    assert int(lines[1].split()[2]) >= 2 and lines[2].startswith("measure: shard 1/1 done")
    assert "loading" not in captured.out and "tokenizing" not in captured.out  # stdout stays the tables'
