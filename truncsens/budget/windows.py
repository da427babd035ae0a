"""Window budgets w(eps): the suffix window that keeps distortion under eps, and KV-cache bytes (pure math).

With a fitted power law D(w) = C w^-alpha (arXiv 2605.25085: sliding windows reach distortion eps
with w = Theta(eps^(-1/alpha)) among suffix-only policies) the window is::

    w(eps) = (C / eps)^(1 / alpha)

computed in log space, so a law that barely decays (alpha -> 0) gives w = +inf ("eps not
reachable with this law") instead of an overflow. Beside it: the smallest measured window whose
mean D is <= eps (a mean of exactly 0 reaches every eps), and the log-log interpolated crossing
between that window and the one before it, also per bootstrap resample of the mean curve
(:func:`measured_crossings`).

KV memory per sequence (keys and values), each layer caching its own number of tokens::

    bytes = 2 * kv_heads * head_dim * bytes_per_element * sum_layers cached_l
    cached_l = w + n_sink                  (full-attention layer)
    cached_l = min(w + n_sink, W_l)        (sliding-window layer of window W_l)

(For a retention budget sweep the budget k already counts its sinks: bytes use k alone.)
No file or model access here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from truncsens import metrics as _metrics


def check_eps(eps: float, metric: str = "tv") -> float:
    """Validate a distortion target.

    Raises:
        ValueError: eps not finite, eps <= 0, above the maximum of a divergence bounded above
            (:func:`truncsens.metrics.bounded_divergences`: 1 for tv, log 2 for js), or a metric that is
            no divergence (``top1_agree``, ``nll_ref``, ``nll_kept``: none falls to eps as w grows).
    """
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps (--eps) must be a number, got {eps!r}") from None
    if not math.isfinite(eps):
        raise ValueError(f"eps (--eps) must be finite, got {eps}")
    if eps <= 0:
        raise ValueError(f"eps (--eps) must be > 0 (a distortion target), got {eps}")
    record = _metrics.find(metric)
    if record is not None and not record.divergence:  # w(eps) is where D(w) falls to eps: D must decay to 0
        raise ValueError(f"metric {metric} (--metric) is not a divergence between the full and the kept distribution "
                         f"({record.description}), so no window makes it fall to eps; use one of "
                         f"{', '.join(_metrics.divergences_in(_metrics.NAMES))}")
    top = _metrics.bounded_divergences().get(metric)
    if top is not None and eps > top:
        raise ValueError(f"eps (--eps) for {metric} must lie in (0, {top:.6g}] since {metric} never exceeds {top:.6g}; got {eps}")
    return eps


EXACT_TOKENS_BELOW = 10**9  # token counts printed in full below this, in scientific notation from it


def format_tokens(n: float | None) -> str:
    """A token count as printed: in full with thousands separators below :data:`EXACT_TOKENS_BELOW`
    (``66,662``), else 4 significant digits (``5.566e+70``: a 71-digit window is no number to read);
    ``inf`` and ``-`` (None) as they are."""
    if n is None:
        return "-"
    if not math.isfinite(n):
        return str(float(n))
    return f"{int(n):,}" if abs(n) < EXACT_TOKENS_BELOW and float(n).is_integer() else f"{float(n):.4g}"


def format_tokens_short(x: float) -> str:
    """An interval end in tokens, 3 significant digits: ``743``, ``27.9k``, ``167k``, ``4.1M``, ``2.95e+64``; inf as is."""
    if not math.isfinite(x):
        return str(float(x))
    for size, unit in ((1e9, None), (1e6, "M"), (1e4, "k")):
        if abs(x) >= size:
            return f"{x:.3g}" if unit is None else f"{x / (1e6 if unit == 'M' else 1e3):.3g}{unit}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.4g}"


def window_for_eps(C: float, alpha: float, eps: float) -> float:
    """w(eps) = (C / eps)^(1/alpha) in tokens (real-valued; arXiv 2605.25085), computed as
    ``exp(log(C / eps) / alpha)``: +inf when it exceeds the largest float (e.g. C = 0.3,
    alpha = 0.001, eps = 0.1 gives 3^1000), i.e. eps is not reachable with this law.

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
    log_w = math.log(C / eps) / alpha
    return math.inf if log_w > LOG_MAX_FLOAT else math.exp(log_w)


LOG_MAX_FLOAT = math.log(np.finfo(np.float64).max)


