"""The power-law exponent of a recency policy against the span of the recent past it keeps, set beside
the exponent of a truncation (window) curve of the same targets: their **paired** difference with a
document-bootstrap interval, and a verdict (the claim of arXiv 2605.25085 that a sink-plus-recent
cache's distortion decays with the truncation curve's exponent).

A budget k of a recency policy keeps S first tokens and a recent window of ``k - S``
(:meth:`truncsens.policies.base.Policy.recent_span`); fitting D against k bends a power law at small
k, so the policy curve is refitted against its span ``s = k - S`` (:func:`span_curve`), over the
truncation fit's range of windows. When both curves measured the same targets (the caller checks the
documents and positions), both are refitted on every document resample with the same multiplicities
(:func:`truncsens.stats.resample_weights` with one seed and the same documents in the same order),
so the interval of ``alpha_policy - alpha_truncation`` is that of a paired difference: what the two
share through their documents cancels. Verdict: ``"recovered"`` when the interval contains 0, else
``"differs"``, by the difference and its share of the truncation exponent.

Pure numpy on :class:`~truncsens.fits.curves.Curve` objects; no file access.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from truncsens.fits.curves import Curve
from truncsens.fits.fitting import FitConfig, fit_curve
from truncsens.fits.laws import FitError
from truncsens.stats import interval_or_none


def span_curve(curve: Curve, first: int) -> Curve:
    """The budget curve of a recency policy against its recent span ``s = k - first`` (tokens): points,
    and the block protocol's actual budgets ``x``, shifted by ``first``; sums and documents unchanged;
    ``sweep`` is ``"span"``.

    Raises:
        FitError: a budget leaves no recent span (``k - first < 1``).
    """
    points = np.asarray(curve.points, dtype=np.int64) - int(first)
    if points.size and points.min() < 1:
        raise FitError(f"{curve.label}: budget {int(curve.points[points.argmin()])} keeps no recent span after "
                       f"{first} first tokens")
    x = None if curve.x is None else np.asarray(curve.x, dtype=np.float64) - first
    return dataclasses.replace(curve, points=points, x=x, sweep="span")


def _finite_interval(ci: list[float] | None) -> bool:
    """Whether ``ci`` is an interval with two finite ends."""
    return bool(ci) and all(c is not None and math.isfinite(c) for c in ci)


def verdict(difference: float, ci: list[float] | None) -> str | None:
    """``"recovered"`` when the interval ``ci`` of a paired difference contains 0, ``"differs"`` when it
    excludes it, None without an interval (no resamples, an unpaired difference, or a non-finite end)."""
    if not _finite_interval(ci) or not math.isfinite(difference):
        return None
    return "recovered" if ci[0] <= 0.0 <= ci[1] else "differs"


def _power(cf, metric: str) -> dict | None:
    return next((f for f in cf.fits if f["metric"] == metric and f["family"] == "power"), None)


def skipped_row(metric: str, reason: str, paired: bool, fit_range) -> dict:
    """A row of :func:`paired_exponents` for a metric without a difference, saying why."""
    return {"metric": metric, "status": "skipped", "reason": reason, "paired": paired,
            "fit_range": None if fit_range is None else list(fit_range), "alpha": None, "alpha_ci": None, "fit_points": [],
            "truncation_alpha": None, "truncation_alpha_ci": None, "truncation_fit_points": [],
            "difference": None, "difference_ci": None, "relative": None, "verdict": None}


def paired_exponents(policy: Curve, truncation: Curve, cfg: FitConfig, paired: bool) -> list[dict]:
    """Power-law exponents of a policy's span curve and a truncation curve, and their difference.

    The truncation curve is fitted as ``truncsens fit`` would (``cfg.fit_range``, or its default range
    of windows); the policy curve over the same range of spans. With ``paired``, both fits draw the same
    document resamples (``cfg.seed``) and the difference's interval is the percentile interval of the
    per-resample differences (resamples where either fit failed left out); without, the difference of
    the two point estimates has no interval and no verdict.

    Args:
        policy: a span curve (:func:`span_curve`).
        truncation: a window curve of the same model.
        cfg: metrics, ``n_boot``, ``seed``, ``level`` and ``fit_range`` (the families are ignored: power only).
        paired: the two curves measured the same targets (documents and positions).

    Returns:
        one row per metric: ``{"metric", "status" ("ok"/"skipped"), "reason", "paired", "fit_range" [lo, hi],
        "alpha", "alpha_ci", "fit_points" (spans), "truncation_alpha", "truncation_alpha_ci",
        "truncation_fit_points" (windows), "difference" (alpha - truncation_alpha), "difference_ci",
        "relative" (difference / truncation_alpha), "verdict"}`` (:func:`verdict`).

    Raises:
        ValueError: ``paired`` but the curves hold other documents (or another order).
    """
    if paired and list(policy.docs) != list(truncation.docs):
        raise ValueError(f"{policy.label} and {truncation.label} hold other documents: their exponents are not paired")
    power = dataclasses.replace(cfg, families=("power",))
    try:
        tf = fit_curve(truncation, power, seed=cfg.seed)
    except FitError as exc:
        return [skipped_row(m, f"the truncation fit failed: {exc}", paired, cfg.fit_range) for m in cfg.metrics]
    try:
        pf = fit_curve(policy, dataclasses.replace(power, fit_range=tf.fit_range), seed=cfg.seed)
    except FitError as exc:
        return [skipped_row(m, f"the span fit failed: {exc}", paired, tf.fit_range) for m in cfg.metrics]
    rows = []
    for metric in cfg.metrics:
        p, t = _power(pf, metric), _power(tf, metric)
        bad = next(((who, f) for who, f in (("span", p), ("truncation", t)) if f["status"] != "ok"), None)
        if bad is not None:
            rows.append(skipped_row(metric, f"the {bad[0]} fit is {bad[1]['status']}: {bad[1]['reason']}", paired, tf.fit_range))
            continue
        a, b = p["params"]["alpha"]["value"], t["params"]["alpha"]["value"]
        diff = a - b
        ci = None
        if paired and "bootstrap_samples" in p and "bootstrap_samples" in t:
            samples = np.asarray(p["bootstrap_samples"]["alpha"], float) - np.asarray(t["bootstrap_samples"]["alpha"], float)  # [B]
            ci = interval_or_none(samples, cfg.level)
        rows.append({"metric": metric, "status": "ok", "reason": None, "paired": paired, "fit_range": list(tf.fit_range),
                     "alpha": a, "alpha_ci": p["params"]["alpha"]["ci"], "fit_points": p["fit_points"],
                     "truncation_alpha": b, "truncation_alpha_ci": t["params"]["alpha"]["ci"],
                     "truncation_fit_points": t["fit_points"], "difference": diff, "difference_ci": ci,
                     "relative": diff / b if b else None, "verdict": verdict(diff, ci)})
    return rows


def against_verdict(ci: list[float] | None) -> str | None:
    """``"faster"`` when the interval of ``alpha - alpha_against`` lies above 0 (the policy's D decays
    faster in k), ``"slower"`` below 0, ``"same"`` when it contains 0; None without an interval."""
    if not _finite_interval(ci):
        return None
    return "faster" if ci[0] > 0.0 else "slower" if ci[1] < 0.0 else "same"


def exponents_against(policy: Curve, against: Curve, cfg: FitConfig) -> list[dict]:
    """Power-law exponents in the budget k of two policies of the same targets and their paired
    difference: ``against`` fitted as ``truncsens fit`` would (``cfg.fit_range`` or the default
    range), ``policy`` over the same budgets, both on the same document resamples
    (:func:`paired_exponents`).

    Returns:
        one row per metric: ``{"metric", "status", "reason", "fit_range", "alpha", "alpha_ci",
        "fit_points" (budgets), "against_alpha", "against_alpha_ci", "difference" (alpha -
        against_alpha), "difference_ci", "verdict"}`` (:func:`against_verdict`).

    Raises:
        ValueError: the curves hold other documents (or another order).
    """
    rows = []
    for row in paired_exponents(policy, against, cfg, True):
        reason = row["reason"] and row["reason"].replace("span fit", "fit").replace("truncation fit", f"{against.label} fit")
        rows.append({"metric": row["metric"], "status": row["status"], "reason": reason,
                     "fit_range": row["fit_range"], "alpha": row["alpha"], "alpha_ci": row["alpha_ci"],
                     "fit_points": row["fit_points"], "against_alpha": row["truncation_alpha"],
                     "against_alpha_ci": row["truncation_alpha_ci"], "difference": row["difference"],
                     "difference_ci": row["difference_ci"], "verdict": against_verdict(row["difference_ci"])})
    return rows


def power_fit_rows(name: str, curve: Curve, cfg: FitConfig) -> list[dict]:
    """Rows of :attr:`truncsens.report.policy_comparison.PolicyComparison.fits` for one curve: its power-law
    fit per metric (skipped rows when the fit fails)."""
    try:
        cf = fit_curve(curve, cfg)
    except FitError as exc:
        return [{"policy": name, "metric": m, "status": "skipped", "reason": str(exc), "alpha": None, "alpha_ci": None,
                 "C": None, "C_ci": None, "sweep": curve.sweep, "fit_points": []} for m in cfg.metrics]
    rows = []
    for f in cf.fits:
        ok = f["status"] == "ok"
        p = f["params"]
        rows.append({"policy": name, "metric": f["metric"], "status": f["status"], "reason": f["reason"],
                     "alpha": p["alpha"]["value"] if ok else None, "alpha_ci": p["alpha"]["ci"] if ok else None,
                     "C": p["C"]["value"] if ok else None, "C_ci": p["C"]["ci"] if ok else None,
                     "sweep": curve.sweep, "fit_points": f["fit_points"]})
    return rows
