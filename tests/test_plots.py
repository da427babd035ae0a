"""Figures of D(w) with error bars and fitted laws (truncsens.report.plots)."""

from __future__ import annotations

import numpy as np
import pytest

from truncsens.fits.curves import curves_of
from truncsens.fits.fitting import FitConfig, FitReport, fit_curve
from truncsens.report.plots import build_figure, figure_paths, panel_metrics, plot_report
from truncsens.results.constructed import curve_results


def _doc(n_curves: int = 1):
    results = []
    for i in range(n_curves):
        ds = curve_results({"tv": lambda w: 0.02 * w**-0.5, "kl": lambda w: 1e-3 * w**-1.0},
                           [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], n_docs=8, doc_noise=0.1, seed=i)
        [curve] = curves_of(ds, ["tv", "kl"], f"run{i}.nc")
        results.append(fit_curve(curve, FitConfig(metrics=("tv", "kl"), n_boot=0)))
    return FitReport(FitConfig(metrics=("tv", "kl"), n_boot=0), results).to_json()


def test_one_panel_per_metric_with_bars_and_laws():
    doc = _doc(2)
    fig = build_figure(doc)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title().split(":")[0] for ax in axes] == ["tv", "kl"]
    for ax in axes:
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert len(ax.containers) == 2  # one error-bar series per results file
        laws = [l for l in ax.get_lines() if l.get_label().split()[-1] in ("w^-α", "exp(-w/τ)", "D∞")]
        assert len(laws) == 2 * 3  # three families per file
    tv_ax = axes[0]
    bars = tv_ax.containers[0]
    np.testing.assert_allclose(bars.lines[0].get_ydata(), 0.02 * np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512.0]) ** -0.5, rtol=0.2)
    only_power = build_figure(doc, ["kl"], families=["power"])
    [ax] = [a for a in only_power.axes if a.get_visible()]
    assert sum("power:" in l.get_label() for l in ax.get_lines()) == 2


def test_plot_report_writes_png_and_pdf(tmp_path):
    paths = plot_report(_doc(), tmp_path / "sub" / "fig")
    assert [p.name for p in paths] == ["fig.png", "fig.pdf"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[1].read_bytes()[:5] == b"%PDF-"


def test_figure_paths_accept_a_figure_suffix(tmp_path):
    """``--out fig``, ``--out fig.png`` and ``--out fig.PDF`` all name fig.png and fig.pdf; another
    suffix is part of the prefix (``run.v2`` gives run.v2.png)."""
    want = [tmp_path / "fig.png", tmp_path / "fig.pdf"]
    assert figure_paths(tmp_path / "fig") == want
    assert figure_paths(tmp_path / "fig.png") == want and figure_paths(str(tmp_path / "fig.PDF")) == want
    assert [p.name for p in figure_paths(tmp_path / "run.v2")] == ["run.v2.png", "run.v2.pdf"]
    paths = plot_report(_doc(), tmp_path / "out.png")
    assert [p.name for p in paths] == ["out.png", "out.pdf"] and not (tmp_path / "out.png.png").exists()


def test_unknown_metric_is_an_error():
    doc = _doc()
    assert panel_metrics(doc) == ["tv", "kl"]
    with pytest.raises(ValueError, match="js"):
        build_figure(doc, ["js"])
