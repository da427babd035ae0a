"""Results files are validated on load from the metric records (an impossible file must not be fitted silently): an impossible
value, a missing dim, a window or budget of 0, an attr of the wrong type are refused by every command
that reads a results file, with one error line naming the file, the variable, the rule and the
first offending value; nothing is echoed or fitted."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.results import ResultsError
from truncsens.results.constructed import curve_results

WINDOWS = [1, 4, 16, 64]


def window_file(tmp_path) -> str:
    ds = curve_results({"tv": lambda w: 0.5 * w ** -0.6, "kl": lambda w: 0.3 * w ** -1.2}, WINDOWS, n_docs=4,
                       noise=0.2, reference_context=64)
    return str(results.save(ds, tmp_path / "ok.nc"))


def budget_file(tmp_path) -> str:
    ds = xr.load_dataset(window_file(tmp_path), engine="h5netcdf").rename({"window": "budget"})
    ds = ds.expand_dims(policy=["sink_recent"]).transpose("policy", ...)
    ds.attrs.update(semantics="streaming", policy="sink_recent")
    del ds.attrs["attrs_fingerprint"]  # relabelled by an older truncsens, which wrote no fingerprint
    path = tmp_path / "budgets.nc"
    ds.to_netcdf(path, engine="h5netcdf")
    return str(path)


def edited(path: str, name: str, edit, fingerprint: bool = False) -> str:
    """A copy of the file at ``path`` with ``edit`` applied to its stored form (no truncsens check in between);
    without ``fingerprint``, as a file an older truncsens wrote (no attrs fingerprint: the value rules alone)."""
    ds = xr.load_dataset(path, engine="h5netcdf")
    if not fingerprint:
        ds.attrs.pop("attrs_fingerprint", None)
    ds = edit(ds)
    out = path.replace(".nc", f"-{name}.nc")
    ds.to_netcdf(out, engine="h5netcdf")
    return out


def set_var(name, fn):
    def edit(ds):
        ds[name] = ds[name].copy(data=fn(ds[name].values))
        return ds
    return edit


def refused(args: list[str], *fragments: str) -> str:
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    lines = [line for line in out.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_a_valid_file_loads(tmp_path):
    assert results.load(window_file(tmp_path))["tv"].shape == (8, 4)


@pytest.mark.parametrize("value", [5.0, -0.5])
def test_tv_outside_0_1_is_refused_by_show_and_fit(tmp_path, value):
    """The issue's instance: tv = 5.0 (or -0.5) everywhere; show printed a mean of 5, fit fitted C = 5."""
    bad = edited(window_file(tmp_path), "tv", set_var("tv", lambda v: np.full_like(v, value)))
    for command in (["show", bad], ["fit", bad, "--out", str(tmp_path / "f.json"), "--bootstrap", "0"]):
        refused(command, bad, "variable 'tv'", "rule range", "[0, 1]", f"first bad value {value}", "target=0, window=1")
    assert not (tmp_path / "f.json").exists()


def test_nan_kl_and_top1_of_2_are_refused(tmp_path):
    """Other invalid values: NaN (never stored by the engine) and an indicator of 2."""
    path = window_file(tmp_path)
    nan = edited(path, "nan", set_var("kl", lambda v: np.where(np.arange(v.size).reshape(v.shape) == 5, np.nan, v)))
    refused(["show", nan], "variable 'kl'", "NaN", "target=1, window=4")
    two = edited(path, "two", set_var("top1_agree", lambda v: np.full_like(v, 2)))
    refused(["plot", two, "--out", str(tmp_path / "p.png")], "variable 'top1_agree'", "[0, 1]", "first bad value 2")


def test_a_metric_without_its_target_dim_is_refused(tmp_path):
    """tv without its target dim printed n = 1 under a header of 8 targets."""
    bad = edited(window_file(tmp_path), "dims", lambda ds: ds.assign(tv=ds["tv"].isel(target=0)))
    refused(["show", bad], "variable 'tv'", "rule dims", "('target', 'window')", "('window',)")


def test_a_window_of_0_and_a_window_beyond_n_are_refused(tmp_path):
    path = window_file(tmp_path)
    zero = edited(path, "w0", lambda ds: ds.assign_coords(window=[0, 4, 16, 64]))
    refused(["show", zero], "coord 'window'", "rule coords", "[1, reference_context = 64]", "first bad value 0")
    beyond = edited(path, "w65", lambda ds: ds.assign_coords(window=[1, 4, 16, 65]))
    refused(["fit", beyond, "--out", str(tmp_path / "f.json")], "first bad value 65")


