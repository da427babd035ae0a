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
import warnings

import numpy as np
import torch
from scipy.stats import spearmanr
from statsmodels.stats.proportion import proportion_confint

from truncsens.policies.poisson_design import certificate_radius
from truncsens.certificates.estimator import eb_sum_radius
from truncsens.stats import cluster_mean_se, percentile_interval, resample_weights

RELIABILITY_DELTAS = (0.2, 0.1, 0.05, 0.01)  # nominal 80 / 90 / 95 / 99 %
TOLERANCES = (0.0, 1e-10, 1e-8, 1e-7, 1e-6)  # tau, relative to ||o^||, at which r_EB + tau ||o^|| is counted
# (besides the file's own tau): 1e-10 is the relative error of heads whose tail holds no attention mass,
# far below float32 rounding; 0 is the statistical radius alone


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


def tolerance_curve(error: np.ndarray, radius_eb: np.ndarray, o_hat_norm: np.ndarray, taus, level: float = 0.95) -> list[dict]:
    """Coverage of ``r_EB + τ·‖ô‖`` for each tolerance τ (:func:`coverage`, every record counted, no
    floor): how much of the emitted certificate's coverage the tolerance term supplies. τ = 0 is the
    statistical radius alone.

    Args:
        error, radius_eb: same-shape arrays [n_targets, ...], values' units (NaN radii left out).
        o_hat_norm: ``‖ô‖``, broadcastable to them, the same units.
        taus: tolerances relative to ``‖ô‖``, each >= 0 (sorted, duplicates dropped).
        level: confidence level of the Wilson intervals.

    Returns:
        [{"tau": float, "coverage": coverage dict}] in increasing τ.

    Raises:
        ValueError: a negative or NaN tolerance (named ``taus``).
    """
    taus = sorted({float(t) for t in taus})
    if any(not t >= 0 for t in taus):
        raise ValueError(f"taus: every tolerance must be >= 0, got {taus}")
    e, r = np.asarray(error, float), np.asarray(radius_eb, float)
    norm = np.broadcast_to(np.asarray(o_hat_norm, float), e.shape)
    return [{"tau": t, "coverage": coverage(e, r + t * norm, level)} for t in taus]


