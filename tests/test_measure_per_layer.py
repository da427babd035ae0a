"""``truncsens measure --per-layer``: a results file with a ``layer`` dim whose
values are, layer by layer, the naive per-layer pruned-cache decode of tests/test_layer_windows.py;
it round-trips, resumes, is shown and fitted per layer, and bad option combinations are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import truncsens
from test_layer_windows import pruned_decode
from truncsens.cli.main import app
from truncsens.engine.config import MeasureError
from truncsens.engine.measure import run_measure
from truncsens.engine.run.shards import MeasureInterrupted
from truncsens.results import load

N, WINDOWS, SINKS = 32, [1, 4, 16], 2
COMMON = dict(reference_context=N, windows=WINDOWS, sinks=SINKS, targets_per_doc=2, max_docs=3, progress=False)


def test_values_are_each_layer_alone_against_a_pruned_cache(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "pl.nc"
    ds = truncsens.measure(tiny_llama_dir, corpus=corpus_dir, per_layer=True, out=out, device="cpu", **COMMON)
    assert ds["kl"].dims == ("layer", "target", "window") and ds["layer"].values.tolist() == [0, 1]
    assert ds.attrs["semantics"] == "prefill_evict" and ds.attrs["n_sink"] == SINKS and ds.attrs["n_layers"] == 2
    assert "alone" in ds.attrs["per_layer"]
    back = load(out)
    assert back.attrs == ds.attrs and np.array_equal(back["kl"].values, ds["kl"].values)
    from transformers import AutoModelForCausalLM
    from truncsens.api.measure import measure_config
    from truncsens.engine.documents import prepare_documents
    from truncsens.models import load_model
    from truncsens.targets import select_targets

    loaded = load_model(tiny_llama_dir, "cpu", "float32")
    cfg = measure_config(tiny_llama_dir, corpus=corpus_dir, per_layer=True, out=tmp_path / "unused.nc", device="cpu", **COMMON)
    targets = select_targets(prepare_documents(cfg, loaded, N).used, N, 2, 0)
    assert [str(d) for d in targets.doc] == [str(d) for d in ds["doc"].values]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = targets.context  # [n, N]
    with torch.no_grad():
        full_out = model(input_ids=ids[:, :-1], use_cache=True)
        full = model(input_ids=ids).logits[:, -1].double().log_softmax(-1)  # [n, V]
    for layer in (0, 1):
        for j, w in enumerate(WINDOWS):
            windows = [w if l == layer else None for l in range(2)]
            lp = pruned_decode(model, ids, full_out.past_key_values, windows, SINKS, [None, None])  # [n, V]
            kl = (full.exp() * (full - lp)).sum(-1).numpy()
            np.testing.assert_allclose(ds["kl"].sel(layer=layer, window=w).values, kl, rtol=1e-4, atol=1e-6)


def test_resume_show_and_fit_per_layer(tiny_llama_dir, corpus_dir, tmp_path):
    from truncsens.api.measure import measure_config

    out = tmp_path / "pl.nc"
    cfg = measure_config(tiny_llama_dir, corpus=corpus_dir, per_layer=True, out=out, device="cpu", docs_per_shard=1,
                         semantics="streaming", **COMMON)
    with pytest.raises(MeasureInterrupted):
        run_measure(cfg, stop_after_shards=1)
    cfg.resume = True
    summary = run_measure(cfg)
    assert summary.shards_reused == 1
    whole = truncsens.measure(tiny_llama_dir, corpus=corpus_dir, per_layer=True, device="cpu", semantics="streaming",
                              docs_per_shard=1, **COMMON)  # the same batches as the resumed run
    resumed = load(out)
    assert resumed.attrs["semantics"] == "streaming"
    np.testing.assert_array_equal(resumed["kl"].values, whole["kl"].values)  # resuming changes nothing
    res = CliRunner().invoke(app, ["show", str(out), "-m", "kl"])
    assert res.exit_code == 0, res.output
    assert "kl  (layer 0)" in res.output and "kl  (layer 1)" in res.output
    report = truncsens.fit(resumed, metrics="kl")
    labels = {r.curve.label for r in report.results}
    assert labels == {"results[layer 0]", "results[layer 1]"}


@pytest.mark.parametrize("options, message", [
    (dict(policies=["h2o"]), "takes --windows, not --policy"),
    (dict(semantics="reencode"), "prefill_evict or streaming"),
    (dict(protocol="block"), "exact protocol only"),
    (dict(positions="reindexed"), "original positions"),
    (dict(granularity="head"), "leave --granularity at token"),
    (dict(model="synthetic:1.0"), "synthetic source"),
])
def test_bad_combinations_are_refused(options, message):
    from truncsens.api.measure import measure_config

    options = {"model": "reference", **options}
    with pytest.raises(MeasureError, match=message):
        measure_config(per_layer=True, **options)


def test_per_layer_files_are_no_cache_budget_and_no_truncation_yardstick(tiny_llama_dir, corpus_dir, tmp_path):
    pl, pol = tmp_path / "pl.nc", tmp_path / "pol.nc"
    truncsens.measure(tiny_llama_dir, corpus=corpus_dir, per_layer=True, out=pl, device="cpu", **COMMON)
    truncsens.measure(tiny_llama_dir, corpus=corpus_dir, policies="h2o", semantics="prefill_evict", budgets=[8, 16],
                      out=pol, device="cpu", reference_context=N, targets_per_doc=2, max_docs=3, progress=False)
    runner = CliRunner()
    res = runner.invoke(app, ["compare-policies", str(pol), "--truncation", str(pl)])
    assert res.exit_code != 0 and "per-layer sweep" in res.output
    assert runner.invoke(app, ["fit", str(pl), "-m", "tv", "--out", str(tmp_path / "f.json")]).exit_code == 0
    res = runner.invoke(app, ["recommend-window", str(tmp_path / "f.json"), "--eps", "0.1"])
    assert res.exit_code != 0 and "use truncsens plan" in res.output
