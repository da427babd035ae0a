"""Statistics of a certify results file: coverage with binomial intervals, Spearman correlation of
certificate and true error with a document bootstrap, relative errors, output KL per policy.
Pure numpy/scipy/statsmodels on arrays read from the results Dataset.

Coverage counts (target, layer, head) records of poisson whose design had random keys: covered
when ``‖ô − o‖ <= r`` (an infinite radius covers, and is counted). Its interval is the Wilson score
interval (statsmodels ``proportion_confint``), which treats records as independent; records of one
target share its draw, so the document bootstrap of the Spearman correlation is the more honest
interval of the two.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.stats import spearmanr
from statsmodels.stats.proportion import proportion_confint

from truncsens.policies.poisson_design import certificate_radius
from truncsens.certificates.estimator import eb_sum_radius
from truncsens.stats import cluster_mean_se, percentile_interval, resample_weights

RELIABILITY_DELTAS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)


def coverage(error: np.ndarray, radius: np.ndarray, level: float = 0.95) -> dict:
    """Share of records with ``error <= radius`` and its Wilson interval.

    Args:
        error, radius: same-shape arrays (NaN radii are left out).

    Returns:
        dict with covered, n, rate, ci [lo, hi], n_infinite_radius.
    """
    e, r = np.asarray(error, float).ravel(), np.asarray(radius, float).ravel()
    ok = ~np.isnan(r) & ~np.isnan(e)
    e, r = e[ok], r[ok]
    n, covered = int(e.size), int((e <= r).sum())
    lo, hi = proportion_confint(covered, n, alpha=1 - level, method="wilson") if n else (math.nan, math.nan)
    return {"covered": covered, "n": n, "rate": covered / n if n else math.nan, "ci": [float(lo), float(hi)],
            "n_infinite_radius": int(np.isinf(r).sum())}


def spearman_by_documents(x: np.ndarray, y: np.ndarray, doc: np.ndarray, n_boot: int = 200, seed: int = 0,
                          level: float = 0.95) -> dict:
    """Spearman correlation of x and y (records [target, ...]) with a percentile bootstrap over documents.

    Args:
        x, y: [n_targets, ...] arrays (records of a target go together); non-finite pairs are left out.
        doc: [n_targets] document id of each target.

    Returns:
        dict with rho, ci [lo, hi] (NaN when fewer than 3 pairs or one document), n.
    """
    x = np.asarray(x, float).reshape(len(doc), -1)
    y = np.asarray(y, float).reshape(len(doc), -1)
    docs, index = np.unique(np.asarray(doc, dtype=str), return_inverse=True)

    def rho(weights: np.ndarray) -> float:
        reps = weights[index].astype(int)  # [n_targets] how often each target is drawn
        xs, ys = np.repeat(x, reps, axis=0).ravel(), np.repeat(y, reps, axis=0).ravel()
        ok = np.isfinite(xs) & np.isfinite(ys)
        return float(spearmanr(xs[ok], ys[ok]).statistic) if ok.sum() >= 3 else math.nan

    w = resample_weights(len(docs), n_boot if len(docs) > 1 else 0, seed)  # [1 + n_boot, n_docs]
    values = np.array([rho(row) for row in w])
    ci = list(percentile_interval(values[1:], level)) if len(values) > 1 else [math.nan, math.nan]
    n = int((np.isfinite(x) & np.isfinite(y)).sum())
    return {"rho": values[0], "ci": ci, "n": n}


def radii_at(variance: np.ndarray, value_range: np.ndarray, n_random: np.ndarray, has_tail: np.ndarray,
             delta: float) -> tuple[np.ndarray, np.ndarray]:
    """(empirical-Bernstein, normal) radii of stored records at another δ (same construction)."""
    t = lambda a: torch.as_tensor(np.asarray(a, float))  # noqa: E731
    eb = eb_sum_radius(t(variance), t(value_range), t(n_random), t(has_tail) > 0, delta)
    normal = certificate_radius(t(variance), delta)
    return eb.numpy(), normal.numpy()


def reliability(records: dict[str, np.ndarray], deltas=RELIABILITY_DELTAS) -> list[dict]:
    """Coverage of both radii against nominal 1 − δ for several δ (records: attn_error, attn_variance,
    value_range, n_random, has_tail of poisson, any same shape)."""
    out = []
    tail = records["has_tail"] > 0
    for d in deltas:
        eb, normal = radii_at(records["attn_variance"], records["value_range"], records["n_random"], records["has_tail"], d)
        e = records["attn_error"][tail]
        out.append({"delta": d, "nominal": 1 - d, "eb": coverage(e, eb[tail]), "normal": coverage(e, normal[tail])})
    return out


def mean_by_documents(values: np.ndarray, doc: np.ndarray) -> dict:
    """Mean over targets with its document-clustered standard error (:func:`truncsens.stats.cluster_mean_se`);
    +inf values make the mean +inf (counted in ``n_infinite``)."""
    v = np.asarray(values, float)
    n_inf = int(np.isinf(v).sum())
    if n_inf:
        return {"mean": math.inf, "se": math.nan, "n_infinite": n_inf}
    m, se = cluster_mean_se(v[:, None], list(doc))
    return {"mean": float(m[0]), "se": float(se[0]), "n_infinite": 0}