def window_samples(C: np.ndarray, alpha: np.ndarray, eps: float) -> np.ndarray:
    """w(eps) for bootstrap samples [B]; +inf where alpha <= 0 (never reached) or w overflows, NaN where undefined."""
    C = np.asarray(C, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    ok = np.isfinite(C) & (C > 0) & np.isfinite(alpha)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        w = np.where(alpha > 0, np.exp(np.log(C / eps) / np.where(alpha > 0, alpha, 1.0)), np.inf)
    return np.where(ok, w, np.nan)


def measured_window(windows: Sequence[int], means: Sequence[float], eps: float) -> tuple[int | None, float | None]:
    """The smallest measured window whose mean is <= eps, and the crossing interpolated in log-log.

    Args:
        windows: [S] windows (any order); means: [S] mean D. Non-finite means (+inf, NaN) never
            reach eps; a mean of exactly 0 (every target 0) reaches every eps.

    Returns:
        (window or None if no window reaches eps, crossing or None). The crossing interpolates
        log w linearly in log D between the window found and the previous measured one; it is None
        when the smallest window already reaches eps (eps above the measured range) and when the
        window found has mean 0 (no logarithm: the window itself is the answer).
    """
    w = np.asarray(windows, dtype=np.float64)
    m = np.asarray([np.nan if v is None else v for v in means], dtype=np.float64)
    order = np.argsort(w)
    w, m = w[order], m[order]
    hit = np.nonzero(np.isfinite(m) & (m <= eps))[0]
    if hit.size == 0:
        return None, None
    i = int(hit[0])
    if i == 0 or m[i] <= 0 or not (np.isfinite(m[i - 1]) and m[i - 1] > 0):
        return int(w[i]), None
    lw0, lw1, lm0, lm1 = math.log(w[i - 1]), math.log(w[i]), math.log(m[i - 1]), math.log(m[i])
    t = (math.log(eps) - lm0) / (lm1 - lm0) if lm1 != lm0 else 1.0
    return int(w[i]), float(math.exp(lw0 + t * (lw1 - lw0)))


def measured_crossings(windows: Sequence[int], means: np.ndarray, eps: float) -> np.ndarray:
    """The measured answer of :func:`measured_window` for many mean curves (bootstrap resamples).

    Args:
        windows: [S] ascending windows; means: [B, S] resampled mean curves.

    Returns:
        [B] the crossing where there is one, else the window found (the smallest window, or a
        window of mean 0); +inf where no window reaches eps.
    """
    w = np.asarray(windows, dtype=np.float64)
    m = np.asarray(means, dtype=np.float64)
    B, S = m.shape
    reach = np.isfinite(m) & (m <= eps)  # [B, S]
    any_hit = reach.any(1)
    i = np.where(any_hit, reach.argmax(1), 0)  # [B] first window reaching eps
    prev = np.maximum(i - 1, 0)
    rows = np.arange(B)
    m1, m0 = m[rows, i], m[rows, prev]
    interp = (i > 0) & (m1 > 0) & np.isfinite(m0) & (m0 > 0) & (m0 != m1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (math.log(eps) - np.log(m0)) / (np.log(m1) - np.log(m0))
        cross = np.exp(np.log(w[prev]) + t * (np.log(w[i]) - np.log(w[prev])))
    out = np.where(interp, cross, w[i])
    return np.where(any_hit, out, np.inf)


def cached_tokens_per_layer(layer_windows: Sequence[int | None], window: int, n_sink: int = 0) -> list[int]:
    """Tokens each layer keeps in its KV cache for a suffix window w with n_sink sinks: w + n_sink
    for a full-attention layer (None), min(w + n_sink, W_l) for a sliding-window layer of window W_l.

    Raises:
        ValueError: a negative window or sink count, or a layer window < 1.
    """
    if window < 0 or n_sink < 0:
        raise ValueError("window and sinks must be non-negative")
    if any(W is not None and W < 1 for W in layer_windows):
        raise ValueError(f"a sliding window must be at least 1 token, got {list(layer_windows)}")
    kept = int(window) + int(n_sink)
    return [kept if W is None else min(kept, int(W)) for W in layer_windows]


def kv_bytes_per_sequence(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int, window: int, sinks: int = 0,
                          layer_windows: Sequence[int | None] | None = None) -> int:
    """KV-cache bytes of one sequence: 2 (K and V) * kv_heads * head_dim * bytes * sum over layers of
    the tokens each layer caches (:func:`cached_tokens_per_layer`; all layers full attention when
    ``layer_windows`` is None: 2 * layers * kv_heads * head_dim * bytes * (w + sinks)).

    Raises:
        ValueError: a negative or zero size, or ``layer_windows`` of another length than ``layers``.
    """
    if min(layers, kv_heads, head_dim, bytes_per_element) <= 0 or window < 0 or sinks < 0:
        raise ValueError("KV sizes must be positive and window/sinks non-negative")
    windows = [None] * layers if layer_windows is None else list(layer_windows)
    if len(windows) != layers:
        raise ValueError(f"{len(windows)} layer windows for {layers} layers")
    return 2 * kv_heads * head_dim * bytes_per_element * sum(cached_tokens_per_layer(windows, window, sinks))
