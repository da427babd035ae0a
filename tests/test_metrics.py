"""The metric records (truncsens.metrics): their values are those the docs state, every module reads
them, and a results file written before a metric existed (here: without kl_reverse and js) still
loads, shows, fits and compares on the metrics it holds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from truncsens import divergences as dv
from truncsens import metrics as M
from truncsens import results
from truncsens.cli.main import app
from truncsens.engine.kernel import metric_arrays
from truncsens.fits import points
from truncsens.fits.curves import curves_of, default_metrics
from truncsens.fits.fitting import DEFAULT_METRICS, FitConfig, fit_curve
from truncsens.results.constructed import curve_results
from truncsens.report.plots import axis_label
from truncsens.report.policy_comparison import CompareConfig, compare_policies
from truncsens.report.summary import summarize

OLD = ("kl_reverse", "js")  # the metrics a file from before they existed lacks
runner = CliRunner()


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


# ----------------------------------------------------------------------------- the records


def test_names_and_order_are_those_of_a_results_file():
    assert M.NAMES == ("tv", "kl", "kl_reverse", "js", "top1_agree", "nll_ref", "nll_kept")
    assert dv.METRICS == M.NAMES
    assert M.DIVERGENCES == DEFAULT_METRICS == ("tv", "kl", "kl_reverse", "js")
    assert [m.name for m in M.METRICS if m.divergence] == list(M.DIVERGENCES)


@pytest.mark.parametrize("name, lower, upper, unit, dtype, direction", [
    # README / docs/measuring.md "Metrics": tv in [0, 1]; divergences.py: KL >= 0 (+inf where q = 0 < p),
    # JS in [0, log 2], top1_agree int8 in {0, 1}, NLL = -log p(y) >= 0, natural log (nats)
    ("tv", 0.0, 1.0, "probability", np.float32, M.LOWER_IS_BETTER),
    ("kl", 0.0, math.inf, "nats", np.float32, M.LOWER_IS_BETTER),
    ("kl_reverse", 0.0, math.inf, "nats", np.float32, M.LOWER_IS_BETTER),
    ("js", 0.0, math.log(2.0), "nats", np.float32, M.LOWER_IS_BETTER),
    ("top1_agree", 0.0, 1.0, "", np.int8, M.HIGHER_IS_BETTER),
    ("nll_ref", 0.0, math.inf, "nats", np.float32, M.LOWER_IS_BETTER),
    ("nll_kept", 0.0, math.inf, "nats", np.float32, M.LOWER_IS_BETTER),
])
def test_record_values_are_what_the_docs_say(name, lower, upper, unit, dtype, direction):
    m = M.metric(name)
    assert (m.lower, m.upper, m.unit, m.dtype, m.direction) == (lower, upper, unit, np.dtype(dtype), direction)
    assert m.bounded_above == math.isfinite(upper)
    assert m.best == (1.0 if name == "top1_agree" else 0.0)
    assert m.description and m.function is getattr(dv, m.computed_by.split("(")[0])
    assert (m.lower, m.upper) == dv.RANGES[name]  # the range all_metrics clamps into


def test_noise_floors_are_those_of_docs_precision():
    # docs/precision.md "How the fits use this floor": TV 1.5e-7, KL 1e-13, JS 2e-14; none for NLL and top-1
    floors = {m.name: m.noise_floor for m in M.METRICS}
    assert floors == {"tv": 1.5e-7, "kl": 1e-13, "kl_reverse": 1e-13, "js": 2e-14,
                      "top1_agree": None, "nll_ref": None, "nll_kept": None}
    assert (points.TV_NOISE_FLOOR, points.KL_NOISE_FLOOR, points.JS_NOISE_FLOOR) == (1.5e-7, 1e-13, 2e-14)
    assert [points.noise_floor(n) for n in M.NAMES] == [1.5e-7, 1e-13, 1e-13, 2e-14, 0.0, 0.0, 0.0]
    assert points.noise_floor("kept_tokens") == 0.0  # a data var that is no metric
    assert points.NOISE_FLOOR == {"tv": 1.5e-7, "kl": 1e-13, "kl_reverse": 1e-13, "js": 2e-14}


def test_lookups():
    assert M.find("kl").name == "kl" and M.find("entropy") is None
    with pytest.raises(KeyError, match="unknown metric 'entropy'; the metrics are tv, kl, kl_reverse"):
        M.metric("entropy")
    assert M.present(["nll_kept", "kept_tokens", "js", "tv"]) == ("tv", "js", "nll_kept")
    assert M.divergences_in(["nll_kept", "js", "tv", "top1_agree"]) == ("tv", "js")


def test_check_eps_reads_the_bounds_of_the_records(monkeypatch):
    from truncsens.budget.windows import check_eps

    assert M.bounded_divergences() == {"tv": 1.0, "js": math.log(2.0)}
    # a bounded divergence added to the records alone (no second list): Hellinger distance in [0, 1]
    hellinger = M.Metric("hellinger", "Hellinger distance", "probability", np.dtype(np.float32), 0.0, 1.0,
                         M.LOWER_IS_BETTER, True, None, dv.tv, "hellinger(p_ref, p_kept)")
    monkeypatch.setattr(M, "METRICS", M.METRICS + (hellinger,))
    with pytest.raises(ValueError, match=r"eps \(--eps\) for hellinger must lie in \(0, 1\] since hellinger never exceeds 1; got 5"):
        check_eps(5, "hellinger")
    assert check_eps(1.0, "hellinger") == 1.0
    assert check_eps(5, "kl") == 5.0  # unbounded above
    with pytest.raises(ValueError, match=r"^metric top1_agree \(--metric\) is not a divergence"):
        check_eps(0.5, "top1_agree")  # bounded, but no divergence: no window makes it fall to eps


def test_default_metrics_are_one_constant():
    from truncsens.api import compare
    from truncsens.cli.compare_policies import compare_policies as cli_compare

    assert M.DEFAULT_METRICS == ("kl", "tv") and set(M.DEFAULT_METRICS) <= set(M.DIVERGENCES)
    assert CompareConfig().metrics == compare.DEFAULT_METRICS == M.DEFAULT_METRICS
    out = " ".join(runner.invoke(app, ["compare-policies", "--help"], env={"COLUMNS": "300"}).output.split())
    assert f"(default: {', '.join(M.DEFAULT_METRICS)})" in out


def test_record_checks_itself():
    with pytest.raises(ValueError, match="direction must be one of"):
        M.Metric("x", "", "", np.dtype(np.float32), 0.0, 1.0, "up", False, None, dv.tv, "")
    with pytest.raises(ValueError, match="lower bound 2.0 above upper bound 1.0"):
        M.Metric("x", "", "", np.dtype(np.float32), 2.0, 1.0, M.LOWER_IS_BETTER, False, None, dv.tv, "")


def test_computed_values_lie_in_their_records_range_with_its_dtype():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 50, generator=g, dtype=torch.float64) * 3
    kept = ref + torch.randn(64, 50, generator=g, dtype=torch.float64)
    kept[:8] = ref[:8]  # p = q: every divergence exactly 0, top-1 agrees
    token = torch.randint(0, 50, (64,), generator=g)
    values, n_clamped = dv.all_metrics(ref.float(), kept.float(), token)
    assert tuple(values) == M.NAMES and n_clamped == 0
    args = {"p_ref": torch.log_softmax(ref.float().double(), -1), "p_kept": torch.log_softmax(kept.float().double(), -1), "y": token}
    for m in M.METRICS:  # the record's function, called as computed_by says, gives all_metrics' values
        call = [args[a.strip()] for a in m.computed_by.split("(")[1].rstrip(")").split(",")]
        assert torch.equal(m.function(*call), values[m.name]), m.name
    for m in M.METRICS:
        v = values[m.name]
        assert v.dtype == (torch.int8 if m.dtype == np.int8 else torch.float64), m.name
        assert float(v.min()) >= m.lower and float(v.max()) <= m.upper, m.name
        if m.divergence:
            assert v[:8].abs().max().item() == 0.0 and v[8:].min().item() > 0, m.name
    assert values["top1_agree"][:8].tolist() == [1] * 8


def test_storage_and_results_use_the_record_dtypes():
    arrays = metric_arrays((2, 3))
    assert {k: v.dtype for k, v in arrays.items()} == {m.name: m.dtype for m in M.METRICS}
    ds = curve_results({"tv": lambda w: 0.1 / w}, [1, 2, 4], n_docs=2)
    assert {n: ds[n].dtype for n in results.metrics_of(ds)} == {m.name: m.dtype for m in M.METRICS}
    # metrics not given hold their best value: 0 for the divergences and NLLs, 1 for top-1 agreement
    assert ds["top1_agree"].values.min() == 1 and float(abs(ds["kl"]).max()) == 0.0 and float(ds["nll_kept"].max()) == 0.0


def test_axis_labels_follow_the_unit():
    assert [axis_label(n) for n in M.NAMES] == [
        "mean tv", "mean kl (nats)", "mean kl_reverse (nats)", "mean js (nats)", "mean top1_agree",
        "mean nll_ref (nats)", "mean nll_kept (nats)"]
    assert axis_label("kept_tokens") == "mean kept_tokens"


# ----------------------------------------------------------------------------- files without kl_reverse and js


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real small results (synthetic model): a window sweep and a policy sweep, each also saved without kl_reverse and js."""
    root = tmp_path_factory.mktemp("old_files")
    common = ["--model", "synthetic:0.5", "--max-docs", "4", "--no-progress"]
    invoke("measure", *common, "--out", root / "w.nc")
    invoke("measure", *common, "--policy", "sink_recent,random", "--semantics", "reencode", "--budgets", "8,32,128",
           "--out", root / "b.nc")
    for name in ("w", "b"):
        full = results.load(root / f"{name}.nc")
        results.save(full.drop_vars(list(OLD)), root / f"{name}_old.nc")
    return root


