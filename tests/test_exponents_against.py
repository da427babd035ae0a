"""compare-policies --paired-against P: each other policy's power-law exponent in k minus P's, paired
on the same targets (both refitted on each document resample), with an interval and a verdict.
Synthetic runs with known curves (truncsens.results.constructed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from truncsens.cli.main import app
from truncsens.fits.paired import against_verdict
from truncsens.report.policy_comparison import CompareConfig, compare_policies
from truncsens.report.printed import format_comparison
from truncsens.results import save
from truncsens.results.constructed import curve_results
from truncsens.results.join import join_policy_runs

BUDGETS = [16, 32, 64, 128, 256, 512]


def run(name, scale, alpha, seed=5):
    """A budget sweep of ``name`` with mean KL scale · k^-alpha (the same seed: the same target and
    document multipliers in every run, so the runs' log-curves differ by a line on every resample)."""
    return curve_results({"kl": lambda k: scale * k**-alpha, "tv": lambda k: 0.5 * k ** -(alpha / 2)}, BUDGETS, 20, 4,
                         noise=0.2, seed=seed, doc_noise=0.3, sweep="budget",
                         attrs={"seed": 0, "policy": name, "semantics": "streaming", "n_sink": 4,
                                "policy_params": json.dumps({name: {}})})


def joined():
    return join_policy_runs([run("sink_recent", 2.0, 0.9), run("merge_mean", 3.0, 1.2), run("merge_nearest", 1.0, 0.9)],
                            ["a.nc", "b.nc", "c.nc"])


def test_the_paired_difference_is_the_difference_of_the_exponents():
    cmp = compare_policies(joined(), CompareConfig(n_boot=200, paired_against="sink_recent"))
    rows = {(r["policy"], r["metric"]): r for r in cmp.against}
    assert set(rows) == {(p, m) for p in ("merge_mean", "merge_nearest") for m in ("kl", "tv")}
    mean, nearest = rows["merge_mean", "kl"], rows["merge_nearest", "kl"]
    assert mean["status"] == "ok" and mean["against"] == "sink_recent"
    assert mean["against_alpha"] == pytest.approx(0.9, abs=0.05) and mean["alpha"] == pytest.approx(1.2, abs=0.05)
    # the shared document noise cancels: the paired interval has zero width
    assert mean["difference"] == pytest.approx(0.3, abs=1e-5)
    assert mean["difference_ci"] == pytest.approx([0.3, 0.3], abs=1e-5) and mean["verdict"] == "faster"
    assert nearest["difference"] == pytest.approx(0.0, abs=1e-5) and nearest["verdict"] == "same"
    assert rows["merge_mean", "tv"]["difference"] == pytest.approx(0.15, abs=1e-5)
    text = format_comparison(cmp)
    assert "power-law exponent in k against sink_recent (95% interval; paired" in text
    assert "faster decay (the interval lies above 0)" in text and "same decay (the interval contains 0)" in text
    assert cmp.to_json()["against"] == cmp.against


def test_without_the_option_nothing_changes():
    cmp = compare_policies(joined(), CompareConfig(n_boot=50))
    assert cmp.against == [] and "against" not in cmp.to_json()
    assert "against sink_recent" not in format_comparison(cmp)


def test_verdicts_read_the_interval():
    assert against_verdict([0.1, 0.3]) == "faster" and against_verdict([-0.3, -0.1]) == "slower"
    assert against_verdict([-0.1, 0.2]) == "same" and against_verdict(None) is None
    assert against_verdict([float("nan"), 0.1]) is None


def test_cli_option_and_an_unknown_policy(tmp_path):
    path = tmp_path / "runs.nc"
    save(joined(), path)
    out = CliRunner().invoke(app, ["compare-policies", str(path), "--paired-against", "sink_recent", "--bootstrap", "50",
                                   "--metrics", "kl"])
    assert out.exit_code == 0, out.output
    assert "alpha - alpha(sink_recent)" in out.output and "merge_mean" in out.output
    out = CliRunner().invoke(app, ["compare-policies", str(path), "--paired-against", "lru"])
    assert out.exit_code != 0
    assert "error: paired_against (--paired-against) 'lru' is not a policy of" in out.output
