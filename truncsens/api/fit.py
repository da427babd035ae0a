"""``truncsens.fit``: decay laws of D(w) (power law, exponential, power law + floor) with bootstrap
intervals over documents, compared by held-out extrapolation (:mod:`truncsens.fits.fitting`).

Results go in as files or Datasets; a :class:`FitReport` comes out, which gives the fit file's dict
(:meth:`FitReport.to_json`), the table ``truncsens fit`` prints (:meth:`FitReport.table`) and the
figure (:meth:`FitReport.plot`). Keyword names are ``truncsens fit``'s options in snake_case
(``--metric`` as ``metrics``, ``--family`` as ``families``). Nothing is written unless ``out=``
(the fit file) or ``plot_out=`` (the figure) is given; ``truncsens fit`` gives both its paths.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from truncsens.api.load import Results, datasets_of
from truncsens.engine.run.progress import StageProgress, say
from truncsens.fits import fitting
from truncsens.fits.curves import default_metrics
from truncsens.fits.fit_file import check_new_files, write_fit_file
from truncsens.fits.fitting import FitConfig, fit_datasets, parse_range
from truncsens.fits.laws import FAMILIES, FitError
from truncsens.report.plots import figure_paths, plot_report
from truncsens.report.printed import format_fit_report
from truncsens.results import utc_now


@dataclass
class FitReport(fitting.FitReport):
    """The fits of :func:`fit`: ``config``, ``results`` (one :class:`~truncsens.fits.fitting.CurveFits`
    per curve) and ``created``, with the fit file's dict, its table and its figure."""

    def table(self) -> str:
        """The text ``truncsens fit`` prints (:func:`truncsens.report.printed.format_fit_report`)."""
        return format_fit_report(self.to_json())

    def plot(self, out: str | Path, metrics: Sequence[str] | None = None, overwrite: bool = True) -> list[Path]:
        """Draw D(w) per metric with se bars and the fitted laws into ``<out>.png`` and ``<out>.pdf``
        (:func:`truncsens.report.plots.plot_report`; ``out`` ending in .png or .pdf stands for its stem).

        Returns:
            [png path, pdf path].

        Raises:
            FileExistsError: a figure exists and not ``overwrite``.
            ValueError: an unknown metric.
        """
        check_new_files(figure_paths(out), overwrite)
        return plot_report(self.to_json(), out, metrics)

    def warnings(self) -> list[str]:
        """One line per curve and metric that had sweep points excluded from its fits, naming them by
        reason (zero, below the noise floor, infinite, no values): what ``truncsens fit`` warns about
        on stderr (the table's summary lists them too)."""
        doc, out = self.to_json(), []
        for curve in doc["curves"]:
            for metric, entry in curve["metrics"].items():
                excluded = entry.get("excluded") or {}
                parts = [f"{reason}: {excluded[reason]}" for reason in ("zero", "noise_floor", "infinite", "no_values")
                         if excluded.get(reason)]
                if parts:
                    out.append(f"{curve['label']} {metric}: {curve['sweep']}s excluded from the fits ({'; '.join(parts)})")
        return out

    def write(self, path: str | Path, overwrite: bool = True) -> Path:
        """Write the fit file (JSON, :mod:`truncsens.fits.fit_file`) and return its path.

        Raises:
            FileExistsError: ``path`` exists and not ``overwrite``.
        """
        check_new_files([path], overwrite)
        return write_fit_file(self.to_json(), path)