def test_old_file_loads_with_the_metrics_it_holds(runs):
    full, old = results.load(runs / "w.nc"), results.load(runs / "w_old.nc")
    assert results.metrics_of(full) == M.NAMES
    assert results.metrics_of(old) == ("tv", "kl", "top1_agree", "nll_ref", "nll_kept")
    for n in results.metrics_of(old):
        assert old[n].dtype == M.metric(n).dtype
        np.testing.assert_array_equal(old[n].values, full[n].values)
    bad = old.copy()
    bad["tv"] = bad["tv"].astype(str)
    with pytest.raises(results.ResultsError, match="metric 'tv' must hold numbers"):
        results.validate(bad)


def test_old_file_shows_its_metrics(runs):
    full = invoke("show", runs / "w.nc").replace(str(runs / "w.nc"), "FILE")
    old = invoke("show", runs / "w_old.nc").replace(str(runs / "w_old.nc"), "FILE")
    blocks = full.split("\n\n")
    kept = [b for b in blocks if b.split("\n")[0] not in OLD]
    assert len(blocks) == 7 and len(kept) == 5
    assert old == "\n\n".join(kept)  # the same table, without the two blocks the file lacks
    rows = json.loads(invoke("show", runs / "w_old.nc", "--json"))["rows"]
    assert list(dict.fromkeys(r["metric"] for r in rows)) == ["tv", "kl", "top1_agree", "nll_ref", "nll_kept"]
    with pytest.raises(ValueError, match="unknown metric.s. js; the file has tv, kl, top1_agree, nll_ref, nll_kept"):
        summarize(results.load(runs / "w_old.nc"), ["js"])
    with pytest.raises(results.ResultsError, match="unknown metric.s. js; the file has tv, kl, top1_agree, nll_ref, nll_kept"):
        curves_of(results.load(runs / "w_old.nc"), ["js"])


