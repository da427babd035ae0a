"""Statistics of a certify results file: coverage with binomial intervals, calibration at several
nominal levels, Spearman correlation of certificate and true error with a document bootstrap,
relative errors, output KL per policy. Pure numpy/scipy/statsmodels on arrays read from the results
Dataset.

Coverage counts every (target, layer, head) record of poisson whose design had random keys:
covered when ``‖ô − o‖ <= r`` (an infinite radius covers, and is counted; error 0 under radius 0
covers). A record whose error is at most the arithmetic bound of its computation (``floor``,
b·‖ô‖, :mod:`truncsens.certificates.arithmetic`) is "at the floor": it stays in the coverage and is
also counted apart (``n_at_floor``, and with ``statistical`` the radius the statistical part alone
gives, ``n_at_floor_missed_statistical``: those the statistical radius misses). ``leave_out_floor``
restores the earlier rule, which left such records out (the design benchmarks were written under it).
Two intervals: the Wilson score interval (statsmodels ``proportion_confint``), which treats records as
independent, and a percentile bootstrap over documents (records of one target share its draws,
targets of one document its text), the more honest of the two.
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

RELIABILITY_DELTAS = (0.2, 0.1, 0.05, 0.01)  # nominal 80 / 90 / 95 / 99 %


def coverage(error: np.ndarray, radius: np.ndarray, level: float = 0.95, floor: np.ndarray | None = None,
             doc: np.ndarray | None = None, n_boot: int = 0, seed: int = 0, statistical: np.ndarray | None = None,
             leave_out_floor: bool = False) -> dict:
    """Share of records with ``error <= radius``, its Wilson interval and (with ``doc``) its document
    bootstrap interval; records at the floor counted in it and apart (module docstring).

    Args:
        error, radius: same-shape arrays [n_targets, ...] (NaN radii or errors are left out).
        level: confidence level of both intervals.
        floor: the same shape (broadcastable), the absolute arithmetic bound of each record, or None.
        doc: [n_targets] document ids, for the bootstrap (``n_boot`` resamples, ``seed``).
        statistical: the same shape, the statistical radius alone (for ``n_at_floor_missed_statistical``).
        leave_out_floor: leave records at the floor out of the coverage (the earlier rule).

    Returns:
        dict with covered, n (records counted), rate, ci [lo, hi] (Wilson), doc_ci [lo, hi] (NaN
        without ``doc``), n_at_floor, n_at_floor_missed_statistical (None without ``statistical``),
        n_infinite_radius.
    """
    e, r = np.asarray(error, float), np.asarray(radius, float)
    f = np.zeros_like(e) if floor is None else np.broadcast_to(np.asarray(floor, float), e.shape)
    valid = ~np.isnan(r) & ~np.isnan(e)
    at_floor = valid & (e <= f)
    counted = valid & ~at_floor if leave_out_floor else valid
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
    missed = None
    if statistical is not None:
        st = np.broadcast_to(np.asarray(statistical, float), e.shape)
        missed = int((at_floor & ~(e <= st)).sum())
    return {"covered": covered, "n": n, "rate": covered / n if n else math.nan, "ci": [float(lo), float(hi)],
            "doc_ci": doc_ci, "n_at_floor": int(at_floor.sum()), "n_at_floor_missed_statistical": missed,
            "n_infinite_radius": int(np.isinf(r[counted]).sum())}


def tightness(radius: np.ndarray, error: np.ndarray) -> dict:
    """Median of ``radius / error`` over records with error > 0 and a radius (NaN radii left out;
    +inf radii count, and the median is +inf when they are at least half).

    Returns:
        {"median_ratio": float (NaN without such records), "n": records used}.
    """
    r, e = np.asarray(radius, float), np.asarray(error, float)
    ok = ~np.isnan(r) & (e > 0)
    return {"median_ratio": float(np.median(r[ok] / e[ok])) if ok.any() else math.nan, "n": int(ok.sum())}


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
    """Calibration: coverage of the emitted certificate, of its statistical part alone and of the
    normal radius against nominal 1 − δ, for several δ, over every record with a random tail, and the
    certificate's tightness (:func:`tightness`). Radii at another δ are recomputed from the stored
    V̂, B̂ and n (:func:`radii_at`); the certificate at δ is ``r_EB(δ) + b·‖ô‖``.

    Args:
        records: attn_error, attn_variance, value_range, n_random, has_tail and arith_bound (b·‖ô‖,
            :func:`truncsens.certificates.arithmetic.certificate_records`), arrays of one shape.
        deltas: miss probabilities, each in (0, 1).

    Returns:
        per δ: {"delta", "nominal", "certificate", "certificate_above_floor", "eb", "normal"} (each a
        :func:`coverage` dict, Wilson intervals at 95 %; records at the floor counted, ``floor`` =
        arith_bound, except in "certificate_above_floor", which leaves them out: there the
        statistical part decides) and "tightness" of the certificate.

    Raises:
        ValueError: a δ outside (0, 1).
    """
    out = []
    tail = records["has_tail"] > 0
    f = np.broadcast_to(records["arith_bound"], tail.shape)[tail]
    e = records["attn_error"][tail]
    for d in deltas:
        eb, normal = radii_at(records["attn_variance"], records["value_range"], records["n_random"], records["has_tail"], d)
        cert = eb[tail] + f
        out.append({"delta": d, "nominal": 1 - d, "certificate": coverage(e, cert, floor=f, statistical=eb[tail]),
                    "certificate_above_floor": coverage(e, cert, floor=f, leave_out_floor=True),
                    "eb": coverage(e, eb[tail], floor=f), "normal": coverage(e, normal[tail], floor=f),
                    "tightness": tightness(cert, e)})
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