def fit_config(metrics: str | Sequence[str] | None = None, families: str | Sequence[str] | None = None,
               fit_range: str | tuple[int, int] | None = None, holdout_range: str | tuple[int, int] | None = None,
               bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> FitConfig:
    """:class:`~truncsens.fits.fitting.FitConfig` from ``truncsens fit``'s options: names as lists or one
    comma-separated string (None: the defaults), ranges as ``(lo, hi)`` or ``"LO:HI"`` (tokens, inclusive).

    Raises:
        ValueError: a range that does not parse (:func:`truncsens.fits.fitting.parse_range`), bad bootstrap or level.
        truncsens.fits.laws.FitError: no metric, an unknown family.
    """
    return FitConfig(metrics=tuple(_names(metrics) or fitting.DEFAULT_METRICS), families=tuple(_names(families) or FAMILIES),
                     fit_range=_range(fit_range, "fit_range (--fit-range)"), holdout_range=_range(holdout_range, "holdout_range (--holdout-range)"),
                     n_boot=bootstrap, seed=seed, level=level)


def fit(results: Results | Sequence[Results], *, metrics: str | Sequence[str] | None = None,
        families: str | Sequence[str] | None = None, fit_range: str | tuple[int, int] | None = None,
        holdout_range: str | tuple[int, int] | None = None, bootstrap: int = 1000, seed: int = 0, level: float = 0.95,
        out: str | Path | None = None, plot_out: str | Path | None = None, overwrite: bool = False,
        progress: bool = True) -> FitReport:
    """Fit results side by side (one curve per results, per policy of a policy sweep).

    Args:
        results: a results file or Dataset, or a list of them (files are labelled by their stem,
            Datasets ``results`` / ``results-<i>``).
        metrics: metrics to fit (default: the divergences tv, kl, kl_reverse, js that every results holds).
        families: law families (default: every family of :data:`truncsens.fits.laws.FAMILIES`).
        fit_range, holdout_range: ``(lo, hi)`` or ``"LO:HI"`` in tokens, inclusive (default: see
            :func:`truncsens.fits.fitting.default_ranges`).
        bootstrap: resamples over documents (0: no intervals); seed: their seed; level: interval level.
        out: write the fit file (JSON) here; plot_out: draw the figure to ``<plot_out>.png`` / ``.pdf``.
        overwrite: replace them; without it an existing one is refused before anything is fitted.
        progress: say each stage on stderr (reading, then each curve and metric fitted: a bar on a
            terminal, a line each in a log; :class:`truncsens.engine.run.progress.StageProgress`).

    Returns:
        a :class:`FitReport`.

    Raises:
        FileExistsError: ``out`` or a figure exists and not ``overwrite``.
        ValueError: a results file given twice.
        FileNotFoundError, truncsens.results.ResultsError: a results file is missing or not one; an
            unknown metric, fewer than two sweep points.
        truncsens.fits.laws.FitError, ValueError: as :func:`fit_config` and
            :func:`truncsens.fits.fitting.fit_curve` (too few points in the fit range, ...); no law
            fitted at all (every family skipped for every curve and metric: the reason is named).
    """
    cfg = fit_config(metrics, families, fit_range, holdout_range, bootstrap, seed, level)
    check_new_files([out, *(figure_paths(plot_out) if plot_out is not None else [])], overwrite)
    files = [r for r in (results if isinstance(results, (list, tuple)) else [results]) if isinstance(r, (str, Path))]
    resolved = [Path(f).resolve() for f in files]
    twice = next((f for f, r in zip(files, resolved) if resolved.count(r) > 1), None)
    if twice is not None:  # two identical curves under one label, fitted twice
        raise ValueError(f"{twice} is given twice; give each results file once")
    if files:
        say("fit", f"reading {len(files)} results file{'' if len(files) == 1 else 's'}", progress)
    datasets, sources = datasets_of(results)
    if not metrics:  # the divergences every results holds (all four in a file of today)
        cfg = replace(cfg, metrics=default_metrics(datasets))
    with StageProgress("fit", progress) as stages:
        done = fit_datasets(datasets, cfg, sources, on_stage=stages)
    report = FitReport(done.config, done.results, utc_now())
    doc = report.to_json()
    if doc["fits"] and not any(f["status"] != "skipped" for f in doc["fits"]):
        first = doc["fits"][0]
        raise FitError(f"nothing was fitted: every law was skipped for every curve and metric "
                       f"(first: {first['label']} {first['metric']}: {first['reason']})")
    if out is not None or plot_out is not None:
        if out is not None:
            write_fit_file(doc, out)
        if plot_out is not None:
            plot_report(doc, plot_out)
    return report


def _names(values: str | Sequence[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for v in values.split(",") if v.strip()] if isinstance(values, str) else list(values)


def _range(value: str | tuple[int, int] | None, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    return parse_range(value, what) if isinstance(value, str) else (int(value[0]), int(value[1]))
