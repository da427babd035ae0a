"""Window recommendations w(eps) from a fit file: inside the measured range the measured crossing
(with its interval), outside it the power law's extrapolation (with its interval), the KV memory
the recommended window implies, and the warnings that go with them.

Per curve, metric and eps (windows in tokens):

1. **measured**: the smallest measured window whose mean D is <= eps, and the log-log crossing
   between it and the previous window (:func:`truncsens.budget.windows.measured_window`). When eps lies
   inside the measured range (a crossing exists, or the curve reaches exactly 0), the
   recommendation is ``ceil(crossing)`` (or the window where D reaches 0) and its interval is the
   percentile interval (Efron & Tibshirani 1993, ch. 13) of the crossing over the document
   bootstrap of the mean curve (``bootstrap_mean`` of the fit file, the resamples of the fit;
   :func:`truncsens.budget.windows.measured_crossings`).
2. **law**: outside the measured range, w(eps) = (C/eps)^(1/alpha) of the fitted power law
   (arXiv 2605.25085), interval over ``(C_b / eps)^(1/alpha_b)`` of the bootstrap resamples (the
   dependence between C and alpha is kept; resamples whose law does not decrease give +inf). A
   law whose optimizer did not converge, or that was not fitted, is never used; a law that does
   not decrease, or whose w(eps) overflows, says "eps not reachable with this law" (w = inf).

A window (+ sinks) beyond the reference context N (the model's context where N is unknown) is no
recommendation: ``within_context`` is False and the table says ``> N = ...`` with the law's value
beside it (:func:`truncsens.report.printed.format_recommendations`).

Warnings: w(eps) (law or measured) reaching the reference context N (D(w) is measured against a
reference of N tokens: a window >= N is not a measurement; left out when N is the model's whole
context and the window exceeds it, which the next warning says), the model's context, extrapolation
beyond the measured windows, eps at or below the float32 noise floor (docs/precision.md), and a
power law that extrapolates worse than the exponential one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from truncsens.fits.points import noise_floor
from truncsens.fits.fit_file import is_fit_file, read_fit_file, sanitize
from truncsens.fits.fitting import FitConfig, fit_datasets
from truncsens.budget.kv_spec import KVSpec, kv_spec_for_model, kv_spec_from_config
from truncsens.fits.laws import FitError
from truncsens.metrics import find
from truncsens.results import load
from truncsens.stats import percentile_interval
from truncsens.budget.windows import (
    check_eps, format_tokens, measured_crossings, measured_window, window_for_eps, window_samples)

LAW_STATUS = ("ok", "not_reachable", "not_converged", "not_fitted")


@dataclass
class Recommendation:
    """One w(eps) recommendation (windows in tokens; intervals of level ``level``).

    Attributes:
        C, alpha: the power law's parameters (None when no usable law).
        w_law: the law's w(eps): +inf when eps is not reachable with this law, NaN without a usable law.
        w_law_ci: its bootstrap interval, or None.
        law_status: one of :data:`LAW_STATUS` ("not_reachable": alpha <= 0 or w(eps) overflows).
        law_reason: why the law is not used (None when ``law_status`` is "ok").
        window: the recommended window: ``ceil`` of the measured crossing ("measured") or of the
            law's w(eps) ("law"); None when nothing reaches eps ("none", or a law that cannot).
        window_ci: (lo, hi) integer interval of ``window`` (hi may be +inf), or None.
        basis: "measured", "law" or "none".
        measured_window: smallest measured window with mean <= eps; measured_crossing: the
            log-log crossing (None at the first window or at a window of mean 0);
            measured_crossing_ci: its bootstrap interval.
        eps_in_measured_range: whether the measurement answers (crossing found, or D reaches 0).
        n_sink: sinks kept besides the window (0 for a budget sweep, whose k counts them).
        context_limit: the most tokens a window and its sinks may span and still be measured: the
            reference context N (the model's context where N is unknown), or None when neither is known.
        within_context: whether ``window`` (+ ``n_sink``) <= ``context_limit``: only then is the window a
            recommendation; False for a window beyond it (the law's extrapolation, no measurement
            supports it) and where no window reaches eps.
        kv_bytes, kv_bytes_ci: KV-cache bytes of ``window`` and of its interval ends.
    """

    label: str
    results_file: str
    metric: str
    eps: float
    C: float | None
    alpha: float | None
    w_law: float
    w_law_ci: tuple[float, float] | None
    law_status: str
    law_reason: str | None
    window: int | None
    window_ci: tuple[float, float] | None
    basis: str
    measured_window: int | None
    measured_crossing: float | None
    measured_crossing_ci: tuple[float, float] | None
    eps_in_measured_range: bool
    n_sink: int
    context_limit: int | None = None
    within_context: bool = True
    kv_bytes: int | None = None
    kv_bytes_ci: tuple[int | None, int | None] | None = None
    level: float = 0.95
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The recommendation as a JSON-safe dict (its fields; non-finite numbers become null, so a
        w_law of +inf is null with ``law_status`` "not_reachable"; whole numbers beyond 2^53, e.g. the
        window of a law extrapolated to eps = 1e-30, become floats, which JSON readers hold exactly
        enough)."""
        return sanitize(_json_sized(dict(self.__dict__)))


def _json_sized(value):
    """``value`` with every int beyond 2^53 as a float (JSON readers hold numbers as doubles)."""
    if isinstance(value, dict):
        return {k: _json_sized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_json_sized(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        return float(value)
    return value


def _int_or_none(x: float) -> int | None:
    return int(math.ceil(x)) if math.isfinite(x) else None


def _floats(values: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _ceil_interval(ci: tuple[float, float] | None) -> tuple[float, float] | None:
    if ci is None or any(math.isnan(c) for c in ci):
        return None
    return tuple(float(math.ceil(c)) if math.isfinite(c) else c for c in ci)


def recommend(fit_doc: dict, eps_values: Sequence[float], metric: str = "tv", level: float = 0.95,
              kv_lookup: Callable[[str, str], tuple[KVSpec | None, str]] = kv_spec_for_model) -> list[Recommendation]:
    """w(eps) for every curve of a fit file dict and every eps (rules in the module docstring).

    Args:
        fit_doc: a fit file dict (:func:`truncsens.fits.fit_file.read_fit_file` or ``FitReport.to_json()``).
        eps_values: distortion targets in the metric's units.
        metric: which metric's curve and power law to use.
        level: level of the percentile intervals.
        kv_lookup: (model, dtype) -> (KV spec or None, note); default reads the model's config (a curve
            whose provenance holds ``model_config``, a model measured in memory, is read from it instead).

    Returns:
        one :class:`Recommendation` per (curve, eps).

    Raises:
        ValueError: bad eps (:func:`truncsens.budget.windows.check_eps`).
        FitError: the fit file has no power law entry for ``metric``, or it fits per-layer curves (a
            window for one layer alone is not a cache budget: ``truncsens plan`` allocates per layer).
    """
    per_layer = [c.get("label", str(i)) for i, c in enumerate(fit_doc["curves"]) if "per_layer" in c.get("provenance", {})]
    if per_layer:
        raise FitError(f"curve {per_layer[0]} is a per-layer sweep (one layer windowed, the others full): its window is "
                       "not a cache budget for the model; use truncsens plan for per-layer windows at a KV budget")
    eps_values = [check_eps(e, metric) for e in eps_values]
    if not eps_values:
        raise ValueError("give at least one eps (--eps)")
    fits = [f for f in fit_doc["fits"] if f["metric"] == metric and f["family"] == "power"]
    if not fits:
        have = sorted({f["metric"] for f in fit_doc["fits"]})
        fix = (f"refit with --metric {metric}" if find(metric) is not None else
               f"{metric!r} is no metric truncsens measures; use one of those")
        raise FitError(f"the fit has no power law for metric {metric!r} (it has: {', '.join(have) or 'none'}); {fix}")
    out = []
    for f in fits:
        out.extend(_recommend_curve(fit_doc, f, eps_values, metric, level, kv_lookup))
    return out


def _law(f: dict) -> tuple[float, float, str, str | None]:
    """(C, alpha, law status, reason) of a power-law fit entry (fit files before convergence flags count as converged)."""
    if f["status"] == "not_converged" or f.get("converged") is False:
        return math.nan, math.nan, "not_converged", f"the power-law fit did not converge ({f.get('optimizer') or f['reason']}): not used"
    if f["status"] != "ok":
        return math.nan, math.nan, "not_fitted", f"no power law was fitted ({f['reason']})"
    C, alpha = (math.nan if v is None else float(v) for v in (f["params"]["C"]["value"], f["params"]["alpha"]["value"]))
    if not (math.isfinite(alpha) and alpha > 0):
        return C, alpha, "not_reachable", f"the fitted law does not decrease (alpha = {alpha:.4g}): eps not reachable with this law"
    return C, alpha, "ok", None


def _recommend_curve(fit_doc: dict, f: dict, eps_values: list[float], metric: str, level: float,
                     kv_lookup: Callable[[str, str], tuple[KVSpec | None, str]]) -> list[Recommendation]:
    curve = fit_doc["curves"][f["curve"]]
    C, alpha, status0, reason0 = _law(f)
    samples = f.get("bootstrap_samples") if status0 == "ok" else None
    prov = curve.get("provenance", {})
    # a window w keeps n_sink sinks besides; a retention budget k already counts them
    sinks = 0 if curve.get("sweep") == "budget" else int(prov.get("n_sink", 0) or 0)
    measured = curve["metrics"][metric]
    points = [int(p) for p in measured["points"]]
    means = _floats(measured["mean"])
    boot_means = measured.get("bootstrap_mean")
    boot_means = None if not boot_means else np.array([_floats(row) for row in boot_means])  # [B, S]
    finite_w = [w for w, m in zip(points, means) if np.isfinite(m)]
    positive = means[np.isfinite(means) & (means > 0)]
    n_ref = int(curve.get("reference_context", 0) or 0)
    context = int(prov.get("max_context", 0) or 0)
    stored = prov.get("model_config")  # a model passed in memory: its config is in the results file
    kv, kv_note = (kv_spec_from_config(stored, str(prov.get("dtype", "")), "the results file's model_config")
                   if isinstance(stored, dict) else kv_lookup(str(prov.get("model", "")), str(prov.get("dtype", ""))))
    comparison = next((c for c in fit_doc.get("comparisons", []) if c["curve"] == f["curve"] and c["metric"] == metric), None)
    floor = noise_floor(metric)
    out = []
    for eps in eps_values:
        status, reason = status0, reason0
        w_law, ci = math.nan, None
        if status == "ok":
            w_law = window_for_eps(C, alpha, eps)
            if math.isinf(w_law):
                status, reason = "not_reachable", (f"w(eps) = (C/eps)^(1/alpha) overflows (C = {C:.4g}, alpha = {alpha:.4g}): "
                                                   "eps not reachable with this law")
            if samples:
                ci = percentile_interval(window_samples(_floats(samples["C"]), _floats(samples["alpha"]), eps), level, keep_inf=True)
        elif status == "not_reachable":
            w_law = math.inf
        mw, cross = measured_window(points, means, eps)
        zero_hit = mw is not None and means[points.index(mw)] <= 0
        in_range = mw is not None and (cross is not None or zero_hit)
        cross_ci = None
        if in_range and boot_means is not None:
            cross_ci = percentile_interval(measured_crossings(points, boot_means, eps), level, keep_inf=True)
        if in_range or (mw is not None and status != "ok"):
            basis, window = "measured", (int(math.ceil(cross)) if cross is not None else mw)
            window_ci = _ceil_interval(cross_ci)
        elif status == "ok":
            basis, window, window_ci = "law", int(math.ceil(w_law)), _ceil_interval(ci)
        else:
            basis, window, window_ci = ("law" if status == "not_reachable" else "none"), None, None
        limit = n_ref or context or None
        rec = Recommendation(f["label"], f["results_file"], metric, eps, None if math.isnan(C) else C,
                             None if math.isnan(alpha) else alpha, w_law, ci, status, reason, window, window_ci, basis,
                             mw, cross, cross_ci, in_range, sinks, limit,
                             window is not None and (limit is None or window + sinks <= limit), level=level)
        _warn(rec, finite_w, positive, n_ref, context, sinks, floor, comparison)
        if kv is not None and window is not None:
            rec.kv_bytes = kv.bytes_for(window, sinks)
            if window_ci is not None:
                rec.kv_bytes_ci = tuple(None if _int_or_none(x) is None else kv.bytes_for(_int_or_none(x), sinks) for x in window_ci)
        rec.notes.append(kv_note)
        out.append(rec)
    return out


def _warn(rec: Recommendation, finite_w: list[int], positive: np.ndarray, n_ref: int, context: int, sinks: int,
          floor: float, comparison: dict | None) -> None:
    """Fill ``rec.warnings`` and ``rec.notes`` (see the module docstring)."""
    w, window = rec.w_law, rec.window
    if rec.basis == "measured":
        what = "D reaches 0 at" if rec.measured_crossing is None and rec.eps_in_measured_range else "measured crossing"
        rec.notes.append(f"recommended from the measurement ({what} {rec.measured_crossing if rec.measured_crossing is not None else rec.measured_window:.4g})"
                         + (f"; the power law's w(eps) = {w:.4g} is used only outside the measured range" if math.isfinite(w) else ""))
        if not rec.eps_in_measured_range:
            rec.warnings.append(f"eps is reached already at the smallest measured window ({rec.measured_window}) and "
                                f"{rec.law_reason}: the window is an upper bound")
    if rec.law_status != "ok" and rec.basis != "measured":
        rec.warnings.append(f"no measured window reaches eps and {rec.law_reason}")
    elif rec.law_status != "ok":
        rec.notes.append(rec.law_reason)
    if rec.basis == "law" and window is not None and finite_w:
        if w > max(finite_w):
            rec.warnings.append(f"w(eps) = {w:.4g} lies beyond the largest measured window ({max(finite_w)}): "
                                "this is an extrapolation of the law, not a measurement")
        if w < min(finite_w):
            rec.warnings.append(f"w(eps) = {w:.4g} lies below the smallest measured window ({min(finite_w)}): "
                                "an extrapolation of the law")
    beyond_context = bool(context and window is not None and window + sinks > context)
    for name, value in (("the law's w(eps)", w), ("the recommended window", window)):
        if n_ref and value is not None and math.isfinite(value) and value + sinks >= n_ref and (name != "the recommended window" or rec.basis != "law"):
            if beyond_context and n_ref >= context and value + sinks > context:
                continue  # N is the model's whole context: the warning below says more
            rec.warnings.append(f"{name} = {value:.4g} (+{sinks} sinks) reaches the reference context N = {n_ref}: D(w) is "
                                "measured against a reference of N tokens, so no measurement supports a window that long")
    if beyond_context:
        rec.warnings.append(f"w(eps) = {format_tokens(window).replace(',', '')} (+{sinks} sinks) exceeds the model's context of {context} tokens: "
                            "eps is not reachable with this model's context")
    if rec.eps <= floor:
        rec.warnings.append(f"eps = {rec.eps:g} is at or below the float32 noise floor of {rec.metric} ({floor:g}, "
                            "docs/precision.md): no measurement can resolve it")
    if not rec.eps_in_measured_range and positive.size:
        rec.notes.append(f"eps is outside the measured range of mean {rec.metric} [{positive.min():.3g}, {positive.max():.3g}]")
    if (rec.basis == "law" and comparison and comparison.get("basis") == "extrapolation"
            and comparison.get("winner") == "exponential" and not comparison.get("undecided")):
        rec.warnings.append("the exponential law extrapolates this curve better than the power law; "
                            "w(eps) from the power law may be off")


def load_or_fit(path: str | Path, metrics: Sequence[str], cfg: FitConfig | None = None,
                on_stage: Callable[[str, int, int], None] | None = None) -> dict:
    """A fit file dict from a fit JSON, or from a results file fitted on the fly (``cfg`` with ``metrics``;
    ``on_stage``: progress of the fit, as :func:`truncsens.fits.fitting.fit_datasets`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: neither a fit file nor a results file; fitting failed.
    """
    if is_fit_file(path):
        return read_fit_file(path)
    cfg = cfg or FitConfig()
    cfg = FitConfig(metrics=tuple(metrics), families=cfg.families, fit_range=cfg.fit_range,
                    holdout_range=cfg.holdout_range, n_boot=cfg.n_boot, seed=cfg.seed, level=cfg.level)
    return fit_datasets([load(path)], cfg, [path], on_stage=on_stage).to_json()


def recommend_windows(source: str | Path, eps_values: Sequence[float], metrics: Sequence[str] = ("tv",),
                      cfg: FitConfig | None = None, level: float = 0.95,
                      on_stage: Callable[[str, int, int], None] | None = None) -> list[Recommendation]:
    """``recommend-window``: check every eps, read the fit file (or fit the results file with ``cfg``,
    ``on_stage`` its progress), and recommend w(eps) for each metric and eps (:func:`recommend`,
    intervals of level ``level``).

    Raises:
        ValueError: a bad eps (before any fitting), or as :func:`load_or_fit` and :func:`recommend`.
    """
    metrics = list(metrics)
    for m in metrics:  # before fitting a results file (up to a thousand bootstrap refits)
        for e in eps_values:
            check_eps(e, m)
    doc = load_or_fit(source, metrics, cfg, on_stage)
    return [r for m in metrics for r in recommend(doc, eps_values, m, level)]
