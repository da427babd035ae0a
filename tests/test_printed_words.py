"""What the reports print in words: a count of one is singular, a fit without resamples says it has
no intervals, an unknown metric is named with the file it is missing from, and every output that
exists is refused with the same sentence."""

from __future__ import annotations

import pytest

from truncsens.fits.fit_file import check_new_files
from truncsens.fits.fitting import FitConfig, fit_datasets
from truncsens.report.policy_comparison import policy_curves
from truncsens.report.printed import format_fit_report
from truncsens.report.tables import fmt_count
from truncsens.results.constructed import curve_results
from truncsens.engine.run.shards import check_output
from truncsens.engine.config import MeasureError


def test_a_count_of_one_is_singular():
    assert fmt_count(1, "target") == "1 target"
    assert [fmt_count(n, "document") for n in (0, 2, 376)] == ["0 documents", "2 documents", "376 documents"]


def test_a_fit_without_resamples_says_it_has_no_intervals():
    ds = curve_results({"tv": lambda w: 0.3 * w ** -0.5}, [1, 2, 4, 8, 16, 32, 64], n_docs=3)
    report = format_fit_report(fit_datasets([ds], FitConfig(metrics=("tv",), n_boot=0), ["a.nc"]).to_json())
    assert report.splitlines()[-1] == "intervals: none (--bootstrap 0)"
    assert "0 resamples" not in report
    with_boot = format_fit_report(fit_datasets([ds], FitConfig(metrics=("tv",), n_boot=20), ["a.nc"]).to_json())
    assert with_boot.splitlines()[-1] == "intervals: 95% percentile bootstrap over documents, 20 resamples, seed 0"


def test_an_unknown_metric_names_the_file():
    ds = curve_results({"kl": lambda k: 2.0 * k ** -0.8}, [16, 32, 64], n_docs=2, sweep="budget",
                       attrs={"policy": "sink_recent"})
    from truncsens.results import ResultsError

    with pytest.raises(ResultsError, match=r"^runs/p\.nc: unknown metric\(s\) foo; the file has "):
        policy_curves(ds, ["foo"], "runs/p.nc")
    assert [name for name, _ in policy_curves(ds, ["kl"], "runs/p.nc")] == ["sink_recent"]


def test_an_existing_output_is_refused_with_one_sentence(tmp_path):
    fit_json, results = tmp_path / "a.fit.json", tmp_path / "a.nc"
    fit_json.write_text("{}")
    results.write_bytes(b"x")
    with pytest.raises(FileExistsError) as fit_refused:
        check_new_files([fit_json], overwrite=False)
    with pytest.raises(MeasureError) as measure_refused:
        check_output(results, overwrite=False, resume=False)
    assert str(fit_refused.value) == f"{fit_json} already exists: pass --overwrite to replace it, or choose another --out"
    assert str(measure_refused.value) == f"{results} already exists: pass --overwrite to replace it, or choose another --out"
    figure = tmp_path / "a.png"
    figure.write_bytes(b"x")
    with pytest.raises(FileExistsError, match=r"already exist: pass --overwrite to replace them, or choose another --out$"):
        check_new_files([fit_json, figure], overwrite=False)


def test_a_results_file_given_twice_is_refused(tmp_path):
    from truncsens.api.fit import fit
    from truncsens.results import save

    path = tmp_path / "a.nc"
    save(curve_results({"tv": lambda w: 0.3 * w ** -0.5}, [1, 2, 4, 8, 16, 32, 64], n_docs=3), path)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'a.nc'} is given twice; give each results file once$"):
        fit([path, tmp_path / "." / "a.nc"], bootstrap=0, progress=False)
    assert fit([path], bootstrap=0, progress=False).to_json()["fits"]
