"""The file-in, file-out steps behind ``truncsens fit`` and ``truncsens plot``: fit results files and
write the fit file (and figures), or draw results files with the laws of a matching fit file."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from truncsens.fit.fit_file import check_new_files, default_fit_path, plot_prefix, read_fit_file, use_fits_from, write_fit_file
from truncsens.fit.fitting import DEFAULT_METRICS, FitConfig, fit_results
from truncsens.report.plots import figure_paths, plot_report


def fit_to_file(results_files: Sequence[str | Path], cfg: FitConfig, out: str | Path | None = None,
                plot: bool = False, plot_out: str | Path | None = None, overwrite: bool = True) -> tuple[dict, Path, list[Path]]:
    """Fit results files side by side, write the fit file, optionally draw it.

    Args:
        results_files: results files of ``truncsens measure``.
        cfg: the fit configuration.
        out: fit file path (default :func:`truncsens.fit.fit_file.default_fit_path`).
        plot: also write ``<plot_out>.png`` and ``.pdf`` (default prefix: the fit file without ``.json``).
        plot_out: figure prefix (implies ``plot``).
        overwrite: replace existing files; False refuses before fitting.

    Returns:
        (fit file dict, fit file path, figure paths).

    Raises:
        FileExistsError: an output exists and not ``overwrite``.
        FileNotFoundError, ResultsError, FitError: see :func:`truncsens.fit.fitting.fit_results`.
    """
    path = Path(out or default_fit_path(results_files))
    prefix = Path(plot_out) if plot_out else plot_prefix(path)
    plot = plot or plot_out is not None
    check_new_files([path, *(figure_paths(prefix) if plot else [])], overwrite)
    doc = fit_results([str(p) for p in results_files], cfg).to_json()
    path = write_fit_file(doc, path)
    figures = plot_report(doc, prefix) if plot else []
    return doc, path, figures


def plot_results(results_files: Sequence[str | Path], out: str | Path, fit_file: str | Path | None = None,
                 metrics: Sequence[str] | None = None, fit_range: tuple[int, int] | None = None,
                 overwrite: bool = True) -> list[Path]:
    """Draw results files with fitted laws: fitted now without intervals, or taken from ``fit_file``
    (which must have been made from these very results files, :func:`truncsens.fit.fit_file.same_curve`).

    Args:
        metrics: panels (default: those of :data:`truncsens.fit.fitting.DEFAULT_METRICS` that ``fit_file``
            has, or all four without a fit file).
        fit_range: fit range when fitting now.

    Returns:
        [png path, pdf path].

    Raises:
        FileExistsError: ``out.png`` or ``out.pdf`` exists and not ``overwrite`` (checked first).
        ValueError: the fit file does not match the results, or a metric is missing.
    """
    check_new_files(figure_paths(Path(out)), overwrite)
    chosen = tuple(metrics) if metrics else DEFAULT_METRICS
    fitted = None
    if fit_file is not None:
        fitted = read_fit_file(fit_file)
        have = {m for c in fitted["curves"] for m in c["metrics"]}
        chosen = chosen if metrics else tuple(m for m in chosen if m in have)
    doc = fit_results([str(p) for p in results_files], FitConfig(metrics=chosen, n_boot=0, fit_range=fit_range)).to_json()
    if fitted is not None:
        doc = use_fits_from(doc, fitted, fit_file)
    return plot_report(doc, out, chosen)
