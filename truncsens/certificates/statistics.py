"""Statistics of a certify results file: coverage with binomial intervals, Spearman correlation of
certificate and true error with a document bootstrap, relative errors, output KL per policy.
Pure numpy/scipy/statsmodels on arrays read from the results Dataset.

Coverage counts (target, layer, head) records of poisson whose design had random keys: covered
when ``‖ô − o‖ <= r`` (an infinite radius covers, and is counted). A record whose error is at most
the run's declared numerical floor (``floor``: the attr ``error_floor_relative`` times ``‖o‖``) is
"at the floor": counted apart (``n_at_floor``) and left out of the coverage, since the run's own
arithmetic cannot tell its error from 0. Two intervals: the Wilson score interval (statsmodels
``proportion_confint``), which treats records as independent, and a percentile bootstrap over
documents (records of one target share its draws, targets of one document its text), the more
honest of the two.
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


def coverage(error: np.ndarray, radius: np.ndarray, level: float = 0.95, floor: np.ndarray | None = None,
             doc: np.ndarray | None = None, n_boot: int = 0, seed: int = 0) -> dict:
    """Share of records with ``error <= radius``, its Wilson interval and (with ``doc``) its document
    bootstrap interval; records at the floor left out and counted.

    Args:
        error, radius: same-shape arrays [n_targets, ...] (NaN radii are left out).
        floor: the same shape, the absolute numerical floor of each record, or None (no floor).
        doc: [n_targets] document ids, for the bootstrap (``n_boot`` resamples, ``seed``).

    Returns:
        dict with covered, n (records counted), rate, ci [lo, hi] (Wilson), doc_ci [lo, hi] (NaN
        without ``doc``), n_at_floor, n_infinite_radius.
    """
    e, r = np.asarray(error, float), np.asarray(radius, float)
    f = np.zeros_like(e) if floor is None else np.broadcast_to(np.asarray(floor, float), e.shape)
    valid = ~np.isnan(r) & ~np.isnan(e)
    at_floor = valid & (e <= f)
    counted = valid & ~at_floor
    hit = counted & (e <= r)
    n, covered = int(counted.sum()), int(hit.sum())
    lo, hi = proportion_confint(covered, n, alpha=1 - level, method="wilson") if n else (math.nan, math.nan)
    doc_ci = [math.nan, math.nan]
    if doc is not None and n_boot > 0 and len(doc) > 1:
        docs, index = np.unique(np.asarray(doc, dtype=str), return_inverse=True)
        per_target_hit = hit.reshape(len(doc), -1).sum(1)  # [n_targets]
        per_target_n = counted.reshape(len(doc), -1).sum(1)
        hits = np.bincount(index, per_target_hit, len(docs))  # [n_docs]
        ns = np.bincount(index, per_target_n, len(docs))
        w = resample_weights(len(docs), n_boot, seed)[1:]  # [n_boot, n_docs]
        num, den = w @ hits, w @ ns
        rates = num[den > 0] / den[den > 0]
        if rates.size:
            doc_ci = [float(v) for v in percentile_interval(rates, level)]
    return {"covered": covered, "n": n, "rate": covered / n if n else math.nan, "ci": [float(lo), float(hi)],
            "doc_ci": doc_ci, "n_at_floor": int(at_floor.sum()), "n_infinite_radius": int(np.isinf(r[counted]).sum())}


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


def reliability(records: dict[str, np.ndarray], deltas=RELIABILITY_DELTAS, floor: np.ndarray | None = None) -> list[dict]:
    """Coverage of both radii against nominal 1 − δ for several δ (records: attn_error, attn_variance,
    value_range, n_random, has_tail of poisson, any same shape; ``floor`` as in :func:`coverage`)."""
    out = []
    tail = records["has_tail"] > 0
    f = None if floor is None else np.broadcast_to(floor, tail.shape)[tail]
    for d in deltas:
        eb, normal = radii_at(records["attn_variance"], records["value_range"], records["n_random"], records["has_tail"], d)
        e = records["attn_error"][tail]
        out.append({"delta": d, "nominal": 1 - d, "eb": coverage(e, eb[tail], floor=f),
                    "normal": coverage(e, normal[tail], floor=f)})
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
