"""``truncsens.show``: per-sweep-point statistics of a results file (n, mean ± standard error, median,
p90, p99 of each metric; :mod:`truncsens.report.summary`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import xarray as xr

from truncsens.api.load import refuse_fit_file
from truncsens.report.summary import ResultsSummary, summarize_file


def show(results_file: str | Path | xr.Dataset, *, metrics: str | Sequence[str] | None = None) -> ResultsSummary:
    """The statistics ``truncsens show`` prints (:func:`truncsens.report.printed.format_results_summary`)
    or, with ``--json``, gives as ``.to_json()``; ``.table()`` is the printed text.

    Args:
        results_file: a results file, or a results Dataset in memory (as :func:`truncsens.measure` returns).
        metrics: metric(s) to show (default: all).

    Raises:
        FileNotFoundError, truncsens.results.ResultsError: as :func:`truncsens.load`; a fit file given.
        ValueError: an unknown metric.
    """
    if not isinstance(results_file, xr.Dataset):
        refuse_fit_file(results_file)
    names = [m.strip() for m in metrics.split(",") if m.strip()] if isinstance(metrics, str) else metrics
    return summarize_file(results_file, None if names is None else list(names))
