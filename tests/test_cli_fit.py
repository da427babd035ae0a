"""`truncsens fit`, `recommend-window` and `plot` through the Typer app: happy paths and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from truncsens.cli.main import app
from truncsens.results import save
from truncsens.results.constructed import curve_results

runner = CliRunner()
POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *fragments: str) -> str:
    """Exit code 2, one `error: ...` line on stderr, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_fit")
    a = curve_results({"tv": lambda w: 0.02 * w**-0.5, "kl": lambda w: 1e-3 * w**-1.0, "kl_reverse": lambda w: 1e-3 * w**-1.0,
                       "js": lambda w: 2.5e-4 * w**-1.0}, POW2, n_docs=20, doc_noise=0.1, seed=1)
    b = curve_results({"tv": lambda w: 0.03 * np.exp(-w / 200), "kl": lambda w: 1e-3 * np.exp(-w / 100),
                       "kl_reverse": lambda w: 1e-3 * np.exp(-w / 100), "js": lambda w: 3e-4 * np.exp(-w / 100)},
                      POW2, n_docs=20, doc_noise=0.1, seed=2)
    save(a, root / "code.nc")
    save(b, root / "nl.nc")
    save(curve_results({"tv": lambda w: 0.02 * w**-0.5}, [8], n_docs=4), root / "one.nc")
    save(curve_results({"tv": lambda w: 0.02 * w**-0.5}, [8, 16], n_docs=4), root / "two.nc")
    save(curve_results({"tv": lambda w: 0.02 * w**-0.5}, [8, 16, 32], n_docs=4), root / "three.nc")
    save(curve_results({}, POW2, n_docs=4), root / "zero.nc")
    (root / "junk.nc").write_text("this is not NetCDF")
    return root


def test_fit_table_json_and_plot(files, tmp_path):
    out = tmp_path / "fit.json"
    r = invoke("fit", files / "code.nc", files / "nl.nc", "--bootstrap", "200", "--seed", "1", "--out", out, "--plot")
    assert r.exit_code == 0, (r.output, r.exception)
    assert out.is_file() and (tmp_path / "fit.png").is_file() and (tmp_path / "fit.pdf").is_file()
    text = r.stdout
    assert "code" in text and "nl" in text and "alpha_kl / alpha_tv" in text
    assert "code tv: " in text and "nl tv: exponential wins held-out extrapolation" in text
    doc = json.loads(out.read_text())
    assert doc["settings"]["bootstrap"] == 200 and doc["settings"]["metrics"] == ["tv", "kl", "kl_reverse", "js"]
    code_tv = next(f for f in doc["fits"] if f["label"] == "code" and f["metric"] == "tv" and f["family"] == "power")
    alpha = code_tv["params"]["alpha"]
    assert alpha["value"] == pytest.approx(0.5, abs=0.02) and alpha["ci"][0] < alpha["value"] < alpha["ci"][1]
    r = invoke("fit", files / "code.nc", "--metric", "tv", "--fit-range", "2:64", "--holdout-range", "128:512",
               "--bootstrap", "50", "--json", "--out", tmp_path / "tv.json")
    assert r.exit_code == 0, (r.output, r.exception)
    printed = json.loads(r.stdout)
    assert printed["settings"]["fit_range"] == [2, 64] and {f["metric"] for f in printed["fits"]} == {"tv"}
    assert printed["fits"][0]["fit_points"] == [2, 4, 8, 16, 32, 64] and printed["fits"][0]["holdout_points"] == [128, 256, 512]
    assert "wrote" in r.stderr


def test_fit_default_output_next_to_results(files):
    r = invoke("fit", files / "code.nc", "--metric", "tv", "--bootstrap", "20")
    assert r.exit_code == 0, (r.output, r.exception)
    assert (files / "code.fit.json").is_file()


