"""``truncsens certify``: bad input gives one error line, exit 2 and no file; a small run on a tiny
Llama writes the results schema, the figures and a JSON summary whose numbers follow from the file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from truncsens import results
from truncsens.certificates.statistics import coverage
from truncsens.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("args,message", [
    (["--delta", "0"], "delta (--delta) must lie strictly between 0 and 1"),
    (["--delta", "1.5"], "delta (--delta) must lie strictly between 0 and 1"),
    (["--budgets", "120%"], "percentage of the reference context must lie in (0%, 100%]"),
    (["--budgets", "64", "--reference-context", "64"], "at or above the reference context of 64 tokens"),
    (["--budgets", "100%", "--reference-context", "64"], "at or above the reference context"),
    (["--model", "synthetic:1.0"], "does not use transformers' attention interface"),
    (["--semantics", "reencode"], "semantics='reencode' (--semantics reencode): a re-encoded context has no cache to certify"),
    (["--semantics", "streaming", "--policies", "poisson,h2o"],
     "policies (--policies) h2o under semantics='streaming' (--semantics streaming): a certificate needs a known sampling design"),
    (["--policies", "topk,random"], "policies (--policies) must include poisson"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, tiny_llama_dir, corpus_dir, args, message):
    base = ["certify", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--out", str(tmp_path / "c.nc"), "--no-progress"]
    res = runner.invoke(app, base + args)
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output
    assert list(tmp_path.iterdir()) == []


def test_small_run_writes_results_figures_and_json(tmp_path, tiny_llama_dir, corpus_dir):
    out = tmp_path / "c.nc"
    res = runner.invoke(app, ["certify", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
                              "--budgets", "25%,40", "--targets-per-doc", "2", "--max-docs", "3", "--out", str(out),
                              "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    ds = results.load(out)
    assert dict(ds.sizes) == {"policy": 3, "target": 6, "budget": 2, "layer": 2, "head": 4}
    assert [int(b) for b in ds["budget"].values] == [16, 40]
    assert ds.attrs["semantics"] == "prefill_evict" and float(ds.attrs["delta"]) == 0.05
    assert np.isnan(ds["radius_eb"].sel(policy="topk")).all() and np.isfinite(ds["attn_error"]).all()
    np.testing.assert_array_equal(ds["kept_tokens"].sel(policy="topk").values, [[16, 40]] * 6)
    first = summary["budgets"][0]
    sel = ds.sel(policy="poisson", budget=16)
    tail = sel["has_tail"].values > 0
    expected = coverage(sel["attn_error"].values[tail], sel["radius_eb"].values[tail])
    assert first["coverage_eb"]["covered"] == expected["covered"] and first["coverage_eb"]["n"] == 6 * 2 * 4
    # the emitted certificate: r_EB + b·||o^|| with b declared from the dtype (float32: 64 eps)
    b = float(ds.attrs["arithmetic_bound_relative"])
    assert b == pytest.approx(64 * float(np.finfo(np.float32).eps))
    np.testing.assert_allclose(sel["radius_certificate"].values, sel["radius_eb"].values + b * sel["attn_hat_norm"].values)
    expected = coverage(sel["attn_error"].values[tail], sel["radius_certificate"].values[tail])
    assert first["coverage_certificate"]["covered"] == expected["covered"] and first["coverage_certificate"]["n"] == 48
    assert [c["nominal"] for c in first["calibration"]] == pytest.approx([0.8, 0.9, 0.95, 0.99])
    # the two statements in --json: r_EB's coverage and the emitted certificate's per delta, and the tau curve
    st = summary["statements"]
    at95 = [d for d in st["statistical"]["by_delta"] if d["delta"] == 0.05][0]
    assert at95["by_budget"][0]["coverage"]["covered"] == first["coverage_eb"]["covered"]
    assert len(at95["by_budget"][0]["by_layer"]) == 2 and st["emitted"]["tolerance_relative"] == b
    curve = {t["tau"]: t["coverage"]["covered"] for t in first["tolerance_curve"]}
    assert curve[0.0] == first["coverage_eb"]["covered"] and curve[b] == first["coverage_certificate"]["covered"]
    assert len(first["variance_check"]["by_head"]["variance_over_mse"]) == 2  # [layer][head]
    mass = ds["attn_tail_mass"]  # the full-cache attention share on the keys drawn at random
    assert (mass.sel(policy="topk") == 0).all() and ((mass >= 0) & (mass <= 1)).all()
    assert (mass.sel(policy="poisson").values[ds["has_tail"].sel(policy="poisson").values == 0] == 0).all()
    assert len(first["variance_check"]["by_head"]["median_tail_mass"]) == 2
    assert first["kl"]["poisson"]["mean"] == pytest.approx(float(sel["kl"].mean()), rel=1e-5)
    # failures on these targets (wrong top-1 or NLL > ln 4), counted by hand
    fail = np.concatenate([(ds.sel(policy="poisson", budget=k)["argmax_kept"].values != ds["token_id"].values)
                           | (ds.sel(policy="poisson", budget=k)["nll_kept"].values > math.log(4)) for k in (16, 40)])
    assert summary["auc"]["n_failures"] == int(fail.sum()) == 12  # the random tiny model fails every target
    assert summary["auc"]["failure"]["certificate"]["value"] is None  # no success: no AUC, null in JSON (hand case below)
    for path in summary["files"]:
        assert (tmp_path / path.split("/")[-1]).is_file()
    again = runner.invoke(app, ["certify", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--out", str(out)])
    assert again.exit_code == 2 and "already exist" in again.output  # the figures and the file are not replaced
    assert str(out) in again.output and "-reliability.png" in again.output  # one message names all of them


def test_failure_aucs_by_hand():
    import xarray as xr

    from truncsens.certificates.coverage_report import failure_aucs

    # 4 targets in 4 documents, one budget, one layer and head; radius / norm = certificate score
    token = np.array([1, 2, 3, 4])
    ds = xr.Dataset(
        {"radius_eb": (("policy", "target", "budget", "layer", "head"), np.array([0.9, 0.1, 0.5, 0.3]).reshape(1, 4, 1, 1, 1)),
         "attn_norm": (("policy", "target", "budget", "layer", "head"), np.ones((1, 4, 1, 1, 1))),
         "argmax_kept": (("policy", "target", "budget"), np.array([9, 2, 9, 4]).reshape(1, 4, 1)),  # fails on 0 and 2
         "nll_kept": (("policy", "target", "budget"), np.full((1, 4, 1), 0.1)),
         "nll_ref": (("policy", "target", "budget"), np.full((1, 4, 1), 0.1)),
         "confidence_kept": (("policy", "target", "budget"), np.array([0.9, 0.2, 0.3, 0.8]).reshape(1, 4, 1)),
         "argmax_ref": ("target", np.array([1, 2, 9, 4])),  # the full cache is wrong on 2 only
         "confidence_ref": ("target", np.full(4, 0.5))},
        coords={"policy": ["poisson"], "budget": [16], "token_id": ("target", token), "doc": ("target", ["a", "b", "c", "d"])})
    aucs = failure_aucs(ds, n_boot=0)
    # failures {0, 2} vs successes {1, 3}: certificates 0.9, 0.5 vs 0.1, 0.3 -> every pair ordered: AUC 1
    assert aucs["failure"]["certificate"]["value"] == 1.0
    # -confidence: -0.9, -0.3 vs -0.2, -0.8: pairs (-0.9 > -0.2) no, (-0.9 > -0.8) no, (-0.3 > -0.2) no, (-0.3 > -0.8) yes
    assert aucs["failure"]["confidence"]["value"] == 0.25
    assert (aucs["n_failures"], aucs["n_eviction_caused"], aucs["n_inherent"]) == (2, 1, 1)
    # eviction-caused (0, certificate 0.9) above inherent (2, certificate 0.5): AUC 1
    assert aucs["attribution"]["certificate"]["value"] == 1.0


def test_existing_figures_are_not_replaced_without_overwrite(tmp_path, tiny_llama_dir, corpus_dir):
    out = tmp_path / "c.nc"
    figure = tmp_path / "c-scatter.png"
    figure.write_bytes(b"mine")
    res = runner.invoke(app, ["certify", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
                              "--budgets", "25%", "--max-docs", "1", "--out", str(out), "--no-progress"])
    assert res.exit_code == 2 and "c-scatter.png" in res.output and "--overwrite" in res.output
    assert figure.read_bytes() == b"mine" and not out.exists()  # refused before anything was computed


@pytest.mark.parametrize("command", ["certify", "certify-attribution"])
def test_results_file_and_figure_refused_together_and_a_folder_named_as_one(tmp_path, tiny_llama_dir, corpus_dir,
                                                                            command):
    out = tmp_path / "c.nc"
    out.write_bytes(b"earlier")
    figure = tmp_path / ("c-reliability.png" if command == "certify" else "c-recomputation.png")
    figure.write_bytes(b"mine")
    base = [command, "--model", tiny_llama_dir, "--corpus", corpus_dir, "--no-progress"]
    res = runner.invoke(app, base + ["--out", str(out)])
    assert res.exit_code == 2 and str(out) in res.output and figure.name in res.output, res.output
    assert out.read_bytes() == b"earlier" and figure.read_bytes() == b"mine"
    folder = tmp_path / "folder"
    folder.mkdir()
    res = runner.invoke(app, base + ["--out", str(folder), "--overwrite"])  # --overwrite cannot help: say so
    assert res.exit_code == 2 and f"{folder} is a folder" in res.output and "--overwrite" not in res.output


def test_streaming_run_records_its_process_and_certifies_from_the_cache(tmp_path, tiny_llama_dir, corpus_dir):
    """A small streaming run: the attrs say which process was simulated; poisson's records have a
    design (finite radii where it drew), sink_recent's radii are NaN, and the summary's coverage is
    that of the file's records."""
    out = tmp_path / "s.nc"
    res = runner.invoke(app, ["certify", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "48",
                              "--budgets", "16", "--targets-per-doc", "1", "--max-docs", "2", "--semantics", "streaming",
                              "--policies", "poisson,sink_recent", "--out", str(out), "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    ds = results.load(out)
    assert ds.attrs["semantics"] == "streaming" and ds.attrs["certified_process"].startswith("streaming: ")
    assert list(ds["policy"].values) == ["poisson", "sink_recent"]
    assert np.isnan(ds["radius_eb"].sel(policy="sink_recent")).all() and np.isfinite(ds["attn_error"]).all()
    sel = ds.sel(policy="poisson", budget=16)
    tail = sel["has_tail"].values > 0
    assert tail.any() and np.isfinite(sel["radius_eb"].values[tail]).all()
    expected = coverage(sel["attn_error"].values[tail], sel["radius_eb"].values[tail])
    assert summary["budgets"][0]["coverage_eb"]["covered"] == expected["covered"]
