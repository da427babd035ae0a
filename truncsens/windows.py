"""Window budgets w(eps): the suffix window that keeps distortion under eps, and KV-cache bytes (pure math).

With a fitted power law D(w) = C w^-alpha (arXiv 2605.25085: sliding windows reach distortion eps
with w = Theta(eps^(-1/alpha)) among suffix-only policies) the window is::

    w(eps) = (C / eps)^(1 / alpha)

Beside it: the smallest measured window whose mean D is <= eps, and the log-log interpolated
crossing between that window and the one before it.

KV memory per sequence (keys and values, all layers)::

    bytes = 2 * layers * kv_heads * head_dim * bytes_per_element * (w + n_sink)

(For a retention budget sweep the budget k already counts its sinks: bytes use k alone.)
No file or model access here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

BOUNDED_METRICS = {"tv": 1.0, "js": math.log(2.0)}


def check_eps(eps: float, metric: str = "tv") -> float:
    """Validate a distortion target.

    Raises:
        ValueError: eps not finite, eps <= 0, or above the metric's maximum (1 for tv, log 2 for js).
    """
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"--eps must be a number, got {eps!r}") from None
    if not math.isfinite(eps):
        raise ValueError(f"--eps must be finite, got {eps}")
    if eps <= 0:
        raise ValueError(f"--eps must be > 0 (a distortion target), got {eps}")
    top = BOUNDED_METRICS.get(metric)
    if top is not None and eps > top:
        raise ValueError(f"--eps for {metric} must lie in (0, {top:.6g}] since {metric} never exceeds {top:.6g}; got {eps}")
    return eps


def window_for_eps(C: float, alpha: float, eps: float) -> float:
    """w(eps) = (C / eps)^(1/alpha) in tokens (real-valued; arXiv 2605.25085).

    Raises:
        ValueError: alpha <= 0 or not finite (the law does not decrease), C <= 0, or eps <= 0.
    """
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"the fitted law is not decreasing (alpha = {alpha:.4g} <= 0): no window reaches the target; "
                         "check the fit range and the curve")
    if not (math.isfinite(C) and C > 0):
        raise ValueError(f"the fitted scale C = {C} is not positive")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be > 0 and finite, got {eps}")
    return (C / eps) ** (1.0 / alpha)


def window_samples(C: np.ndarray, alpha: np.ndarray, eps: float) -> np.ndarray:
    """w(eps) for bootstrap samples [B]; +inf where alpha <= 0 (never reached), NaN where undefined."""
    C = np.asarray(C, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    ok = np.isfinite(C) & (C > 0) & np.isfinite(alpha)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        w = np.where(alpha > 0, (C / eps) ** (1.0 / np.where(alpha > 0, alpha, 1.0)), np.inf)
    return np.where(ok, w, np.nan)


def measured_window(windows: Sequence[int], means: Sequence[float], eps: float) -> tuple[int | None, float | None]:
    """The smallest measured window whose mean is <= eps, and the crossing interpolated in log-log.

    Args:
        windows: [S] windows (any order); means: [S] mean D (zero / non-finite entries are skipped).

    Returns:
        (window or None if no window reaches eps, crossing or None). The crossing interpolates
        log w linearly in log D between the window found and the previous measured one; it is None
        when the smallest window already reaches eps (eps above the measured range).
    """
    w = np.asarray(windows, dtype=np.float64)
    m = np.asarray(means, dtype=np.float64)
    keep = np.isfinite(m) & (m > 0)
    order = np.argsort(w[keep])
    w, m = w[keep][order], m[keep][order]
    hit = np.nonzero(m <= eps)[0]
    if hit.size == 0:
        return None, None
    i = int(hit[0])
    if i == 0:
        return int(w[0]), None
    lw0, lw1, lm0, lm1 = math.log(w[i - 1]), math.log(w[i]), math.log(m[i - 1]), math.log(m[i])
    t = (math.log(eps) - lm0) / (lm1 - lm0) if lm1 != lm0 else 1.0
    return int(w[i]), float(math.exp(lw0 + t * (lw1 - lw0)))


def kv_bytes_per_sequence(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int, window: int, sinks: int = 0) -> int:
    """KV-cache bytes of one sequence: 2 (K and V) * layers * kv_heads * head_dim * bytes * (w + sinks).

    Raises:
        ValueError: a negative or zero size.
    """
    if min(layers, kv_heads, head_dim, bytes_per_element) <= 0 or window < 0 or sinks < 0:
        raise ValueError("KV sizes must be positive and window/sinks non-negative")
    return 2 * layers * kv_heads * head_dim * bytes_per_element * (int(window) + int(sinks))
