"""``truncsens.recommend_window``: the window w(eps) that keeps D(w) <= eps, with its interval and the
KV memory it implies (rules: :mod:`truncsens.budget.recommend`), from a fit or from results fitted on
the fly. Keyword names are ``truncsens recommend-window``'s options in snake_case."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import xarray as xr

from truncsens.api.fit import FitReport, fit, fit_config
from truncsens.budget.recommend import Recommendation, recommend, recommend_windows
from truncsens.budget.windows import check_eps
from truncsens.engine.run.progress import StageProgress
from truncsens.fits import fitting


def recommend_window(fit_or_results: FitReport | dict | str | Path | xr.Dataset, eps: float | Sequence[float], *,
                     metrics: str | Sequence[str] | None = None, fit_range: str | tuple[int, int] | None = None,
                     bootstrap: int = 1000, seed: int = 0, progress: bool = True) -> list[Recommendation]:
    """w(eps) for every curve, metric and eps.

    Args:
        fit_or_results: a fit (:func:`truncsens.fit`'s report, or a fit file's dict), a fit file, or
            results (a results file or Dataset) fitted now with ``metrics``, ``fit_range``,
            ``bootstrap`` and ``seed`` (as :func:`truncsens.fit`).
        eps: distortion target(s) in the metric's units.
        metrics: the metric(s) whose power law and curve to use (default: tv).
        progress: when results are fitted, say each stage on stderr (as :func:`truncsens.fit`).

    Returns:
        one :class:`~truncsens.budget.recommend.Recommendation` per (metric, curve, eps), metrics in the
        order given (``.window``, ``.window_ci``, ``.basis``, ``.warnings``, ``.to_json()``).

    Raises:
        ValueError: a bad eps (checked before anything is read or fitted), a bad range.
        truncsens.fits.laws.FitError: the fit has no power law for a metric; as :func:`truncsens.fit`.
        FileNotFoundError, truncsens.results.ResultsError: a missing or unreadable file.
    """
    eps_values = [float(eps)] if isinstance(eps, (int, float)) else [float(e) for e in eps]
    names = ([m.strip() for m in metrics.split(",") if m.strip()] if isinstance(metrics, str) else list(metrics or ())) or ["tv"]
    cfg = fit_config(names, fit_range=fit_range, bootstrap=bootstrap, seed=seed)
    if isinstance(fit_or_results, (str, Path)):  # a fit file, or a results file fitted on the fly
        with StageProgress("recommend-window", progress) as stages:
            return recommend_windows(fit_or_results, eps_values, names, cfg, on_stage=stages)
    for m in names:  # before fitting (up to a thousand bootstrap refits)
        for e in eps_values:
            check_eps(e, m)
    if isinstance(fit_or_results, xr.Dataset):
        fit_or_results = fit(fit_or_results, metrics=names, fit_range=cfg.fit_range, bootstrap=bootstrap, seed=seed,
                             progress=progress)
    doc = fit_or_results.to_json() if isinstance(fit_or_results, fitting.FitReport) else fit_or_results
    return [r for m in names for r in recommend(doc, eps_values, m)]
