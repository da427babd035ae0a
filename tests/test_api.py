"""The Python API (truncsens.measure, fit, recommend_window, load, ...): a model object measured in memory
on a list of strings equals the command line on the same model saved to disk; the fit's table is the
text `truncsens fit` prints; keyword names are the commands' options."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
import xarray as xr
from typer.testing import CliRunner

import truncsens
from truncsens.cli.main import app
from truncsens.corpora import CorpusError

from conftest import build_tokenizer

N, WINDOWS, PER_DOC = 32, [1, 4, 16], 4
WORDS = "alpha beta gamma delta def return class import self print value index".split()


def _texts(n: int = 3, words: int = 120) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=words)) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Llama object (vocab of the test tokenizer, 64 positions) and its tokenizer, in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))
    with torch.no_grad():  # larger weights than the default init, so distributions differ visibly
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model, tok


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """The same measurement twice: in memory through the API, and by `truncsens measure` on the model saved
    to disk and the texts written as a folder corpus (files named by the API's document ids)."""
    model, tok = tiny
    root = tmp_path_factory.mktemp("api")
    texts = _texts()
    ds = truncsens.measure(model, tok, texts=texts, reference_context=N, windows=WINDOWS, targets_per_doc=PER_DOC,
                           progress=False)
    folder, corpus = root / "model", root / "texts"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    corpus.mkdir()
    for i, text in enumerate(texts):
        (corpus / f"text-{i:05d}").write_text(text)
    out = root / "cli.nc"
    result = CliRunner().invoke(app, ["measure", "--model", str(folder), "--corpus", str(corpus), "--reference-context",
                                      str(N), "--windows", ",".join(map(str, WINDOWS)), "--targets-per-doc", str(PER_DOC),
                                      "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    return ds, out, texts, root


def test_measure_a_model_object_in_memory_equals_the_cli_on_disk(tiny, runs):
    ds, out, _, _ = runs
    cli = truncsens.load(out)
    assert ds.sizes == cli.sizes and ds.sizes["target"] == 3 * PER_DOC and ds["window"].values.tolist() == WINDOWS
    assert ds["doc"].values.tolist() == cli["doc"].values.tolist() == [f"text-{i:05d}" for i in range(3) for _ in range(PER_DOC)]
    np.testing.assert_array_equal(ds["position"].values, cli["position"].values)
    np.testing.assert_array_equal(ds["token_id"].values, cli["token_id"].values)
    for name in ("tv", "kl", "kl_reverse", "js", "nll_ref", "nll_kept"):
        np.testing.assert_allclose(ds[name].values, cli[name].values, rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(ds["top1_agree"].values, cli["top1_agree"].values)
    assert float(ds["tv"].values.mean()) > 0.01  # a random model still depends on its context
    assert ds.attrs["corpus_sha256"] == cli.attrs["corpus_sha256"]  # same ids and texts
    assert ds.attrs["model"] == "LlamaForCausalLM (passed in memory)" and cli.attrs["model"].endswith("model")
    assert ds.attrs["corpus"] == ds.attrs["domain"] == "texts" and ds.attrs["device"] == "cpu"
    assert ds.attrs["command"] == (f"truncsens.measure(LlamaForCausalLM, {type(tiny[1]).__name__}, texts=<3 texts>, "
                                   f"reference_context={N}, windows={WINDOWS}, targets_per_doc={PER_DOC}, progress=False)")


def test_measure_out_keeps_the_file_it_returns(tiny, runs, tmp_path):
    model, tok = tiny
    ds, _, texts, _ = runs
    kept = truncsens.measure(model, tok, texts=texts, reference_context=N, windows=WINDOWS, targets_per_doc=PER_DOC,
                             progress=False, out=tmp_path / "r.nc")
    xr.testing.assert_identical(kept, truncsens.load(tmp_path / "r.nc"))
    np.testing.assert_array_equal(kept["kl"].values, ds["kl"].values)
    with pytest.raises(ValueError, match="exists"):  # as the command: no silent replacement
        truncsens.measure(model, tok, texts=texts, reference_context=N, windows=WINDOWS, progress=False,
                          out=tmp_path / "r.nc")


@pytest.mark.parametrize("call, message", [
    (lambda m, t: truncsens.measure(m, t, texts=["a"], windows=[0, 4]), "windows (--windows) must be at least 1 token each, got 0"),
    (lambda m, t: truncsens.measure(m, t, texts=["a"], split="validation"), "split (--split) must be one of auto, "),
    (lambda m, t: truncsens.measure(m, t, texts=["a"], policies=["sink_recent"], chunk=0), "chunk (--chunk) must be at least 1, got 0"),
    (lambda m, t: truncsens.measure(m, t, texts=["a"], protocol="nope"), "protocol (--protocol) must be one of "),
    (lambda m, t: truncsens.plan(m, t, average_windows=[0]), "average_windows (--average-window) must be at least 1 token, got 0"),
    (lambda m, t: truncsens.plan(m, t, semantics="reencode"), "semantics (--semantics) must be one of "),
    (lambda m, t: truncsens.certify(m, t, delta=2.0), "delta (--delta) must lie strictly between 0 and 1, got 2.0"),
    (lambda m, t: truncsens.certify(m, t, obs_window=0), "obs_window (--obs-window) must be at least 1 query row, got 0"),
])
def test_api_errors_name_the_keyword_then_the_flag(tiny, call, message):
    """A Python call is told the keyword it passed (the command's flag beside it, in brackets), before any
    model pass."""
    model, tok = tiny
    with pytest.raises(ValueError) as err:
        call(model, tok)
    assert str(err.value).startswith(message), str(err.value)


def test_measure_refuses_unclear_input(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="needs its tokenizer"):
        truncsens.measure(model, texts=["a"], reference_context=N)
    with pytest.raises(ValueError, match="tokenizer is for a model object"):
        truncsens.measure("reference", tok, texts=["a"])
    with pytest.raises(ValueError, match="texts or corpus, not both"):
        truncsens.measure(model, tok, texts=["a"], corpus="nl")
    with pytest.raises(CorpusError, match="not one string"):
        truncsens.measure(model, tok, texts="one document")
    with pytest.raises(ValueError, match="holds float32 weights, not bfloat16"):
        truncsens.measure(model, tok, texts=["a"], dtype="bfloat16")
    with pytest.raises(ValueError, match=r"no document is long enough.*lower reference_context \(--reference-context\)"):
        truncsens.measure(model, tok, texts=["too short"], reference_context=N, progress=False)


def test_a_model_object_comes_back_as_it_was(tiny, monkeypatch):
    """The caller's model, in train() mode with one decoder layer in eval(), keeps those modes after a
    run (which measures in eval mode) and after a run that stops with an error once the model is in
    eval mode; an attention implementation the run switches (the block protocol picks a CUDA kernel:
    here a stand-in switches to eager) is switched back, and no hook stays behind."""
    from truncsens.engine.block import runs as block_runs

    model, tok = tiny
    model.train()
    model.model.layers[0].eval()
    modes = {name: m.training for name, m in model.named_modules()}
    assert modes[""] and not modes["model.layers.0"]
    implementation = model.config._attn_implementation
    seen = []

    def switch(m, device):
        seen.append(m.training)
        m.set_attn_implementation("eager" if implementation != "eager" else "sdpa")
        m.model.layers[1].self_attn.register_forward_hook(lambda *args: None)
        return m.config._attn_implementation

    monkeypatch.setattr(block_runs, "choose_attention", switch)
    try:
        truncsens.measure(model, tok, texts=_texts(), reference_context=N, windows=[4], targets_per_doc=2,
                          protocol="block", progress=False)
        assert seen == [False]  # measured in eval mode
        assert {name: m.training for name, m in model.named_modules()} == modes
        assert model.config._attn_implementation == implementation
        assert not any(m._forward_hooks for m in model.modules())
        with pytest.raises(ValueError, match="no document is long enough"):
            truncsens.measure(model, tok, texts=["too short"], reference_context=N, progress=False)
        assert {name: m.training for name, m in model.named_modules()} == modes
    finally:
        model.eval()


@pytest.mark.parametrize("function,options,message", [
    ("certify", dict(corpus="/nonexistent/folder"), "does not exist"),
    ("certify_attribution", dict(), "beyond the model's position limit"),
    ("plan", dict(corpus="/nonexistent/folder"), "does not exist"),
])
def test_the_other_commands_give_the_model_back_in_its_mode(tiny, function, options, message):
    """The other API functions that take a model object put it in eval mode too: a call that stops
    with an error after that gives the model back in train() mode."""
    model, tok = tiny
    model.train()
    try:
        with pytest.raises(ValueError, match=message):
            getattr(truncsens, function)(model, tok, progress=False, **options)
        assert all(m.training for m in model.modules())
    finally:
        model.eval()


def test_fit_table_is_what_the_cli_prints_and_recommend_reads_it(runs):
    _, out, _, root = runs
    cli = CliRunner().invoke(app, ["fit", str(out), "--metric", "tv,kl", "--bootstrap", "20",
                                   "--out", str(root / "cli.fit.json")])
    assert cli.exit_code == 0, cli.output
    report = truncsens.fit(out, metrics="tv,kl", bootstrap=20)
    assert isinstance(report, truncsens.FitReport)
    lines = report.table().split("\n")  # the CLI prints the table's notes on stderr, without their indent
    notes = [ln.lstrip() for ln in lines if ln.lstrip().startswith(("note: ", "warning: "))]
    assert cli.stdout == "\n".join(ln for ln in lines if ln.lstrip() not in notes) + f"\nwrote {root / 'cli.fit.json'}\n"
    assert notes and set(notes) <= set(cli.stderr.splitlines()), cli.stderr
    doc = report.to_json()
    saved = json.loads((root / "cli.fit.json").read_text())
    assert doc["kind"] == "truncsens-fit" and doc["fits"] == saved["fits"]
    assert [f["label"] for f in doc["fits"]][:1] == ["cli"]
    recs = truncsens.recommend_window(report, [0.05, 0.2], metrics=["tv", "kl"])
    from_file = truncsens.recommend_window(root / "cli.fit.json", [0.05, 0.2], metrics=["tv", "kl"])
    assert [(r.metric, r.eps, r.window, r.basis) for r in recs] == [(r.metric, r.eps, r.window, r.basis) for r in from_file]
    assert [(r.metric, r.eps) for r in recs] == [("tv", 0.05), ("tv", 0.2), ("kl", 0.05), ("kl", 0.2)]
    with pytest.raises(ValueError, match=r"eps \(--eps\) for tv"):
        truncsens.recommend_window(report, 2.0)  # a TV above 1: refused before anything else


def test_fit_of_a_dataset_in_memory_and_its_figure(runs, tmp_path):
    ds, out, _, _ = runs
    in_memory = truncsens.fit(ds, metrics=["tv"], families="power", bootstrap=0)
    from_file = truncsens.fit(out, metrics=["tv"], families="power", bootstrap=0)
    assert in_memory.results[0].curve.label == "results" and in_memory.results[0].curve.results_file == ""
    a, b = in_memory.results[0].fits[0]["params"], from_file.results[0].fits[0]["params"]
    assert a["alpha"]["value"] == pytest.approx(b["alpha"]["value"], rel=1e-6) and a["alpha"]["ci"] is None
    paths = in_memory.plot(tmp_path / "fig")
    assert [p.name for p in paths] == ["fig.png", "fig.pdf"] and all(p.stat().st_size > 1000 for p in paths)
    assert not list(tmp_path.glob("*.json"))  # nothing written unless asked
    with pytest.raises(FileExistsError):
        truncsens.fit(ds, metrics="tv", bootstrap=0, plot_out=tmp_path / "fig")
    [rec] = truncsens.recommend_window(ds, 0.05, bootstrap=0)  # a Dataset is fitted on the fly
    assert rec.metric == "tv" and rec.label == "results"
    assert truncsens.fit(ds, bootstrap=0).config.metrics == ("tv", "kl", "kl_reverse", "js")
    old = ds.drop_vars(["kl_reverse", "js"])  # a file from before those metrics: fitted on those it holds
    assert truncsens.fit([old, ds], bootstrap=0).config.metrics == ("tv", "kl")


def test_load_and_the_api_names(runs):
    _, out, _, _ = runs
    ds = truncsens.load(out)
    assert isinstance(ds, xr.Dataset) and ds.attrs["reference_context"] == N
    import truncsens.fits.laws as laws  # the stage folders are plain packages beside the API's verbs

    assert truncsens.fits.laws is laws and not callable(truncsens.fits)
    assert "bootstrap" in inspect.signature(truncsens.fit).parameters
    assert "delta" in inspect.signature(truncsens.certify).parameters
    with pytest.raises(AttributeError):
        truncsens.not_an_api_function


# API keyword -> CLI parameter, where the Python value differs in kind (a list or a dict, not text to parse)
# (measure's --policy and --policy-arg are declared run options: their parameters are the keywords, policies
# and policy_args; tests/test_run_options.py pins the flags)
RENAMED = {"fit": {"metrics": "metric", "families": "family"},
           "recommend_window": {"metrics": "metric"}, "show": {"metrics": "metric"}, "plot": {"metrics": "metric", "fit": "fit_file"}}
CLI_ONLY = {"as_json", "plot", "results_files", "results_file", "file", "source", "fit_file",  # printing, --plot, arguments
            "accepted_progress"}  # --no-progress where there is no progress to silence (show, plot, compare-policies)
API_ONLY = {"tokenizer", "texts", "command", "plot_out"}  # a model object's tokenizer, strings as documents, ...


@pytest.mark.parametrize("command, function", [
    ("measure", "measure"), ("fit", "fit"), ("recommend_window", "recommend_window"), ("compare_policies", "compare_policies"),
    ("certify", "certify"), ("certify_attribution", "certify_attribution"), ("plot", "plot"), ("show", "show")])
def test_keyword_names_are_the_cli_options(command, function):
    import importlib

    cli = set(inspect.signature(getattr(importlib.import_module(f"truncsens.cli.{command}"), command)).parameters)
    params = list(inspect.signature(getattr(truncsens, function)).parameters)
    what = [] if params[0] == "model" else params[:1]  # the results or fit the function works on: the CLI's argument
    keywords = {RENAMED.get(function, {}).get(n, n) for n in params if n not in what}
    options = cli - CLI_ONLY | ({"fit_file"} if function == "plot" else set())  # plot --fit is a keyword
    assert options - keywords == set()  # every option has its keyword, of the same name
    assert keywords - options <= API_ONLY


def test_texts_are_a_corpus_in_the_config_and_only_named_in_the_fingerprint():
    from truncsens.api.measure import measure_config
    from truncsens.corpora import Corpus

    cfg = measure_config("reference", texts=["def f():\n    return 1\n", "x = 2\n"], reference_context=64)
    assert isinstance(cfg.corpus, Corpus) and cfg.corpus_name == "texts"
    assert cfg.out == "results/reference-texts.nc"
    fingerprint = cfg.fingerprint()
    assert fingerprint["corpus"] == "texts" and "return 1" not in repr(fingerprint)