def test_old_file_fits_like_the_full_one(runs):
    def fitted(name, metrics):
        curve, = curves_of(results.load(runs / f"{name}.nc"), metrics, f"{name}.nc")
        cf = fit_curve(curve, FitConfig(metrics=metrics, n_boot=30))
        return [(f["metric"], f["family"], f["status"], {k: v["value"] for k, v in f["params"].items()}) for f in cf.fits]

    old_ds, full_ds = results.load(runs / "w_old.nc"), results.load(runs / "w.nc")
    held = default_metrics([old_ds])  # the divergences the file holds: what a fit without --metric fits
    assert held == ("tv", "kl") and default_metrics([full_ds]) == DEFAULT_METRICS
    assert default_metrics([full_ds, old_ds]) == ("tv", "kl") and default_metrics([]) == ()
    old = fitted("w_old", held)
    assert old == fitted("w", held)
    assert {m for m, _, status, _ in old if status == "ok"} == {"tv", "kl"}
    assert {m for m, _, _, _ in fitted("w", DEFAULT_METRICS)} == set(DEFAULT_METRICS)


def test_old_policy_file_compares_like_the_full_one(runs):
    cfg = CompareConfig(metrics=("kl", "tv"), n_boot=50)
    full = compare_policies(results.load(runs / "b.nc"), cfg)
    old = compare_policies(results.load(runs / "b_old.nc"), cfg)
    assert old.table == full.table and old.ratios == full.ratios
    assert [f["alpha"] for f in old.fits] == [f["alpha"] for f in full.fits]
    assert {r["metric"] for r in old.table} == {"kl", "tv"} and len(old.table) == 2 * 2 * 3