def test_an_attr_of_the_wrong_type_is_refused_not_echoed(tmp_path):
    """reference_context = "sixty-four" was echoed by show."""
    bad = edited(window_file(tmp_path), "attr", lambda ds: ds.assign_attrs(reference_context="sixty-four"))
    line = refused(["show", bad], "attr 'reference_context'", "rule attrs", "a whole number of tokens", "'sixty-four'")
    other = edited(window_file(tmp_path), "pos", lambda ds: ds.assign_attrs(positions="shuffled"))
    refused(["show", other], "attr 'positions'", "one of ('original', 'reindexed')", "'shuffled'")
    assert line.startswith("error: ")


def test_a_budget_of_0_is_refused_with_its_rule_not_an_svd_error(tmp_path):
    """The issue's cryptic one: a budget of 0 in an edited file gave `error: SVD did not converge`."""
    path = budget_file(tmp_path)
    assert results.load(path).sizes["budget"] == 4
    bad = edited(path, "b0", lambda ds: ds.assign_coords(budget=[0, 4, 16, 64]))
    refused(["compare-policies", bad], "coord 'budget'", "first bad value 0")
    refused(["show", bad], "coord 'budget'")


def test_the_api_load_raises_results_error(tmp_path):
    bad = edited(window_file(tmp_path), "tv", set_var("tv", lambda v: v + 2))
    with pytest.raises(ResultsError, match="variable 'tv': rule range"):
        results.load(bad)


def test_fit_files_are_checked_on_read_by_recommend_window(tmp_path):
    """Fit files too: a power-law C edited to -3 and a curve point of 0 are refused by
    recommend-window with the entry, rule and value named; the valid file recommends."""
    import json

    path = window_file(tmp_path)
    fit = tmp_path / "f.json"
    out = CliRunner().invoke(app, ["fit", path, "--out", str(fit), "--bootstrap", "0"])
    assert out.exit_code == 0, out.output
    assert CliRunner().invoke(app, ["recommend-window", str(fit), "--eps", "0.05"]).exit_code == 0
    doc = json.loads(fit.read_text())
    i = next(i for i, f in enumerate(doc["fits"]) if f["family"] == "power" and f["status"] == "ok")
    doc["fits"][i]["params"]["C"]["value"] = -3.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    refused(["recommend-window", str(bad), "--eps", "0.05"], f"fits[{i}]", "rule params", "C must be > 0", "-3.0")
    doc = json.loads(fit.read_text())
    doc["curves"][0]["metrics"]["tv"]["points"][0] = 0
    bad.write_text(json.dumps(doc))
    refused(["recommend-window", str(bad), "--eps", "0.05"], "curves[0] (tv)", "rule points", "first bad value 0")


def test_a_file_with_duplicate_rows_is_refused_by_show_fit_and_compare(tmp_path):
    """A file of 8 targets with target 0 appended three more times: show and fit read "11 targets" and
    moved the mean; every reader now refuses it with one line naming the pair and its rows."""
    path = window_file(tmp_path)
    ok = results.load(path)
    assert (str(ok["doc"].values[0]), int(ok["position"].values[0])) == ("doc0000", 64)
    dup = edited(path, "dup", lambda ds: xr.concat([ds, ds.isel(target=[0, 0, 0])], "target"))
    assert xr.load_dataset(dup, engine="h5netcdf").sizes["target"] == 11
    want = ("rule targets", "1 (doc, position) pair appears more than once (4 rows in all)",
            "doc 'doc0000' position 64 (4 times, at target=0,8,9,10)")
    for command in (["show", dup], ["fit", dup, "--out", str(tmp_path / "f.json"), "--bootstrap", "0"],
                    ["plot", dup, "--out", str(tmp_path / "p.png")]):
        line = refused(command, dup, *want)
        assert line == f"error: {dup}: " + want[0] + (": a (doc, position) pair may appear only once per layer, policy "
                                                      "and draw; ") + want[1] + ": " + want[2]
    assert not (tmp_path / "f.json").exists() and not (tmp_path / "p.png").exists()
    bud = edited(budget_file(tmp_path), "dup", lambda ds: xr.concat([ds, ds.isel(target=[2])], "target"))
    refused(["compare-policies", bud], "doc 'doc0001' position 66 (2 times, at target=2,8)")
