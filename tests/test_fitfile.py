"""The fit file format (truncsens.fits.fit_file) and the fit / plot / recommend / show / compare steps
behind the CLI (truncsens.api, truncsens.budget.recommend, truncsens.report.summary, truncsens.report.policy_comparison)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from truncsens import results
from truncsens.divergences import METRICS
from truncsens.fits.fit_file import (SCHEMA, is_fit_file, plot_prefix, read_fit_file, same_curve, upgrade_fit_doc, use_fits_from,
                               write_json)
from truncsens.fits.fitting import FitConfig, curve_labels, fit_datasets
from truncsens.fits.laws import FitError
from truncsens.api.fit import fit
from truncsens.api.plot import plot
from truncsens.report.policy_comparison import CompareConfig, compare_policies_file, default_plot_stem
from truncsens.budget.recommend import recommend_windows
from truncsens.report.printed import format_results_summary
from truncsens.report.summary import summarize_file
from truncsens.results.constructed import curve_results

POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
V1 = {"kind": "truncsens-fit", "schema": 1,
      "curves": [{"index": 0, "provenance": {"window": "kept", "ci95": 1},
                  "metrics": {"tv": {"window": [4, 8], "mean": [0.2, 0.1], "se": [0.01, 0.01], "excluded_windows": []}}}],
      "fits": [{"curve": 0, "metric": "tv", "family": "power", "status": "ok", "fit_windows": [4, 8], "holdout_windows": [], "excluded_windows": [16],
                "params": {"C": {"value": 0.4, "ci95": [0.3, 0.5]}}, "extrapolation_mae": {"value": 0.1, "ci95": None}}],
      "comparisons": [{"factor": {"value": 2.0, "ci95": [1.5, 3.0]}}], "alpha_ratio_kl_tv": [{"value": 2.0, "ci95": [1.9, 2.1]}]}


def _save(path, C=0.5, alpha=0.5, seed=0):
    ds = curve_results({"tv": lambda w: C * w**-alpha, "kl": lambda w: 2 * C * w ** (-2 * alpha)}, POW2, n_docs=6,
                       doc_noise=0.1, seed=seed)
    return results.save(ds, path)


def test_upgrade_schema_1_renames_keys_but_not_provenance(tmp_path):
    doc = upgrade_fit_doc(V1)
    assert doc["schema"] == SCHEMA == 2
    assert doc["curves"][0]["metrics"]["tv"] == {"points": [4, 8], "mean": [0.2, 0.1], "se": [0.01, 0.01], "excluded_points": []}
    assert doc["curves"][0]["provenance"] == {"window": "kept", "ci95": 1}
    f = doc["fits"][0]
    assert (f["fit_points"], f["holdout_points"], f["excluded_points"]) == ([4, 8], [], [16])
    assert f["params"]["C"] == {"value": 0.4, "ci": [0.3, 0.5]} and f["extrapolation_mae"] == {"value": 0.1, "ci": None}
    assert doc["comparisons"][0]["factor"]["ci"] == [1.5, 3.0] and doc["alpha_ratio_kl_tv"][0]["ci"] == [1.9, 2.1]
    assert upgrade_fit_doc(doc) is doc
    path = write_json(V1, tmp_path / "sub" / "old.fit.json")
    assert read_fit_file(path) == doc and json.loads(path.read_text()) == V1


def test_is_fit_file_and_paths(tmp_path):
    fit = write_json({"kind": "x"}, tmp_path / "f.json")
    nc = _save(tmp_path / "r.nc")
    assert is_fit_file(fit) and not is_fit_file(nc)
    with pytest.raises(FileNotFoundError):
        is_fit_file(tmp_path / "none.json")
    assert plot_prefix("a/b.fit.json").as_posix() == "a/b.fit" and plot_prefix("a/b.txt").as_posix() == "a/b.txt"
    assert default_plot_stem("r/x.nc").as_posix() == "r/x-policies"
    assert curve_labels(["a/r.nc", "b/r.nc", "c/s.nc"]) == ["a/r", "b/r", "s"]


def test_fit_writes_the_doc_and_figures(tmp_path):
    nc = _save(tmp_path / "r.nc")
    path, figs = tmp_path / "r.fit.json", [tmp_path / "r.fit.png", tmp_path / "r.fit.pdf"]
    doc = fit(nc, metrics="tv", families="power", bootstrap=20, out=path, plot_out=tmp_path / "r.fit").to_json()
    assert json.loads(path.read_text()) == doc
    assert all(p.stat().st_size > 1000 for p in figs)
    alpha = doc["fits"][0]["params"]["alpha"]
    assert alpha["value"] == pytest.approx(0.5, abs=0.02) and alpha["ci"][0] <= alpha["value"] <= alpha["ci"][1]


def test_same_curve_and_use_fits_from(tmp_path):
    a, b = _save(tmp_path / "a.nc"), _save(tmp_path / "b.nc", seed=1)
    fa = fit_datasets([results.load(a)], FitConfig(metrics=("tv",), n_boot=0, fit_range=(2, 64)), [a]).to_json()
    now = fit_datasets([results.load(a)], FitConfig(metrics=("tv",), n_boot=0), [a]).to_json()
    fb = fit_datasets([results.load(b)], FitConfig(metrics=("tv",), n_boot=0), [b]).to_json()
    assert same_curve(now["curves"][0], fa["curves"][0]) and not same_curve(now["curves"][0], fb["curves"][0])
    merged = use_fits_from(now, fa, "fa.json")
    assert merged["curves"][0]["fit_range"] == [2, 64] and merged["fits"] == fa["fits"]
    assert now["curves"][0]["fit_range"] == [4, 128]  # the input is not changed
    with pytest.raises(ValueError, match="fb.json was not made from"):
        use_fits_from(now, fb, "fb.json")
    paths = plot(a, tmp_path / "fig", fit=write_json(fa, tmp_path / "fa.json"))
    assert [p.name for p in paths] == ["fig.png", "fig.pdf"]


def test_recommend_windows_checks_eps_before_fitting(tmp_path):
    nc = _save(tmp_path / "r.nc", C=0.5, alpha=0.5)
    with pytest.raises(ValueError, match=r"eps \(--eps\) for tv"):
        recommend_windows(tmp_path / "missing.nc", [2.0], ["tv"])  # eps checked first, the file never read
    [rec] = recommend_windows(nc, [0.05], ["tv"], FitConfig(n_boot=30))
    # w(eps) = (C/eps)^(1/alpha) = (0.5/0.05)^2 = 100 for the exact law; the noisy fit lies close
    assert rec.w_law == pytest.approx(100, rel=0.1) and rec.level == 0.95
    assert rec.w_law_ci[0] <= rec.w_law <= rec.w_law_ci[1]


def test_summarize_file_and_its_report(tmp_path):
    m = {name: np.zeros((4, 2)) for name in METRICS}
    m["tv"] = np.array([[0.2, 0.1], [0.4, 0.1], [0.6, 0.3], [0.8, 0.3]])
    attrs = {**{k: "" for k in results.REQUIRED_ATTRS}, "model": "m", "corpus": "c", "domain": "code",
             "semantics": "reencode", "positions": "original", "n_sink": 0, "reference_context": 64, "seed": 0}
    path = results.save(results.make_results(m, "window", [1, 2], ["a", "a", "b", "b"], [64, 65, 64, 65], [0, 1, 2, 3], attrs),
                        tmp_path / "r.nc")
    s = summarize_file(path, ["tv"])
    assert (s.sweep, s.n_targets) == ("window", 4)
    row = s.rows[0]
    # docs a (0.2, 0.4: sum 0.6), b (0.6, 0.8: sum 1.4); mean 0.5; CR1 se = sqrt(2 * (0.2^2 + 0.2^2)) / 4 = 0.2
    assert row["mean"] == pytest.approx(0.5) and row["se"] == pytest.approx(0.2)
    lines = format_results_summary(s).splitlines()
    assert lines[0] == f"{path}: model m, corpus c (code), semantics reencode, positions original, sinks 0, reference context 64, 4 targets"
    assert lines[1] == "tv" and lines[3].split() == ["1", "4", "0.5", "0.2", "0.5", "0.74", "0.794"]
    assert s.to_json()["rows"][0]["se"] == pytest.approx(0.2)


def test_configs_validate_themselves():
    for bad, message in ((dict(n_boot=-1), "--bootstrap"), (dict(level=1.0), "--level"), (dict(metrics=()), "no metric"),
                         (dict(families=("cubic",)), "unknown law family"), (dict(fit_range=(8, 4)), r"fit_range \(--fit-range\)")):
        with pytest.raises(ValueError, match=message):
            FitConfig(**bad)
    assert issubclass(FitError, ValueError)
    for bad, message in ((dict(metrics=()), r"metrics \(--metrics\) is empty"), (dict(n_boot=-2), r"bootstrap \(--bootstrap\)"), (dict(level=0.0), r"level \(--level\)")):
        with pytest.raises(ValueError, match=message):
            CompareConfig(**bad)
    assert CompareConfig().ratio == ("random", "sink_recent") and CompareConfig(numerator="a").ratio == ("a", "sink_recent")


def test_compare_policies_file(tmp_path):
    n, K = 8, [8, 16, 32]
    base = np.asarray(K, float) ** -0.5
    m = {name: np.zeros((2, n, 3)) for name in METRICS}
    m["tv"] = np.stack([np.tile(base / 10, (n, 1)), np.tile(base, (n, 1))])  # random = 10 x sink_recent, TV <= 1
    attrs = {**{k: "" for k in results.REQUIRED_ATTRS}, "semantics": "streaming", "positions": "original", "n_sink": 0,
             "reference_context": 64,
             "seed": 0, "policy": "sink_recent,random"}
    path = results.save(results.make_results(m, "budget", K, [f"d{i // 2}" for i in range(n)], 64 + np.arange(n), np.zeros(n),
                                             attrs, policies=["sink_recent", "random"]), tmp_path / "p.nc")
    cmp = compare_policies_file(path, CompareConfig(metrics=("tv",), n_boot=10, fit_range=(8, 32)))
    assert [r["value"] for r in cmp.ratios] == pytest.approx([10, 10, 10])
    fit = next(f for f in cmp.fits if f["policy"] == "sink_recent")
    assert fit["alpha"] == pytest.approx(0.5) and fit["sweep"] == "budget" and fit["fit_points"] == K
    with pytest.raises(ValueError, match=rf"denominator \(--denominator\) 'lru' is not a policy of {path}"):
        compare_policies_file(path, CompareConfig(metrics=("tv",), denominator="lru"))
    assert math.isclose(cmp.to_json()["level"], 0.95)