def test_fit_level_sets_the_intervals_and_their_labels(files, tmp_path):
    def alpha_ci(level: str):
        out = tmp_path / f"l{level}.json"
        r = invoke("fit", files / "code.nc", "--metric", "tv", "--family", "power", "--bootstrap", "200", "--level", level,
                   "--out", out)
        assert r.exit_code == 0, (r.output, r.exception)
        return r.stdout, json.loads(out.read_text())["fits"][0]["params"]["alpha"]["ci"]

    text90, ci90 = alpha_ci("0.9")
    text95, ci95 = alpha_ci("0.95")
    assert "parameters (90% CI)" in text90 and "intervals: 90% percentile" in text90 and "95%" not in text90
    assert "parameters (95% CI)" in text95
    assert ci95[0] < ci90[0] < ci90[1] < ci95[1]  # same resamples: the 90% interval lies inside the 95% one


def test_fit_names_the_fewest_windows_a_law_needs_first(files, tmp_path):
    """power and exponential have 2 parameters: 3 windows at least, said for one window as for two (not
    "at least 2" and then, on two windows, "power needs at least 3")."""
    one = assert_user_error(invoke("fit", files / "one.nc", "--metric", "tv", "--out", tmp_path / "1.json"), "only one window ([8])")
    two = assert_user_error(invoke("fit", files / "two.nc", "--metric", "tv", "--out", tmp_path / "2.json"), "only 2 windows ([8, 16])")
    assert "needs at least 3" in one and "needs at least 3" in two
    # power_floor has 3 parameters: 4 windows when it is the only family asked for
    assert_user_error(invoke("fit", files / "three.nc", "--metric", "tv", "--family", "power_floor", "--out", tmp_path / "3.json"),
                      "only 3 windows", "needs at least 4")
    r = invoke("fit", files / "three.nc", "--metric", "tv", "--bootstrap", "0", "--out", tmp_path / "3.json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert not (tmp_path / "1.json").exists() and not (tmp_path / "2.json").exists()


def test_fit_bad_input(files):
    assert_user_error(invoke("fit", files / "junk.nc"), "not a NetCDF results file")
    assert_user_error(invoke("fit", files / "missing.nc"), "not found")
    assert_user_error(invoke("fit", files / "one.nc"), "only one window")
    # D = 0 everywhere: the measurement is the answer, but no law is fitted: exit 2 saying why, no file
    # (a fit that skipped every family used to exit 0)
    zero = invoke("fit", files / "zero.nc", "--metric", "tv", "--out", files / "zero-fit.json")
    assert_user_error(zero, "nothing was fitted")
    assert "reaches exactly 0 at window 1" in zero.output and not (files / "zero-fit.json").exists()
    assert_user_error(invoke("fit", files / "code.nc", "--fit-range", "4-128"), "--fit-range")
    assert_user_error(invoke("fit", files / "code.nc", "--metric", "entropy", "--out", files / "bad.json"), "unknown metric")
    assert_user_error(invoke("fit", files / "code.nc", "--bootstrap", "-1"), "--bootstrap")
    (files / "notfit.json").write_text("{}")
    assert_user_error(invoke("recommend-window", files / "notfit.json", "--eps", "0.01"), "not a truncsens fit file")
    # a fit file given where results are read: named as a fit file, with the command that reads it
    assert_user_error(invoke("fit", files / "notfit.json"), f"{files / 'notfit.json'} is a fit file (the JSON `truncsens fit` "
                      f"writes), not a results file: `truncsens recommend-window {files / 'notfit.json'}` reads it")
    assert_user_error(invoke("compare-policies", files / "notfit.json"), "is a fit file")
    assert_user_error(invoke("show", files / "notfit.json"), "notfit.json is a fit file (the JSON `truncsens fit` writes)")


def test_recommend_window_from_fit_and_results(files, tmp_path):
    out = tmp_path / "fit.json"
    assert invoke("fit", files / "code.nc", "--metric", "tv", "--bootstrap", "200", "--out", out).exit_code == 0
    power = next(f for f in json.loads(out.read_text())["fits"] if f["family"] == "power")
    C, a = power["params"]["C"]["value"], power["params"]["alpha"]["value"]
    r = invoke("recommend-window", out, "--eps", "0.01", "--eps", "0.05", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    recs = json.loads(r.stdout)["recommendations"]
    assert [x["eps"] for x in recs] == [0.01, 0.05]
    assert recs[0]["w_law"] == (C / 0.01) ** (1 / a)
    assert recs[0]["w_law_ci"][0] < recs[0]["w_law"] < recs[0]["w_law_ci"][1]
    r = invoke("recommend-window", "--fit", out, "--eps", "0.0001")
    assert r.exit_code == 0 and "beyond the largest measured window" in r.stderr and "warning:" not in r.stdout
    r = invoke("recommend-window", files / "code.nc", "--eps", "0.01", "--bootstrap", "50", "--metric", "tv", "--metric", "kl")
    assert r.exit_code == 0, (r.output, r.exception)
    assert " tv " in r.stdout and " kl " in r.stdout


@pytest.mark.parametrize("eps,fragment", [("0", "> 0"), ("-0.1", "> 0"), ("1.5", "(0, 1]"), ("nan", "finite"), ("inf", "finite")])
def test_recommend_window_bad_eps(files, eps, fragment):
    assert_user_error(invoke("recommend-window", files / "code.nc", "--eps", eps, "--bootstrap", "10"), fragment)


def test_recommend_window_needs_exactly_one_source(files):
    assert_user_error(invoke("recommend-window", "--eps", "0.01"), "exactly one")
    assert_user_error(invoke("recommend-window", files / "code.nc", "--fit", files / "code.nc", "--eps", "0.01"), "exactly one")


def test_plot_command(files, tmp_path):
    r = invoke("plot", files / "code.nc", files / "nl.nc", "--out", tmp_path / "p", "--metric", "tv")
    assert r.exit_code == 0, (r.output, r.exception)
    assert (tmp_path / "p.png").stat().st_size > 1000 and (tmp_path / "p.pdf").is_file()
    fit = tmp_path / "f.json"
    assert invoke("fit", files / "code.nc", "--bootstrap", "0", "--out", fit).exit_code == 0
    r = invoke("plot", files / "code.nc", "--fit", fit, "--out", tmp_path / "q")
    assert r.exit_code == 0, (r.output, r.exception)
    assert_user_error(invoke("plot", files / "nl.nc", "--fit", fit, "--out", tmp_path / "z"), "was not made from")


def test_fit_warns_on_stderr_about_excluded_windows_and_refuses_when_nothing_fits(tmp_path):
    """Excluded windows were listed only in the summary (now also a warning on stderr); a
    curve below the noise floor at every window (another curve with no usable window) exits 2."""
    from truncsens import results
    from truncsens.results.constructed import curve_results

    windows = [1, 2, 4, 8, 16, 32, 64]
    part = curve_results({"tv": lambda w: np.where(w >= 32, 0.0, 0.5 * w ** -0.7)}, windows, n_docs=4,
                         reference_context=64)
    path = results.save(part, tmp_path / "part.nc")
    out = invoke("fit", path, "--metric", "tv", "--bootstrap", "0", "--out", tmp_path / "part.json")
    assert out.exit_code == 0, out.output
    assert "warning: part tv: windows excluded from the fits (zero: [32, 64])" in out.stderr
    floor = curve_results({"tv": lambda w: np.full(w.shape, 1e-8)}, windows, n_docs=4, reference_context=64)
    path = results.save(floor, tmp_path / "floor.nc")
    assert_user_error(invoke("fit", path, "--metric", "tv", "--out", tmp_path / "floor.json"), "nothing was fitted",
                      "noise floor")
    assert not (tmp_path / "floor.json").exists()


def test_every_reading_command_accepts_no_progress(files, tmp_path):
    """A script may pass --no-progress to every command: show, plot and compare-policies take it (they
    show none) as measure, fit and recommend-window do; the output is the one without it."""
    shown = invoke("show", files / "code.nc")
    quiet = invoke("show", files / "code.nc", "--no-progress")
    assert quiet.exit_code == 0 and quiet.stdout == shown.stdout
    plotted = invoke("plot", files / "code.nc", "--out", tmp_path / "fig", "--no-progress")
    assert plotted.exit_code == 0 and (tmp_path / "fig.png").is_file()
    assert_user_error(invoke("compare-policies", files / "code.nc", "--no-progress"), "needs a policy results file")
