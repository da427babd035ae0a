"""Per-layer windows from per-layer decay laws: the allocation of ``truncsens plan``.
Pure numpy math.

Given per-layer laws ``D_l(w) = C_l · w^-α_l`` (fitted on each layer's own truncation curve, all
other layers keeping their full cache), per-token costs ``b_l`` (KV bytes of one cached token in
layer l) and a budget ``B`` (bytes per sequence), choose integer windows ``w_l`` in ``[lo, hi]`` that
minimize the predicted total distortion ``Σ_l C_l w_l^-α_l`` subject to ``Σ_l b_l w_l <= B``.
Summing per-layer distortions assumes they add up when several layers are truncated at once; the
plan measures that rather than assuming it ([ours]).

Continuous solution (Lagrangian, [ours]): the objective is convex in each w_l (C_l, α_l > 0), so the
optimum satisfies ``α_l C_l w_l^-(α_l+1) = λ b_l`` for the layers strictly inside their bounds:

    w_l(λ) = clip( (α_l C_l / (λ b_l))^(1/(α_l+1)), lo_l, hi_l ),

with λ > 0 found by bisection on ``log λ`` so that ``Σ b_l w_l(λ) = B`` (``Σ b_l w_l(λ)`` decreases in
λ). Integers: every layer is rounded down, then the bytes left over go one token at a time to the
layer with the largest predicted distortion drop per byte (greedy on the convex per-layer costs,
which is optimal for a separable convex objective with one knapsack constraint up to the last
token's bytes, [ours]).

Peer schedule: PyramidKV (Cai et al. 2024, arXiv 2406.02069) gives budgets that fall linearly with
depth, ``k_l = k_max − l·(k_max − k_min)/(L − 1)`` with ``k_min = k_total/(β·L)`` and
``k_max = 2·k_total/L − k_min`` (β = 20 there); :func:`linear_schedule` gives that at equal bytes.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


class AllocationError(ValueError):
    """The allocation cannot be made as asked; the message names the input."""


def _check(C: np.ndarray, alpha: np.ndarray, cost: np.ndarray, lo: np.ndarray, hi: np.ndarray, budget: float) -> None:
    if not (C.shape == alpha.shape == cost.shape == lo.shape == hi.shape) or C.ndim != 1 or C.size == 0:
        raise AllocationError("C, alpha, costs and bounds must be equal-length vectors, one entry per layer")
    if not (np.all(C > 0) and np.all(alpha > 0) and np.all(np.isfinite(C)) and np.all(np.isfinite(alpha))):
        raise AllocationError(f"every layer needs C > 0 and alpha > 0 (a decaying law), got C={C.tolist()}, "
                              f"alpha={alpha.tolist()}")
    if not np.all(cost > 0):
        raise AllocationError("every layer's per-token cost must be positive")
    if np.any(lo < 1) or np.any(lo > hi):
        raise AllocationError(f"window bounds must satisfy 1 <= lo <= hi, got lo={lo.tolist()}, hi={hi.tolist()}")
    if budget < float(cost @ lo):
        raise AllocationError(f"the budget of {budget:g} bytes is below the smallest allocation ({float(cost @ lo):g} "
                              "bytes: every layer at its lower bound)")


def continuous_allocation(C: Sequence[float], alpha: Sequence[float], cost: Sequence[float], budget: float,
                          lo: Sequence[float], hi: Sequence[float]) -> np.ndarray:
    """[L] real windows minimizing ``Σ C_l w_l^-α_l`` with ``Σ cost_l w_l <= budget`` and
    ``lo_l <= w_l <= hi_l`` (module docstring).

    Raises:
        AllocationError: mismatched or invalid inputs, or a budget below ``Σ cost_l lo_l``.
    """
    C, a, b, lo, hi = (np.asarray(x, dtype=np.float64) for x in (C, alpha, cost, lo, hi))
    _check(C, a, b, lo, hi, budget)
    if float(b @ hi) <= budget:
        return hi.copy()  # everything fits

    def w(log_lam: float) -> np.ndarray:
        return np.clip(np.exp((np.log(a * C) - log_lam - np.log(b)) / (a + 1)), lo, hi)

    low, high = -700.0, 700.0  # log λ: w at hi at the low end, at lo at the high end
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if float(b @ w(mid)) > budget else (low, mid)
    return w(high)


def integer_allocation(C: Sequence[float], alpha: Sequence[float], cost: Sequence[float], budget: float,
                       lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:
    """[L] int64 windows: :func:`continuous_allocation` rounded down, then the bytes left given one token
    at a time to the layer whose distortion drops most per byte (module docstring).

    Raises:
        AllocationError: as :func:`continuous_allocation`.
    """
    C, a, b = (np.asarray(x, dtype=np.float64) for x in (C, alpha, cost))
    lo_i, hi_i = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    w = np.floor(continuous_allocation(C, a, b, budget, lo_i, hi_i) + 1e-9).astype(np.int64)
    w = np.clip(w, lo_i, hi_i)
    left = budget - float(b @ w)
    while True:
        room = (w < hi_i) & (b <= left + 1e-9)
        if not room.any():
            return w
        gain = np.where(room, (C * w.astype(float) ** -a - C * (w + 1.0) ** -a) / b, -np.inf)
        l = int(np.argmax(gain))
        w[l] += 1
        left -= b[l]


def budget_for(C: Sequence[float], alpha: Sequence[float], cost: Sequence[float], eps: float,
               lo: Sequence[int], hi: Sequence[int]) -> float | None:
    """The smallest budget (bytes, within one layer's token cost) whose :func:`integer_allocation`
    has a predicted distortion ``Σ C_l w_l^-α_l <= eps``, by bisection; None when even every layer
    at ``hi`` predicts more than ``eps``.

    Raises:
        AllocationError: eps <= 0, or as :func:`continuous_allocation`.
    """
    if not eps > 0:
        raise AllocationError(f"eps (--eps) must be a positive distortion, got {eps}")
    b, lo_a, hi_a = (np.asarray(x, dtype=np.float64) for x in (cost, lo, hi))
    if predicted_distortion(C, alpha, hi_a) > eps:
        return None
    low, high = float(b @ lo_a), float(b @ hi_a)
    if predicted_distortion(C, alpha, integer_allocation(C, alpha, cost, low, lo, hi)) <= eps:
        return low
    while high - low > float(b.min()):
        mid = (low + high) / 2
        if predicted_distortion(C, alpha, integer_allocation(C, alpha, cost, mid, lo, hi)) <= eps:
            high = mid
        else:
            low = mid
    return high


def predicted_distortion(C: Sequence[float], alpha: Sequence[float], windows: Sequence[float]) -> float:
    """``Σ_l C_l w_l^-α_l``: the sum of per-layer distortions the laws predict."""
    C, a, w = (np.asarray(x, dtype=np.float64) for x in (C, alpha, windows))
    return float(np.sum(C * w ** -a))


def uniform_windows(cost: Sequence[float], budget: float, lo: int, hi: int) -> np.ndarray:
    """[L] int64: the one window w shared by every layer with ``Σ cost_l · w <= budget``, in [lo, hi]."""
    b = np.asarray(cost, dtype=np.float64)
    w = int(min(hi, max(lo, math.floor(budget / float(b.sum()) + 1e-9))))
    return np.full(b.size, w, dtype=np.int64)


def linear_schedule(cost: Sequence[float], budget: float, lo: int, hi: int, beta: float = 20.0) -> np.ndarray:
    """[L] int64 PyramidKV-style windows falling linearly with depth at equal bytes (module docstring):
    ``k_min = k̄/β``, ``k_max = 2k̄ − k_min`` around the mean window ``k̄`` that the budget buys,
    rounded down and clipped to [lo, hi]; bytes that clipping at ``hi`` leaves unspent go to the
    shallowest layers still below ``hi``, so the schedule spends what the budget allows.

    Raises:
        AllocationError: β <= 1, or fewer than 2 layers.
    """
    b = np.asarray(cost, dtype=np.float64)
    L = b.size
    if L < 2 or beta <= 1:
        raise AllocationError(f"a linear schedule needs at least 2 layers and beta > 1, got {L} layers, beta={beta}")
    mean = budget / float(b.sum())  # the mean window at equal bytes when every layer costs the same
    k_min = mean / beta
    k_max = 2 * mean - k_min
    w = np.clip(np.floor(k_max - np.arange(L) * (k_max - k_min) / (L - 1) + 1e-9).astype(np.int64), lo, hi)
    # windows clipped at hi leave bytes unspent: hand them out one token at a time, shallowest layer
    # first, so the schedule spends what the uniform window spends
    while True:
        room = np.flatnonzero((w < hi) & (b <= budget - float(b @ w) + 1e-9))
        if room.size == 0:
            return w
        w[room[0]] += min(hi - w[room[0]], max(1, int((budget - float(b @ w)) // (b[room[0]] * room.size))))


def kvpress_ratios(windows: Sequence[int], context: int) -> list[float]:
    """Per-layer ``compression_ratio`` of kvpress's ``PerLayerCompressionPress`` for a window plan over a
    context of ``context`` tokens: the share of keys each layer removes, ``1 − w_l/context``
    (``windows`` here count every key a layer reads: sinks, recent keys and the query's own key).
    kvpress keeps ``int(T'(1 − r))`` keys of a prefill of T' = context − 1 tokens, which is
    ``w_l − 1`` for ``w_l < context``: with the query's own key, layer l reads ``w_l`` keys
    (docs/plan.md; tests/test_kvpress_plan.py checks it against kvpress's scorer).

    Raises:
        AllocationError: a window outside [1, context].
    """
    w = np.asarray(windows, dtype=np.int64)
    if np.any(w < 1) or np.any(w > context):
        raise AllocationError(f"windows must lie in [1, {context}], got {w.tolist()}")
    return [float(1 - int(x) / context) for x in w]


def allocation_with_fixed(C: Sequence[float], alpha: Sequence[float], cost: Sequence[float], budget: float,
                          lo: int, hi: int, fixed: Sequence[int]) -> np.ndarray:
    """[L] int64 windows: layers with ``fixed[l] > 0`` keep that window; the bytes left go to the other
    layers by :func:`integer_allocation` of their laws (``C``/``alpha`` entries of fixed layers are
    ignored). ``truncsens plan`` fixes a layer whose curve lies at the noise floor at the window where
    it reaches the floor (:func:`truncsens.fits.per_layer.floor_window`): it has no law to allocate by.

    Raises:
        AllocationError: no layer left to allocate, a budget below the fixed layers' bytes plus ``lo``
            in every other layer, or as :func:`integer_allocation`.
    """
    C, a, b = (np.asarray(x, dtype=np.float64) for x in (C, alpha, cost))
    fixed = np.asarray(fixed, dtype=np.int64)
    free = fixed <= 0  # [L] the layers allocated by their laws
    if not free.any():
        raise AllocationError("every layer is fixed: there is no law to allocate by")
    room = budget - float(b[~free] @ fixed[~free])
    w = fixed.copy()
    w[free] = integer_allocation(C[free], a[free], b[free], room, [lo] * int(free.sum()), [hi] * int(free.sum()))
    return w


def predicted_with_fixed(C: Sequence[float], alpha: Sequence[float], windows: Sequence[int],
                         fixed: Sequence[int]) -> float:
    """:func:`predicted_distortion` over the layers not fixed (``fixed[l] <= 0``); a fixed layer adds 0 at
    or above its fixed window (its curve lies at the noise floor there) and makes the prediction NaN
    (unknown) below it."""
    C, a, w = (np.asarray(x, dtype=np.float64) for x in (C, alpha, windows))
    fixed = np.asarray(fixed, dtype=np.int64)
    free = fixed <= 0
    if np.any(w[~free] < fixed[~free]):
        return float("nan")
    return predicted_distortion(C[free], a[free], w[free])
