"""Window recommendations w(eps) from a fit file: the law's window with its bootstrap interval, the
measured crossing, the KV memory it implies, and the warnings that go with them.

w(eps) and the measured crossing are :mod:`truncsens.windows`; the interval is the percentile
interval (:func:`truncsens.stats.percentile_interval`, Efron & Tibshirani 1993) of
``(C_b / eps)^(1/alpha_b)`` over the bootstrap resamples ``b`` of the fit (documents resampled), so
the dependence between C and alpha is kept; resamples whose law does not decrease give w = +inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from truncsens.fitfile import is_fit_file, read_fit_file, sanitize
from truncsens.fitting import FitConfig, fit_results
from truncsens.kv_spec import KVSpec, kv_spec_for_model
from truncsens.laws import FitError
from truncsens.stats import percentile_interval
from truncsens.windows import check_eps, measured_window, window_for_eps, window_samples


@dataclass
class Recommendation:
    """One w(eps) recommendation (all windows in tokens; intervals of level ``level``)."""

    label: str
    results_file: str
    metric: str
    eps: float
    C: float
    alpha: float
    w_law: float
    w_law_ci: tuple[float, float] | None
    window: int
    measured_window: int | None
    measured_crossing: float | None
    eps_in_measured_range: bool
    n_sink: int
    kv_bytes: int | None = None
    kv_bytes_ci: tuple[int | None, int | None] | None = None
    level: float = 0.95
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The recommendation as a JSON-safe dict (its fields; non-finite numbers become null)."""
        return sanitize(dict(self.__dict__))


def _int_or_none(x: float) -> int | None:
    return int(math.ceil(x)) if math.isfinite(x) else None


