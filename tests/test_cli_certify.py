"""``truncsens certify``: bad input gives one error line, exit 2 and no file; a small run on a tiny
Llama writes the results schema, the figures and a JSON summary whose numbers follow from the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from truncsens import results
from truncsens.certify.statistics import coverage
from truncsens.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("args,message", [
    (["--delta", "0"], "--delta must lie strictly between 0 and 1"),
    (["--delta", "1.5"], "--delta must lie strictly between 0 and 1"),
    (["--budgets", "120%"], "percentage of the reference context must lie in (0%, 100%]"),
    (["--budgets", "64", "--reference-context", "64"], "at or above the reference context of 64 tokens"),
    (["--budgets", "100%", "--reference-context", "64"], "at or above the reference context"),
    (["--model", "synthetic:1.0"], "does not use transformers' attention interface"),
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
    assert first["kl"]["poisson"]["mean"] == pytest.approx(float(sel["kl"].mean()), rel=1e-5)
    for path in summary["files"]:
        assert (tmp_path / path.split("/")[-1]).is_file()
    again = runner.invoke(app, ["certify", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output
