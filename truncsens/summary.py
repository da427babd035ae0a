"""Per-window (or per-budget) summaries of a results file: mean, standard error, quantiles.

The standard error in :func:`summarize` is clustered by document (targets of one document are
dependent), the same CR1 estimator :mod:`truncsens.fitting` weights its fits with.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from truncsens.divergences import METRICS
from truncsens.results import sweep_dim

STATS = ("mean", "se", "median", "p90", "p99")


def summarize_values(values: np.ndarray) -> dict[str, float]:
    """Mean, standard error of the mean (sample std / sqrt(n)), median, 90th and 99th percentiles.

    Args:
        values: [n] finite numbers (NaNs are dropped).

    Returns:
        dict with the keys of :data:`STATS` (NaN where there are no values; se NaN for n < 2).
    """
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {k: float("nan") for k in STATS}
    se = float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")
    return {
        "mean": float(v.mean()), "se": se, "median": float(np.median(v)),
        "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99)),
    }


def summarize(ds: xr.Dataset, metrics: list[str] | None = None) -> list[dict]:
    """One row per (policy,) sweep value and metric: ``{"policy"?, sweep, "metric", "n", stats...}``.

    ``se`` is the document-clustered standard error of the mean
    (:func:`truncsens.fitting.resampled_mean_se` with every document drawn once).

    Raises:
        ValueError: an unknown metric name.
    """
    metrics = list(metrics or METRICS)
    unknown = [m for m in metrics if m not in ds.data_vars]
    if unknown:
        raise ValueError(f"unknown metric(s) {', '.join(unknown)}; the file has {', '.join(METRICS)}")
    sweep = sweep_dim(ds)
    policies = list(ds["policy"].values) if "policy" in ds.dims else [None]
    docs = [str(d) for d in ds["doc"].values]
    rows = []
    for policy in policies:
        sub = ds if policy is None else ds.sel(policy=policy)
        for metric in metrics:
            for value in ds[sweep].values:
                col = sub[metric].sel({sweep: value}).values  # [target]
                row = {"metric": metric, sweep: int(value), "n": int(np.isfinite(col.astype(float)).sum())}
                if policy is not None:
                    row["policy"] = str(policy)
                row.update(summarize_values(col))
                row["se"] = _clustered_se(col, docs)
                rows.append(row)
    return rows


def _clustered_se(values: np.ndarray, docs: list[str]) -> float:
    from truncsens.fitting import doc_sums, resampled_mean_se

    sums, counts, ids = doc_sums(np.asarray(values, dtype=np.float64)[:, None], docs)  # [G, 1] each
    _, se = resampled_mean_se(np.ones((1, len(ids))), sums, counts)  # [1, 1]
    return float(se[0, 0])


def format_table(rows: list[dict], sweep: str) -> str:
    """Rows of :func:`summarize` as a plain-text table, one block per (policy, metric)."""
    lines = []
    key = None
    for r in rows:
        k = (r.get("policy"), r["metric"])
        if k != key:
            key = k
            title = r["metric"] + (f"  (policy {r['policy']})" if r.get("policy") else "")
            lines += ["", title, f"{sweep:>8} {'n':>6} {'mean':>11} {'± se(doc)':>10} {'median':>11} {'p90':>11} {'p99':>11}"]
        lines.append(
            f"{r[sweep]:>8} {r['n']:>6} {r['mean']:>11.5g} {r['se']:>10.2g} {r['median']:>11.5g} {r['p90']:>11.5g} {r['p99']:>11.5g}")
    return "\n".join(lines).lstrip("\n")
