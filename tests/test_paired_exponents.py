"""compare-policies --truncation: each recency policy's exponent against the recent span it keeps (k - S for
sink_recent with S sinks, k for suffix), beside the truncation exponent, and their paired difference with a
document-bootstrap interval and a verdict. Synthetic runs with known curves (truncsens.results.constructed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from truncsens.cli.main import app
from truncsens.fits.paired import verdict
from truncsens.policies import make_policy
from truncsens.report.policy_comparison import CompareConfig, compare_policies, recency_policy
from truncsens.report.printed import format_comparison, span_verdict
from truncsens.results import save
from truncsens.results.constructed import curve_results
from truncsens.stats import percentile_interval, resample_weights

S = 4
WINDOWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
BUDGETS = [8, 16, 32, 64, 128, 256, 512]


def truncation_run(alpha, seed=1, sinks=S, n_docs=30, targets_per_doc=4, windows=WINDOWS, doc_noise=0.3):
    """A window sweep with mean KL 2 w^-alpha and TV 0.5 w^-(alpha/2), keeping ``sinks`` sinks before its windows."""
    return curve_results({"kl": lambda w: 2.0 * w**-alpha, "tv": lambda w: 0.5 * w ** -(alpha / 2)}, windows, n_docs,
                         targets_per_doc, noise=0.2, seed=seed, doc_noise=doc_noise, attrs={"seed": 0, "n_sink": sinks})


def policy_run(alpha, seed=2, n_docs=30, budgets=BUDGETS, doc_noise=0.3, name="sink_recent", sinks=S):
    """A budget sweep of ``name`` whose mean KL is 2 (k - sinks)^-alpha: the truncation curve of its recent span."""
    first = sinks if name == "sink_recent" else 0  # the test's own construction, not the code under test
    return curve_results({"kl": lambda k: 2.0 * (k - first) ** -alpha, "tv": lambda k: 0.5 * (k - first) ** -(alpha / 2)},
                         budgets, n_docs, 4, noise=0.2, seed=seed, doc_noise=doc_noise, sweep="budget",
                         attrs={"seed": 0, "policy": name, "semantics": "streaming", "n_sink": sinks,
                                "policy_params": json.dumps({name: {"n_sink": sinks} if name == "sink_recent" else {}})})


def paired_rows(cmp, metric=None):
    return [r for r in cmp.paired if metric is None or r["metric"] == metric]


def test_the_recent_span_is_a_property_of_the_policy():
    assert make_policy("sink_recent", n_sink=3).recent_span(16) == 13
    assert make_policy("sink_recent", n_sink=0).recent_span(16) == 16
    assert make_policy("suffix").recent_span(16) == 16
    assert make_policy("h2o").recent_span(16) is None and make_policy("random").recent_span(16) is None
    assert make_policy("sink_recent", n_sink=4).recent_span_rule() == "span = k - 4 (the 4 first tokens kept are not recent past)"
    assert make_policy("suffix").recent_span_rule() == "span = k"
    ds = policy_run(0.6, sinks=2)
    assert recency_policy(ds, "sink_recent").n_sink == 2  # rebuilt from the file's policy_params
    assert recency_policy(ds, "h2o") is None


def test_verdict_reads_the_interval():
    assert verdict(0.01, [-0.02, 0.05]) == "recovered"
    assert verdict(0.2, [0.1, 0.3]) == "differs"
    assert verdict(-0.2, [-0.3, -0.1]) == "differs"
    assert verdict(0.2, None) is None and verdict(0.2, [float("nan"), 0.3]) is None
    assert span_verdict({"verdict": "differs", "difference": -0.1, "relative": -0.2}) == "differs: shallower by 0.1 (-20%)"
    assert span_verdict({"verdict": "differs", "difference": 0.29, "relative": 0.317}) == "differs: steeper by 0.29 (+32%)"
    assert span_verdict({"verdict": None}) == "-"


@pytest.mark.parametrize("a_trunc,a_policy", [(0.6, 0.6), (0.5, 0.7)])
def test_noise_shared_by_the_two_runs_cancels_in_the_paired_difference(a_trunc, a_policy):
    # budgets k = w + S: the policy's spans are the truncation's windows, and with one seed and as many points
    # both runs draw the same target and document multipliers, so on every resample the two log-curves differ
    # by exactly (a_trunc - a_policy) log s: the paired difference is a_policy - a_trunc with a zero-width interval
    trunc = truncation_run(a_trunc, seed=7)
    policy = policy_run(a_policy, seed=7, budgets=[w + S for w in WINDOWS])
    cmp = compare_policies(policy, CompareConfig(n_boot=200), trunc)
    for r in paired_rows(cmp):
        assert r["paired"] and r["status"] == "ok" and r["fit_points"] == r["truncation_fit_points"] == [4, 8, 16, 32, 64, 128]
        scale = 1.0 if r["metric"] == "kl" else 0.5
        assert r["difference"] == pytest.approx(scale * (a_policy - a_trunc), abs=1e-6)
        assert r["difference_ci"] == pytest.approx([scale * (a_policy - a_trunc)] * 2, abs=1e-6)  # float32 values
        assert r["alpha_ci"][1] - r["alpha_ci"][0] > 0.02  # each exponent alone is uncertain: the documents disagree
        assert r["verdict"] == ("recovered" if a_policy == a_trunc else "differs")


def naive_paired_interval(policy_ds, trunc_ds, metric, n_boot, seed, lo=4, hi=128, first=S, level=0.95):
    """The paired bootstrap by hand: per resample, each document's targets repeated as often as it is drawn,
    the mean and CR1 se of every point, the WLS line of log mean on log span (weight (mean/se)^2) of both runs."""
    docs = list(dict.fromkeys(trunc_ds["doc"].values.tolist()))
    mult = resample_weights(len(docs), n_boot, seed)[1:]

    def slope(ds, sweep, shift, m):
        pts = ds[sweep].values - shift
        keep = (pts >= lo) & (pts <= hi)
        vals = ds[metric].transpose("target", sweep).values[:, keep].astype(np.float64)
        doc = ds["doc"].values
        groups = [vals[doc == d] for d, times in zip(docs, m) for _ in range(int(times))]
        n = sum(len(g) for g in groups)
        mean = sum(g.sum(0) for g in groups) / n
        G = len(groups)
        se = np.sqrt(G / (G - 1) * sum((g.sum(0) - len(g) * mean) ** 2 for g in groups)) / n
        b1 = np.polyfit(np.log(pts[keep]), np.log(mean), 1, w=mean / se)[0]
        return -b1

    diffs = [slope(policy_ds, "budget", first, m) - slope(trunc_ds, "window", 0, m) for m in mult]
    return percentile_interval(np.array(diffs), level)


@pytest.mark.parametrize("a_trunc,a_policy", [(0.6, 0.6), (0.5, 0.7)])
def test_paired_difference_of_independent_runs_with_s_sinks(a_trunc, a_policy):
    trunc, policy = truncation_run(a_trunc), policy_run(a_policy)
    cmp = compare_policies(policy, CompareConfig(n_boot=100, seed=3), trunc)
    for metric, scale in (("kl", 1.0), ("tv", 0.5)):
        (r,) = paired_rows(cmp, metric)
        assert r["policy"] == "sink_recent" and r["sinks"] == S and r["truncation_sinks"] == S
        assert r["fit_range"] == [4, 128] and r["fit_points"] == [4, 12, 28, 60, 124]  # spans k - 4 of budgets 8..128
        assert r["difference"] == pytest.approx(r["alpha"] - r["truncation_alpha"], abs=1e-12)
        assert r["difference_ci"] == pytest.approx(naive_paired_interval(policy, trunc, metric, 100, 3), abs=1e-9)
        lo, hi = r["difference_ci"]
        if a_policy == a_trunc:
            assert lo < 0 < hi and abs(r["difference"]) < 0.02 and r["verdict"] == "recovered"
        else:
            assert lo > 0.5 * scale * 0.2 and r["difference"] == pytest.approx(scale * 0.2, abs=0.02)
            assert r["verdict"] == "differs" and r["relative"] == pytest.approx(0.4, abs=0.05)
    # fitted against the budget k, the same policy curve is steeper than its law: the bend at small k
    (kfit,) = [f for f in cmp.fits if f["policy"] == "sink_recent" and f["metric"] == "kl"]
    assert kfit["alpha"] > a_policy + 0.1
    text = format_comparison(cmp)
    assert "sink_recent: span = k - 4 (the 4 first tokens kept are not recent past); the truncation run keeps 4 sinks" in text
    assert ("recovered (the interval contains 0)" if a_policy == a_trunc else "differs: steeper by 0.2") in text
    assert not any("matched comparison" in n or "not paired" in n for n in cmp.notes)


def test_other_targets_still_compare_without_an_interval_or_verdict():
    trunc, policy = truncation_run(0.5, targets_per_doc=2), policy_run(0.7)
    cmp = compare_policies(policy, CompareConfig(n_boot=50), trunc)
    (r,) = paired_rows(cmp, "kl")
    assert r["paired"] is False and r["difference_ci"] is None and r["verdict"] is None
    assert r["difference"] == pytest.approx(r["alpha"] - r["truncation_alpha"], abs=1e-12)
    assert r["difference"] == pytest.approx(0.2, abs=0.03)
    assert any(n.startswith("the exponent differences are not paired (other targets: doc differs, 60 against 120)")
               for n in cmp.notes)
    text = format_comparison(cmp)
    assert "not paired)" in text and "(not paired)" in text and "recovered" not in text


def test_a_truncation_run_without_the_policys_sinks_is_named_unmatched():
    cmp = compare_policies(policy_run(0.6), CompareConfig(n_boot=50), truncation_run(0.6, sinks=0))
    assert ("sink_recent keeps 4 first tokens, the truncation run 0 in front of its windows: the matched comparison is a "
            "truncation run with measure --sinks 4") in cmp.notes
    assert all(r["paired"] and r["truncation_sinks"] == 0 for r in cmp.paired)


def test_suffix_is_fitted_against_k():
    cmp = compare_policies(policy_run(0.6, name="suffix", sinks=0), CompareConfig(n_boot=50), truncation_run(0.6, sinks=0))
    (r,) = paired_rows(cmp, "kl")
    assert r["span_rule"] == "span = k" and r["fit_points"] == [8, 16, 32, 64, 128] and r["verdict"] == "recovered"


def test_cli_prints_and_writes_the_paired_difference(tmp_path):
    save(truncation_run(0.5), tmp_path / "t.nc")
    save(policy_run(0.7), tmp_path / "p.nc")
    runner = CliRunner()
    args = ["compare-policies", str(tmp_path / "p.nc"), "--truncation", str(tmp_path / "t.nc"), "--bootstrap", "100"]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    assert "alpha - alpha(truncation)" in out.stdout and "differs: steeper by" in out.stdout
    doc = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    rows = {r["metric"]: r for r in doc["paired"]}
    assert set(rows) == {"kl", "tv"} and rows["kl"]["verdict"] == "differs" and rows["kl"]["paired"] is True
    assert rows["kl"]["difference_ci"][0] > 0.1
