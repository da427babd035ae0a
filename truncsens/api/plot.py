"""``truncsens.plot``: results drawn on log-log axes, one panel per metric (mean D(w) ± se), with the
fitted laws: fitted now without intervals, or taken from a fit file made from the same results."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from truncsens.api.fit import fit_config
from truncsens.api.load import Results, datasets_of
from truncsens.fits.curves import default_metrics
from truncsens.fits.fit_file import check_new_files, read_fit_file, use_fits_from
from truncsens.fits.fitting import DEFAULT_METRICS, fit_datasets
from truncsens.report.plots import figure_paths, plot_report


def plot(results: Results | Sequence[Results], out: str | Path, *, fit: str | Path | None = None,
         metrics: str | Sequence[str] | None = None, fit_range: str | tuple[int, int] | None = None,
         overwrite: bool = False) -> list[Path]:
    """Draw results with their laws into ``<out>.png`` and ``<out>.pdf`` (``truncsens plot``).

    Args:
        results: a results file or Dataset, or a list of them.
        out: figure prefix (one ending in .png or .pdf stands for its stem).
        fit: a fit file of ``truncsens fit`` made from these very results
            (:func:`truncsens.fits.fit_file.same_curve`) whose laws to draw (None: fit now, no intervals).
        metrics: panels (default: those of tv, kl, kl_reverse, js that ``fit`` has, or without it those
            every results holds).
        fit_range: ``(lo, hi)`` or ``"LO:HI"`` when fitting now.
        overwrite: replace existing figures (checked before anything is read).

    Returns:
        [png path, pdf path].

    Raises:
        FileExistsError: a figure exists and not ``overwrite``.
        ValueError: the fit file does not match the results, a metric is missing, a bad range.
        FileNotFoundError, truncsens.results.ResultsError, truncsens.fits.laws.FitError: as :func:`truncsens.fit`.
    """
    check_new_files(figure_paths(Path(out)), overwrite)
    fitted = read_fit_file(fit) if fit is not None else None
    datasets, sources = datasets_of(results)
    if metrics:
        chosen = tuple(metrics.split(",") if isinstance(metrics, str) else metrics)
    elif fitted is not None:
        have = {m for c in fitted["curves"] for m in c["metrics"]}
        chosen = tuple(m for m in DEFAULT_METRICS if m in have)
    else:
        chosen = default_metrics(datasets)  # the divergences every results holds
    doc = fit_datasets(datasets, fit_config(chosen, fit_range=fit_range, bootstrap=0), sources).to_json()
    if fitted is not None:
        doc = use_fits_from(doc, fitted, fit)
    return plot_report(doc, out, chosen)