def _floats(values: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def recommend(fit_doc: dict, eps_values: Sequence[float], metric: str = "tv", level: float = 0.95,
              kv_lookup: Callable[[str, str], tuple[KVSpec | None, str]] = kv_spec_for_model) -> list[Recommendation]:
    """w(eps) for every curve of a fit file dict and every eps.

    Args:
        fit_doc: a fit file dict (:func:`truncsens.fitfile.read_fit_file` or ``FitReport.to_json()``).
        eps_values: distortion targets in the metric's units.
        metric: which metric's power law to use.
        level: level of the percentile intervals.
        kv_lookup: (model, dtype) -> (KV spec or None, note); default reads the model's config.

    Returns:
        one :class:`Recommendation` per (curve, eps).

    Raises:
        ValueError: bad eps (:func:`truncsens.windows.check_eps`), or a non-decreasing fit (alpha <= 0).
        FitError: no power fit of ``metric`` in the file, or it was skipped.
    """
    eps_values = [check_eps(e, metric) for e in eps_values]
    if not eps_values:
        raise ValueError("give at least one --eps")
    fits = [f for f in fit_doc["fits"] if f["metric"] == metric and f["family"] == "power"]
    if not fits:
        have = sorted({f["metric"] for f in fit_doc["fits"]})
        raise FitError(f"the fit has no power law for metric {metric!r} (it has: {', '.join(have) or 'none'}); "
                       f"refit with --metric {metric}")
    out = []
    for f in fits:
        if f["status"] != "ok":
            raise FitError(f"{f['label']}: the power law for {metric} was not fitted ({f['reason']})")
        out.extend(_recommend_curve(fit_doc, f, eps_values, metric, level, kv_lookup))
    return out


def _recommend_curve(fit_doc: dict, f: dict, eps_values: list[float], metric: str, level: float,
                     kv_lookup: Callable[[str, str], tuple[KVSpec | None, str]]) -> list[Recommendation]:
    curve = fit_doc["curves"][f["curve"]]
    C, alpha = (math.nan if v is None else v for v in (f["params"]["C"]["value"], f["params"]["alpha"]["value"]))
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"{f['label']}: the fitted {metric} law is not decreasing (alpha = {alpha:.4g}): "
                         "no window reaches eps; check the curve and the fit range")
    samples = f.get("bootstrap_samples")
    prov = curve.get("provenance", {})
    # a window w keeps n_sink sinks besides; a retention budget k already counts them
    sinks = 0 if curve.get("sweep") == "budget" else int(prov.get("n_sink", 0) or 0)
    measured = curve["metrics"][metric]
    valid_w = [w for w, m in zip(measured["points"], measured["mean"]) if m is not None and m > 0]
    valid_m = [m for m in measured["mean"] if m is not None and m > 0]
    context = int(prov.get("max_context", 0) or 0) or int(curve.get("reference_context", 0) or 0)
    kv, kv_note = kv_lookup(str(prov.get("model", "")), str(prov.get("dtype", "")))
    comparison = next((c for c in fit_doc.get("comparisons", []) if c["curve"] == f["curve"] and c["metric"] == metric), None)
    out = []
    for eps in eps_values:
        w = window_for_eps(C, alpha, eps)
        ci = None
        if samples:
            ci = percentile_interval(window_samples(_floats(samples["C"]), _floats(samples["alpha"]), eps), level, keep_inf=True)
        mw, cross = measured_window(measured["points"], measured["mean"], eps)
        in_range = bool(valid_m) and min(valid_m) <= eps <= max(valid_m)
        rec = Recommendation(f["label"], f["results_file"], metric, eps, C, alpha, w, ci, int(math.ceil(w)), mw, cross,
                             in_range, sinks, level=level)
        if valid_w and w > max(valid_w):
            rec.warnings.append(f"w(eps) = {w:.4g} lies beyond the largest measured window ({max(valid_w)}): "
                                "this is an extrapolation of the law, not a measurement")
        if valid_w and w < min(valid_w):
            rec.warnings.append(f"w(eps) = {w:.4g} lies below the smallest measured window ({min(valid_w)})")
        if context and w + sinks > context:
            rec.warnings.append(f"w(eps) = {w:.4g} (+{sinks} sinks) exceeds the model's context of {context} tokens: "
                                "no measurement can support it; eps is not reachable with this model's context")
        if not in_range and valid_m:
            rec.notes.append(f"eps is outside the measured range of mean {metric} [{min(valid_m):.3g}, {max(valid_m):.3g}]")
        if comparison and comparison.get("basis") == "extrapolation" and comparison.get("winner") == "exponential":
            rec.warnings.append("the exponential law extrapolates this curve better than the power law; "
                                "w(eps) from the power law may be off")
        if kv is not None:
            rec.kv_bytes = kv.bytes_for(rec.window, sinks)
            if ci is not None:
                ends = [_int_or_none(x) for x in ci]
                rec.kv_bytes_ci = tuple(None if b is None else kv.bytes_for(b, sinks) for b in ends)
        rec.notes.append(kv_note)
        out.append(rec)
    return out


def load_or_fit(path: str | Path, metrics: Sequence[str], cfg: FitConfig | None = None) -> dict:
    """A fit file dict from a fit JSON, or from a results file fitted on the fly (``cfg`` with ``metrics``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: neither a fit file nor a results file; fitting failed.
    """
    if is_fit_file(path):
        return read_fit_file(path)
    cfg = cfg or FitConfig()
    cfg = FitConfig(metrics=tuple(metrics), families=cfg.families, fit_range=cfg.fit_range,
                    holdout_range=cfg.holdout_range, n_boot=cfg.n_boot, seed=cfg.seed, level=cfg.level)
    return fit_results([str(path)], cfg).to_json()


def recommend_windows(source: str | Path, eps_values: Sequence[float], metrics: Sequence[str] = ("tv",),
                      cfg: FitConfig | None = None, level: float = 0.95) -> list[Recommendation]:
    """``recommend-window``: check every eps, read the fit file (or fit the results file with ``cfg``),
    and recommend w(eps) for each metric and eps (:func:`recommend`, intervals of level ``level``).

    Raises:
        ValueError: a bad eps (before any fitting), or as :func:`load_or_fit` and :func:`recommend`.
    """
    metrics = list(metrics)
    for m in metrics:  # before fitting a results file (up to a thousand bootstrap refits)
        for e in eps_values:
            check_eps(e, m)
    doc = load_or_fit(source, metrics, cfg)
    return [r for m in metrics for r in recommend(doc, eps_values, m, level)]
