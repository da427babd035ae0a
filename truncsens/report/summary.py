"""Per-window (or per-budget) summaries of a results file: mean, standard error, quantiles.

The standard error is the document-clustered CR1 estimator of :mod:`truncsens.stats` (targets of
one document are dependent), the same one :mod:`truncsens.fits.fitting` weights its fits with; for
values with no document ids (:func:`summarize_values`) every value is its own cluster, which is
the textbook s / sqrt(n).

Non-finite values are counted, never silently dropped: ``n`` counts every value that is not NaN,
``n_inf`` how many of those are infinite (KL = +inf where q = 0 < p), ``n_nan`` the NaN values
(left out). The mean of a set that holds +inf **is** +inf (IEEE arithmetic); its standard error is
NaN; quantiles that reach an infinite order statistic are infinite
(:func:`truncsens.stats.quantiles_with_inf`). KL values [inf, 0.5, 0.5, 0.5] give n = 4,
n_inf = 1, mean inf, median 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

from truncsens.fits.fit_file import sanitize
from truncsens.report.printed import format_summary
from truncsens.results import groups, load, mean_over_draws, metrics_of, sweep_dim
from truncsens.stats import cluster_mean_se, quantiles_with_inf

COUNTS = ("n", "n_inf", "n_nan")
STATS = ("mean", "se", "median", "p90", "p99")


def summarize_values(values: np.ndarray, doc: list[str] | None = None) -> dict[str, float]:
    """Counts, mean, clustered standard error of the mean, median, 90th and 99th percentiles.

    Args:
        values: [n] numbers; NaN values are counted in ``n_nan`` and left out; infinite ones are
            kept (counted in ``n_inf``): the mean of a set with +inf is +inf.
        doc: [n] document id of each value (None: every value its own document, se = s / sqrt(n)).

    Returns:
        dict with the keys of :data:`COUNTS` (ints) then :data:`STATS` (NaN where there are no
        values; se NaN for fewer than two documents or when a value is infinite).
    """
    values = np.asarray(values, dtype=np.float64).ravel()
    nan = np.isnan(values)
    v = values[~nan]
    counts = {"n": int(v.size), "n_inf": int(np.isinf(v).sum()), "n_nan": int(nan.sum())}
    if v.size == 0:
        return {**counts, **{k: float("nan") for k in STATS}}
    finite = np.isfinite(values)
    if counts["n_inf"]:
        se = np.array([np.nan])
    elif doc is None:
        _, se = cluster_mean_se(v[:, None], [str(i) for i in range(v.size)])  # [1]
    else:  # every document counts towards G, also one whose values are all NaN
        _, se = cluster_mean_se(np.where(finite, values, np.nan)[:, None], doc)  # [1]
    with np.errstate(invalid="ignore"):
        mean = float(np.mean(v))  # +inf with a +inf value, NaN with +inf and -inf
    median, p90, p99 = quantiles_with_inf(v, (50, 90, 99))
    return {**counts, "mean": mean, "se": float(se[0]), "median": median, "p90": p90, "p99": p99}


def summarize(ds: xr.Dataset, metrics: list[str] | None = None) -> list[dict]:
    """One row per ([layer,] [policy,] sweep value, metric): ``{"layer"?, "policy"?, sweep, "metric", "n", "n_inf",
    "n_nan", stats...}``
    (counts and stats of :func:`summarize_values`). ``metrics`` defaults to every metric the file holds
    (:func:`truncsens.results.metrics_of`, in the order of :data:`truncsens.metrics.METRICS`).

    ``se`` is the document-clustered standard error of the mean (:func:`truncsens.stats.cluster_mean_se`).
    A file with a ``draw`` dim is first averaged over draws per target
    (:func:`truncsens.results.mean_over_draws`).

    Raises:
        ValueError: an unknown metric name.
    """
    ds = mean_over_draws(ds)
    held = metrics_of(ds)
    metrics = list(metrics or held)
    unknown = [m for m in metrics if m not in ds.data_vars]
    if unknown:
        raise ValueError(f"unknown metric(s) {', '.join(unknown)}; the file has {', '.join(held)}")
    sweep = sweep_dim(ds)
    docs = [str(d) for d in ds["doc"].values]
    rows = []
    for group in groups(ds):  # one curve per (layer, policy) present
        sub = ds.sel(group)
        for metric in metrics:
            for value in ds[sweep].values:
                col = sub[metric].sel({sweep: value}).values.astype(float)  # [target]
                row = {"metric": metric, sweep: int(value), **group}
                row.update(summarize_values(col, docs))
                rows.append(row)
    return rows


def format_table(rows: list[dict], sweep: str) -> str:
    """Rows of :func:`summarize` as a plain-text table, one block per (policy, metric)
    (:func:`truncsens.report.printed.format_summary`)."""
    return format_summary(rows, sweep)


@dataclass
class ResultsSummary:
    """What ``show`` prints: a results file's attrs, number of targets, sweep name and :func:`summarize` rows."""

    file: str
    attrs: dict
    n_targets: int
    sweep: str
    rows: list[dict]
    contexts: tuple[int, int] | None = None  # (shortest, longest) actual reference context of a block-protocol file

    def to_json(self) -> dict:
        """JSON-safe dict ``{"file", "attrs", "sweep", "rows"}``: numpy scalars to Python, NaN (se of one
        document) and inf (KL of disjoint supports; ``n_inf`` says how many) to null."""
        return sanitize({"file": self.file, "attrs": self.attrs, "sweep": self.sweep, "rows": self.rows})

    def table(self) -> str:
        """The text ``truncsens show`` prints (:func:`truncsens.report.printed.format_results_summary`)."""
        from truncsens.report.printed import format_results_summary

        return format_results_summary(self)


def summarize_file(path: str | Path | xr.Dataset, metrics: list[str] | None = None) -> ResultsSummary:
    """Load a results file (or take a results Dataset in memory, named ``<in memory>``) and
    :func:`summarize` it.

    Raises:
        FileNotFoundError, ResultsError: as :func:`truncsens.results.load`; ValueError: an unknown metric.
    """
    ds, path = (path, "<in memory>") if isinstance(path, xr.Dataset) else (load(path), path)
    contexts = None
    if "actual_context" in ds.coords and ds.sizes["target"]:
        contexts = (int(ds["actual_context"].min()), int(ds["actual_context"].max()))
    return ResultsSummary(str(path), dict(ds.attrs), int(ds.sizes["target"]), sweep_dim(ds), summarize(ds, metrics),
                          contexts)