def reliability(records: dict[str, np.ndarray], deltas=RELIABILITY_DELTAS, taus=None, by_layer: bool = False) -> list[dict]:
    """Calibration: coverage of the emitted certificate, of its statistical part alone and of the
    normal radius against nominal 1 − δ, for several δ, over every record with a random tail, and the
    certificate's tightness (:func:`tightness`). Radii at another δ are recomputed from the stored
    V̂, B̂ and n (:func:`radii_at`); the certificate at δ is ``r_EB(δ) + b·‖ô‖``.

    Args:
        records: attn_error, attn_variance, value_range, n_random, has_tail and arith_bound (b·‖ô‖,
            :func:`truncsens.certificates.arithmetic.certificate_records`), arrays of one shape; with
            ``taus`` also o_hat_norm (``‖ô‖``).
        deltas: miss probabilities, each in (0, 1).
        taus: tolerances relative to ``‖ô‖`` (:func:`tolerance_curve`), or None for no curve.
        by_layer: records are [target, layer, head]: add the coverage of r_EB and of the certificate per layer.

    Returns:
        per δ: {"delta", "nominal", "certificate", "certificate_above_floor", "eb", "normal"} (each a
        :func:`coverage` dict, Wilson intervals at 95 %; records at the floor counted, ``floor`` =
        arith_bound, except in "certificate_above_floor", which leaves them out: there the
        statistical part decides) and "tightness" of the certificate; with ``taus``
        "tolerance_curve" (:func:`tolerance_curve` at that δ); with ``by_layer`` "eb_by_layer" and
        "certificate_by_layer" (lists of coverage dicts, one per layer).

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
        row = {"delta": d, "nominal": 1 - d, "certificate": coverage(e, cert, floor=f, statistical=eb[tail]),
               "certificate_above_floor": coverage(e, cert, floor=f, leave_out_floor=True),
               "eb": coverage(e, eb[tail], floor=f), "normal": coverage(e, normal[tail], floor=f),
               "tightness": tightness(cert, e)}
        if taus is not None:
            norm = np.broadcast_to(records["o_hat_norm"], tail.shape)[tail]
            row["tolerance_curve"] = tolerance_curve(e, eb[tail], norm, taus)
        if by_layer:
            err, fl = records["attn_error"], np.broadcast_to(records["arith_bound"], tail.shape)
            eb_t = np.where(tail, eb, np.nan)
            row["eb_by_layer"] = [coverage(err[:, l], eb_t[:, l], floor=fl[:, l]) for l in range(tail.shape[1])]
            row["certificate_by_layer"] = [coverage(err[:, l], eb_t[:, l] + fl[:, l], floor=fl[:, l])
                                           for l in range(tail.shape[1])]
        out.append(row)
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


FEW_TAIL_KEYS = 5  # a kept tail of fewer random keys than this: V̂ and B̂ rest on a handful of terms
NEGLIGIBLE_TAIL_MASS = 1e-7  # below float32 eps (1.19e-7): a tail that cannot move a float32 output


def coverage_by_tail_mass(records: dict[str, np.ndarray], radius: np.ndarray,
                          threshold: float = NEGLIGIBLE_TAIL_MASS) -> dict | None:
    """Coverage of ``radius`` and ``E[V̂]/MSE`` apart for records whose tail holds a negligible share
    of the full-cache attention (below ``threshold``) and for the others (docs/method.md: where r_EB
    under-covers).

    Args:
        records: attn_error, attn_variance, has_tail and tail_mass, arrays of one shape.
        radius: the same shape (NaN: no radius).
        threshold: the tail mass below which a tail counts as negligible, > 0.

    Returns:
        None without tail_mass; else {"threshold", "negligible": {"coverage", "variance_over_mse"},
        "with_mass": {...}} (coverage: a :func:`coverage` dict; the ratio NaN without records or MSE 0).

    Raises:
        ValueError: a threshold that is not > 0.
    """
    if not threshold > 0:
        raise ValueError(f"threshold: a tail mass > 0 is needed, got {threshold}")
    if "tail_mass" not in records:
        return None
    tail = np.asarray(records["has_tail"]) > 0
    e, v = np.asarray(records["attn_error"], float), np.asarray(records["attn_variance"], float)
    mass, r = np.asarray(records["tail_mass"], float), np.asarray(radius, float)
    out = {"threshold": threshold}
    for name, m in (("negligible", tail & (mass < threshold)), ("with_mass", tail & (mass >= threshold))):
        mse = float(np.mean(e[m] ** 2)) if m.any() else math.nan
        out[name] = {"coverage": coverage(e[m], r[m]),
                     "variance_over_mse": float(np.mean(v[m])) / mse if mse > 0 else math.nan}
    return out


def variance_check(records: dict[str, np.ndarray], few: int = FEW_TAIL_KEYS) -> dict:
    """Why r_EB under-covers where it does: per (layer, head), the variance estimate against the
    squared error it estimates, and how many records rest on a nearly empty kept tail.

    ``E[V̂]/MSE`` is ``mean(V̂) / mean(‖ô − o‖²)`` over the records with a random tail, pooled over
    targets (each target one draw; not repeated draws of one target): 1 when V̂ is unbiased for the
    mean squared error, below 1 when it understates it.

    Args:
        records: attn_error, attn_variance, n_random, has_tail, each [target, layer, head], and
            optionally tail_mass (the share of the full-cache attention on the tail keys).
        few: a kept tail with fewer random keys than this counts as "few" (>= 1).

    Returns:
        {"few_tail_keys": few, "negligible_tail_mass": :data:`NEGLIGIBLE_TAIL_MASS`, "variance_over_mse":
        float (every head), "by_head": {"variance_over_mse", "share_few_tail_keys", "mse",
        "mean_variance", "n", and with tail_mass "median_tail_mass", "share_negligible_tail_mass"}: each
        [layer][head] (NaN: no record, or MSE 0)}.

    Raises:
        ValueError: ``few`` below 1, or records that are not [target, layer, head].
    """
    if not few >= 1:
        raise ValueError(f"few: a count of kept tail keys >= 1 is needed, got {few}")
    tail = np.asarray(records["has_tail"]) > 0
    if tail.ndim != 3:
        raise ValueError(f"records must be [target, layer, head], got shape {tail.shape}")
    e2 = np.where(tail, np.asarray(records["attn_error"], float) ** 2, np.nan)
    v = np.where(tail, np.asarray(records["attn_variance"], float), np.nan)
    few_keys = np.where(tail, np.asarray(records["n_random"]) < few, np.nan)
    n = tail.sum(0)  # [L, H]

    def mean(x: np.ndarray, axis) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.nansum(x, axis=axis) / np.sum(~np.isnan(x), axis=axis)

    mse, mv = mean(e2, 0), mean(v, 0)  # [L, H]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(mse > 0, mv / np.where(mse > 0, mse, 1.0), np.nan)
        total = float(np.nanmean(v) / np.nanmean(e2)) if tail.any() and np.nanmean(e2) > 0 else math.nan
    listed = lambda a: [[float(x) for x in row] for row in a]  # noqa: E731
    by_head = {"variance_over_mse": listed(ratio), "share_few_tail_keys": listed(mean(few_keys, 0)),
               "mse": listed(mse), "mean_variance": listed(mv), "n": [[int(x) for x in row] for row in n]}
    if "tail_mass" in records:
        mass = np.where(tail, np.asarray(records["tail_mass"], float), np.nan)
        with np.errstate(invalid="ignore"):
            negligible = np.where(tail, mass < NEGLIGIBLE_TAIL_MASS, np.nan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a head with no record: its median is NaN
            by_head["median_tail_mass"] = listed(np.nanmedian(mass, 0))
        by_head["share_negligible_tail_mass"] = listed(mean(negligible, 0))
    return {"few_tail_keys": few, "negligible_tail_mass": NEGLIGIBLE_TAIL_MASS, "variance_over_mse": total,
            "by_head": by_head}
