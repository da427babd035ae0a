"""The ``--bos`` rules (truncsens.engine.bos) equal a naive loop, for each rule and semantics, on a tiny
Llama whose tokenizer adds a BOS; their attrs; and what each refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import save_tiny_llama
from oracles import last_logprobs, naive_pair, prefill_evict_surgery, streaming_loop
from test_documents_rules import bos_tokenizer
from truncsens import results
from truncsens.cli.main import app
from truncsens.corpora import load_corpus
from truncsens.divergences import all_metrics
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.measure import run_measure
from truncsens.models import load_model

N, BUDGETS, WINDOWS = 24, [4, 9], [2, 7]
PREPENDS = {"auto": True, "always": True, "never": False, "document": False}  # for a tokenizer that adds a BOS


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("bos") / "m")
    bos_tokenizer().save_pretrained(folder)
    return load_model(folder)


def naive_documents(corpus_dir, tokenizer, document_bos):
    """Token ids of each document, tokenized here: the text's tokens, after the BOS when ``document_bos``."""
    out = {}
    for d in load_corpus(corpus_dir, "code", "auto", "text").documents:
        ids = tokenizer(d.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        out[d.id] = torch.tensor(([tokenizer.bos_token_id] if document_bos else []) + ids)
    return out


def naive_context(doc: torch.Tensor, t: int, bos: int | None) -> torch.Tensor:
    """x[t-N : t], its first token replaced by the BOS when every context begins with it."""
    context = doc[t - N : t].clone()
    if bos is not None:
        context[0] = bos
    return context


def naive_kept_logprobs(model, context: torch.Tensor, semantics: str, sinks: int, k: int) -> torch.Tensor:
    """sink_recent at budget k (``sinks`` first keys + the k - sinks most recent) under ``semantics``, by the
    oracles: the kept tokens alone (reencode), cache surgery (prefill_evict), or token by token (streaming)."""
    index = list(range(sinks)) + list(range(N - (k - sinks), N))
    if semantics == "reencode":
        return last_logprobs(model, context[index], torch.tensor(index))
    if semantics == "prefill_evict":
        keep = torch.zeros(1, N, dtype=torch.bool)
        keep[0, index] = True
        return prefill_evict_surgery(model, context[None], keep, None)[0]
    q, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    keep = (j <= q) & ((j < sinks) | (j > q - (k - sinks)))  # [N, N]: row q keeps its sinks and its recent keys
    return streaming_loop(model, context[None], keep[None], None)[0]


def measured(tmp_path, loaded, corpus_dir, name, **options) -> "results.xr.Dataset":
    cfg = MeasureConfig(model=loaded.name, corpus=corpus_dir, reference_context=N, targets_per_doc=2, max_docs=2,
                        out=str(tmp_path / f"{name}.nc"), progress=False, **options)
    run_measure(cfg, loaded)
    return results.load(tmp_path / f"{name}.nc")


@pytest.mark.parametrize("semantics", ["reencode", "prefill_evict", "streaming"])
@pytest.mark.parametrize("rule", list(PREPENDS))
def test_policy_sweep_equals_naive_loop(bos_model, corpus_dir, tmp_path, rule, semantics):
    model, tok = bos_model.model, bos_model.tokenizer
    ds = measured(tmp_path, bos_model, corpus_dir, "p", policies=["sink_recent"], budgets=BUDGETS, n_sink=2,
                  semantics=semantics, bos=rule)
    prepend = PREPENDS[rule]
    assert (ds.attrs["bos"], ds.attrs["bos_prepended"], ds.attrs["n_sink"]) == (rule, int(prepend), 2)
    docs = naive_documents(corpus_dir, tok, rule != "never")
    tv = ds["tv"].squeeze("policy", drop=True) if "policy" in ds["tv"].dims else ds["tv"]
    kl = ds["kl"].squeeze("policy", drop=True) if "policy" in ds["kl"].dims else ds["kl"]
    assert tv.sizes["target"] == 4
    for i in range(ds.sizes["target"]):
        doc, t = str(ds["doc"].values[i]), int(ds["position"].values[i])
        context = naive_context(docs[doc], t, tok.bos_token_id if prepend else None)
        assert int(ds["bos_first"].values[i]) == int(context[0] == tok.bos_token_id)
        token = docs[doc][t : t + 1]
        ref = last_logprobs(model, context, torch.arange(N))
        for j, k in enumerate(BUDGETS):
            lp = naive_kept_logprobs(model, context, semantics, 2, k)
            values, _ = all_metrics(ref[None], lp[None], token)
            assert float(tv.values[i, j]) == pytest.approx(float(values["tv"][0]), abs=1e-5), (rule, i, k)
            assert float(kl.values[i, j]) == pytest.approx(float(values["kl"][0]), abs=1e-5), (rule, i, k)
    assert float(tv.min()) > 1e-4  # the tiny model really changes with eviction


@pytest.mark.parametrize("rule", list(PREPENDS))
def test_window_sweep_equals_naive_loop(bos_model, corpus_dir, tmp_path, rule):
    """Window sweeps (re-encode): with the BOS in front of every context it is the first sink, so a window w
    keeps 1 + w keys (``--sinks 0`` raised to 1)."""
    model, tok = bos_model.model, bos_model.tokenizer
    ds = measured(tmp_path, bos_model, corpus_dir, "w", windows=WINDOWS, bos=rule)
    prepend = PREPENDS[rule]
    sinks = 1 if prepend else 0
    assert (ds.attrs["bos"], ds.attrs["bos_prepended"], ds.attrs["n_sink"]) == (rule, int(prepend), sinks)
    docs = naive_documents(corpus_dir, tok, rule != "never")
    for i in range(ds.sizes["target"]):
        doc, t = str(ds["doc"].values[i]), int(ds["position"].values[i])
        context = naive_context(docs[doc], t, tok.bos_token_id if prepend else None)
        for j, w in enumerate(WINDOWS):
            want = naive_pair(model, context, int(docs[doc][t]), w, sinks, "original")
            assert float(ds["tv"].values[i, j]) == pytest.approx(want["tv"], abs=1e-5), (rule, i, w)
            assert float(ds["kl"].values[i, j]) == pytest.approx(want["kl"], abs=1e-5), (rule, i, w)


def test_a_tokenizer_without_bos(tiny_llama_dir, corpus_dir, tmp_path):
    """auto adds nothing and records nothing (the file is as before the rule existed); always puts the
    tokenizer's BOS token in front of every context all the same."""
    loaded = load_model(tiny_llama_dir)
    auto = measured(tmp_path, loaded, corpus_dir, "auto", windows=WINDOWS)
    document = measured(tmp_path, loaded, corpus_dir, "document", windows=WINDOWS, bos="document")
    assert "bos" not in auto.attrs and "bos_prepended" not in auto.attrs and auto.attrs["n_sink"] == 0
    np.testing.assert_array_equal(auto["tv"].values, document["tv"].values)
    always = measured(tmp_path, loaded, corpus_dir, "always", windows=WINDOWS, bos="always")
    assert (always.attrs["bos"], always.attrs["bos_prepended"], always.attrs["n_sink"]) == ("always", 1, 1)
    assert always["bos_first"].values.tolist() == [1] * always.sizes["target"]
    assert not np.array_equal(always["tv"].values, auto["tv"].values)


def test_what_a_bos_in_every_context_refuses(bos_model, corpus_dir, tmp_path):
    with pytest.raises(MeasureError, match="policy h2o keeps no sinks and could evict it"):
        # budgets sink_recent accepts (at least its 4 sinks and one more), so the BOS rule is what refuses
        measured(tmp_path, bos_model, corpus_dir, "h", policies=["sink_recent", "h2o"], budgets=[b for b in BUDGETS if b >= 5])
    with pytest.raises(MeasureError, match=r"protocol='block' \(--protocol block\) shares one sequence between targets"):
        measured(tmp_path, bos_model, corpus_dir, "b", windows=WINDOWS, protocol="block")
    measured(tmp_path, bos_model, corpus_dir, "h2o", policies=["h2o"], budgets=BUDGETS, bos="document")  # as before
    with pytest.raises(MeasureError, match=r"bos \(--bos\) must be one of auto, always, never, document, got 'sometimes'"):
        MeasureConfig(model="reference", bos="sometimes")
    with pytest.raises(MeasureError, match=r"bos='always' \(--bos always\): model 'synthetic:0.5:64' has no tokenizer with a BOS token"):
        run_measure(MeasureConfig(model="synthetic:0.5:64", reference_context=16, max_docs=2, windows=[2], bos="always",
                                  out=str(tmp_path / "s.nc"), progress=False))
    assert not any(tmp_path.glob("[hbs].nc"))


def test_cli_bad_bos_rule(tmp_path):
    result = CliRunner().invoke(app, ["measure", "--bos", "sometimes", "--out", str(tmp_path / "x.nc"), "--no-progress"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: bos (--bos) must be one of auto, always, never, document, got 'sometimes'"]


def test_per_layer_windows_begin_with_the_bos(bos_model, corpus_dir, tmp_path):
    """A per-layer sweep (its 4 sinks by default) reads the same contexts: each begins with the BOS."""
    ds = measured(tmp_path, bos_model, corpus_dir, "l", windows=[4], per_layer=True)
    assert (ds.attrs["bos"], ds.attrs["bos_prepended"], ds.attrs["n_sink"]) == ("auto", 1, 4)
    assert ds["bos_first"].values.tolist() == [1] * ds.sizes["target"]
    document = measured(tmp_path, bos_model, corpus_dir, "ld", windows=[4], per_layer=True, bos="document")
    assert document["bos_first"].values.sum() < document.sizes["target"]
    assert not np.array_equal(ds["tv"].values, document["tv"].values)
