"""truncsens plan: end to end on a tiny model, the JSON round-trips, errors are named."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from truncsens.api.plan import PlanError, plan
from truncsens.cli.main import app


def test_plan_end_to_end_and_json_round_trip(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "plan.json"
    report = plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, average_windows=[8, 24], sweep=[2, 4, 8, 16, 32],
                  sinks=2, targets_per_doc=2, max_docs=6, n_boot=20, out=out, plot_out=tmp_path / "plan", progress=False)
    doc = json.loads(out.read_text())
    assert doc == json.loads(json.dumps(report.to_json()))  # what is written is what the API returns
    assert doc["kind"] == "truncsens-plan" and doc["semantics"] == "prefill_evict" and doc["model_sha256"]
    assert len(doc["layers"]) == 2 and all(law["status"] == "ok" for law in doc["layers"])
    per_token = doc["bytes_per_token_per_layer"]
    for b in doc["budgets"]:
        for name in ("plan", "uniform", "linear"):
            w = np.array(b[name]["windows"])
            assert b[name]["kv_bytes"] == int(per_token * (w + 2).sum()) <= b["kv_bytes"]
            assert np.isfinite(b[name]["measured"]["value"]) and b[name]["measured"]["value"] >= 0
        assert b["plan"]["kvpress_compression_ratios"] == [1 - (w + 2) / 64 for w in b["plan"]["windows"]]
        assert b["additivity"]["sum_of_layers"] > 0
        assert len(b["plan"]["per_target"]) == doc["n_heldout_targets"] == len(doc["heldout_targets"]["doc"])
        assert np.mean(b["uniform"]["per_target"]) == pytest.approx(b["uniform"]["measured"]["value"], rel=1e-9)
    assert report.written == [out, tmp_path / "plan.png", tmp_path / "plan.pdf"]
    assert all(p.stat().st_size > 0 for p in report.written)
    assert "plan / uniform" in report.table()
    with pytest.raises(FileExistsError):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, out=out, progress=False)
    (tmp_path / "afile").write_text("mine")  # an output that cannot be created is refused before any pass
    with pytest.raises(NotADirectoryError, match="afile is a file, not a folder"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, plot_out=tmp_path / "afile" / "p", progress=False)
    (tmp_path / "plan.png").unlink()
    with pytest.raises(FileExistsError, match="plan.pdf"):  # the figure's PDF alone is protected too
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, plot_out=tmp_path / "plan.png", progress=False)


def test_plan_for_a_distortion(tiny_llama_dir, corpus_dir):
    """--eps: the smallest budget whose plan the laws predict at or below eps; an eps the plan at an
    average window of 8 reaches needs at most that window's bytes (within the one token's bytes the
    bisection leaves)."""
    common = dict(corpus=corpus_dir, reference_context=48, sweep=[2, 4, 8, 16], sinks=2, targets_per_doc=1, max_docs=6,
                  n_boot=0, progress=False)
    at8 = plan(tiny_llama_dir, average_windows=[8], **common).to_json()["budgets"][0]
    eps = at8["plan"]["predicted"]
    b = plan(tiny_llama_dir, eps=[eps], **common).to_json()["budgets"][0]
    per_token = at8["kv_bytes"] // ((8 + 2) * 2)  # 2 layers, window 8 plus 2 sinks
    assert b["plan"]["predicted"] <= eps and b["kv_bytes"] <= at8["kv_bytes"] + per_token  # within one token's bytes
    with pytest.raises(PlanError, match="ask for a larger --eps"):
        plan(tiny_llama_dir, eps=[1e-12], **common)


def test_input_errors_come_before_any_pass(tiny_llama_dir, corpus_dir):
    """--eps 0 is refused before the model is loaded (a bad path would fail later); a default budget
    that cannot fit says it was the default."""
    with pytest.raises(PlanError, match=r"eps \(--eps\) must be a positive distortion"):
        plan("/nonexistent/model", eps=[0.0], progress=False)
    with pytest.raises(PlanError, match="one of the default budgets 64,256"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=48, sweep=[2, 4], sinks=2, targets_per_doc=1,
             max_docs=6, n_boot=0, progress=False)


def test_plan_under_streaming(tiny_llama_dir, corpus_dir):
    report = plan(tiny_llama_dir, corpus=corpus_dir, reference_context=48, average_windows=[8], sweep=[2, 4, 8, 16],
                  sinks=2, targets_per_doc=1, max_docs=6, n_boot=0, semantics="streaming", progress=False)
    doc = report.to_json()
    assert doc["semantics"] == "streaming" and doc["budgets"][0]["plan"]["measured"]["value"] > 0


def test_plan_refuses_bad_budgets_and_sweeps(tiny_llama_dir, corpus_dir):
    with pytest.raises(PlanError, match=r"semantics \(--semantics\) must be one of prefill_evict, streaming"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, semantics="reencode")
    with pytest.raises(PlanError, match="one of the three"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, average_windows=[8], kv_bytes=[1000])
    with pytest.raises(PlanError, match=r"sweep windows \(sweep, --sweep\) must lie in \[1, N - sinks\)"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, average_windows=[8], sweep=[8, 62], sinks=4,
             progress=False)
    with pytest.raises(PlanError, match=r"average_windows \(--average-window\) must be at least 1 token, got 0"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, average_windows=[0])
    with pytest.raises(PlanError, match=r"average window 60 \(average_windows, --average-window\) leaves nothing to allocate.*N - sinks = 60"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, average_windows=[60], sinks=4, progress=False)
    with pytest.raises(PlanError, match="outside what a plan can allocate"):
        plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, kv_bytes=[10], progress=False)
    result = CliRunner().invoke(app, ["plan", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context",
                                      "64", "--average-window", "eight"])
    assert result.exit_code == 2 and "error: --average-window must be comma-separated numbers, got 'eight'" in result.output


def test_a_layer_at_the_noise_floor_is_kept_at_its_floor_window(tiny_llama_dir, corpus_dir, monkeypatch):
    """When one layer's fit fails for lack of windows above the noise floor (forced here: layer 0's law
    is replaced by a failed fit whose windows from 8 on lie at the floor), the plan keeps that layer at 8,
    gives layer 1 the rest of the bytes, predicts layer 1 alone, and says so; the uniform schedule, whose
    window lies above 8, is predicted the same way, and JSON carries ``at_floor_from``."""
    import truncsens.api.plan as plan_module

    real = plan_module.layer_power_laws

    def with_floor_layer(values, windows, doc, *args, **kwargs):
        laws = real(values, windows, doc, *args, **kwargs)
        laws[0].update(C=None, alpha=None, status="failed", reason="power needs at least 3 windows ..., got 2")
        laws[0]["excluded"] = {**laws[0]["excluded"], "noise_floor": [w for w in windows if w >= 8]}
        return laws

    monkeypatch.setattr(plan_module, "layer_power_laws", with_floor_layer)
    report = plan(tiny_llama_dir, corpus=corpus_dir, reference_context=64, average_windows=[16], sweep=[2, 4, 8, 16, 32],
                  sinks=2, targets_per_doc=1, max_docs=6, n_boot=0, progress=False)
    doc = report.to_json()
    assert [law["at_floor_from"] for law in doc["layers"]] == [8, None]
    b = doc["budgets"][0]
    per_token = doc["bytes_per_token_per_layer"]
    assert b["plan"]["windows"] == [8, b["kv_bytes"] // per_token - 2 * 2 - 8]  # layer 1 gets every byte left
    law1 = doc["layers"][1]
    assert b["plan"]["predicted"] == pytest.approx(law1["C"]["value"] * b["plan"]["windows"][1] ** -law1["alpha"]["value"])
    assert b["uniform"]["windows"] == [16, 16]
    assert b["uniform"]["predicted"] == pytest.approx(law1["C"]["value"] * 16 ** -law1["alpha"]["value"])
    assert "layer 0: too few windows above the noise floor" in report.table()


def _plan_cli(tiny_llama_dir, corpus_dir, *extra):
    return CliRunner().invoke(app, ["plan", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
                                    "--average-window", "8", "--sweep", "2,4,8,16", "--sinks", "2", "--targets-per-doc",
                                    "2", "--max-docs", "4", "--bootstrap", "0", *extra])


def test_plan_progress_on_stderr_and_none_with_no_progress(tiny_llama_dir, corpus_dir):
    """In a log (stderr not a terminal) ``plan`` says what it loads and one line per pass with the
    forward tokens done of the total: the fit set's sweep, 4 targets x (64 + 2 layers x 4 windows
    decodes) = 288, then the held-out set's 1 budget x (3 schedules + 2 layers alone), 4 x (64 + 5) =
    276. The table on stdout is the same with --no-progress, which prints nothing else."""
    loud = _plan_cli(tiny_llama_dir, corpus_dir)
    assert loud.exit_code == 0, loud.output
    lines = loud.stderr.splitlines()
    assert lines[0] == f"plan: loading model {tiny_llama_dir}" and lines[1].startswith("plan: tokenizing 6 documents"), lines
    assert [ln.split(", ")[:2] for ln in lines[2:]] == [["plan: pass 1/2 done", "288/564 tokens"],
                                                        ["plan: pass 2/2 done", "564/564 tokens"]]
    quiet = _plan_cli(tiny_llama_dir, corpus_dir, "--no-progress")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert quiet.stdout == loud.stdout
