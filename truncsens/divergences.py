"""Divergences between next-token distributions, as pure torch functions.

All inputs are natural-log probabilities (``torch.log_softmax``) in float32 or float64, shape
``[..., V]`` (any leading shape, vocabulary last). Every result has the leading shape ``[...]``.
Log base e everywhere: KL, JS and NLL are in nats. Every metric is computed in float64 (inputs are
upcast first) and returned in float64.

:func:`all_metrics` takes raw float32 **logits** (or log-probabilities: ``log_softmax`` is idempotent)
and normalizes them itself in float64. This matters: a float32 ``log_softmax`` rounds each
log-probability to about ``|log p|·6e-8``, which at KL ≈ 2e-4 gives a relative KL error of about
3e-3 and JS(p, p) ≈ 1e-7 instead of 0 (see ``docs/precision.md``, which also gives the noise floor
of a float32 forward pass itself).

Definitions (Cover & Thomas, *Elements of Information Theory*, 2nd ed., eqs. 2.26 and 11.137):

- total variation ``tv(p, q) = 1/2 * sum_x |p(x) - q(x)|``, in [0, 1];
- ``kl(p, q) = sum_x p(x) (log p(x) - log q(x))`` with ``0 log 0 = 0``; ``+inf`` where q = 0 < p;
- Jensen-Shannon ``js(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m)``, ``m = (p + q) / 2``, in [0, log 2],
  computed as ``1/2 sum_x p(x) [log 2 - softplus(log q(x) - log p(x))] + (same with p, q swapped)``
  (the same identity, since ``log p - log m = log 2 - log(1 + q/p)``), which is exactly 0 when p = q;
- ``top1_agree``: the argmax tokens are equal;
- ``nll(p, y) = -log p(y)``.

Rounding can push TV a hair outside [0, 1] and KL / JS a hair below 0; :func:`clamp_rounding`
clamps those to :data:`RANGES` and counts how many it touched, so a run can report them.

:data:`METRICS` names what :func:`all_metrics` returns, in results-file order, and :data:`RANGES` the
range of each; :mod:`truncsens.metrics` holds the record of each metric (unit, storage dtype, noise
floor, ...) and reads its name, range and function here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_FLOAT_TYPES = (torch.float32, torch.float64)


def _check(logp: torch.Tensor, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both inputs upcast to float64 after checking shape and dtype.

    Raises:
        ValueError: the shapes differ.
        TypeError: a dtype is not float32 or float64 (float16 / bfloat16 logits are too coarse).
    """
    if logp.shape != logq.shape:
        raise ValueError(f"shape mismatch: {tuple(logp.shape)} vs {tuple(logq.shape)}")
    if logp.dtype not in _FLOAT_TYPES or logq.dtype not in _FLOAT_TYPES:
        raise TypeError(f"divergences need float32 or float64 log-probabilities, got {logp.dtype}, {logq.dtype}")
    return logp.to(torch.float64), logq.to(torch.float64)


def tv(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Total variation distance 1/2 * sum |p - q| over the last axis, float64. Shapes [..., V] -> [...]."""
    logp, logq = _check(logp, logq)
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


def kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum p (log p - log q) in nats, float64, with 0 log 0 = 0. Shapes [..., V] -> [...]."""
    logp, logq = _check(logp, logq)
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    return terms.sum(-1)


def _half_js(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """sum_x p(x) (log p(x) - log m(x)) with m = (p + q)/2, as p·(log 2 - softplus(log q - log p))."""
    p = logp.exp()
    d = torch.where(p > 0, logq - logp, torch.zeros_like(p))  # [..., V]; -inf where q = 0 < p
    softplus = torch.logaddexp(torch.zeros_like(d), d)  # log(1 + q/p), exact to float64 rounding for any d
    terms = torch.where(p > 0, p * (math.log(2.0) - softplus), torch.zeros_like(p))
    return terms.sum(-1)


def js(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in nats, float64, in [0, log 2]; exactly 0 for p = q. [..., V] -> [...]."""
    logp, logq = _check(logp, logq)
    return 0.5 * _half_js(logp, logq) + 0.5 * _half_js(logq, logp)


def top1_agree(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """1 where the most likely tokens of p and q are the same, else 0 (int8). [..., V] -> [...]."""
    _check(logp, logq)
    return (logp.argmax(-1) == logq.argmax(-1)).to(torch.int8)


def nll(logp: torch.Tensor, token_id: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood -log p(token) in nats, float64. logp [..., V], token_id [...] -> [...]."""
    if logp.dtype not in _FLOAT_TYPES:
        raise TypeError(f"nll needs float32 or float64 log-probabilities, got {logp.dtype}")
    return -logp.to(torch.float64).gather(-1, token_id.long().unsqueeze(-1)).squeeze(-1)


@dataclass
class Clamped:
    """A metric after clamping rounding noise, and how many entries were clamped."""

    values: torch.Tensor
    n_clamped: int


def clamp_rounding(values: torch.Tensor, lo: float, hi: float | None = None, tol: float = 1e-4) -> Clamped:
    """Clamp values that lie outside [lo, hi] by at most ``tol`` (rounding noise) and count them.

    Raises:
        ValueError: a value lies outside the range by more than ``tol`` (a real bug, not rounding),
            or is NaN.
    """
    if torch.isnan(values).any():
        raise ValueError("divergence is NaN: the log-probabilities were not finite")
    too_low = values < lo
    too_high = values > hi if hi is not None else torch.zeros_like(too_low)
    if (values < lo - tol).any() or (hi is not None and (values > hi + tol).any()):
        bad = values[(values < lo - tol) | ((values > hi + tol) if hi is not None else torch.zeros_like(too_low))]
        raise ValueError(f"divergence outside [{lo}, {hi}] beyond rounding: {bad[:5].tolist()}")
    n = int(too_low.sum().item() + too_high.sum().item())
    return Clamped(values.clamp(min=lo, max=hi), n)


# Each metric of all_metrics, in results-file order, with its [lower, upper] range (math.inf: unbounded),
# into which all_metrics clamps rounding noise.
RANGES: dict[str, tuple[float, float]] = {
    "tv": (0.0, 1.0), "kl": (0.0, math.inf), "kl_reverse": (0.0, math.inf), "js": (0.0, math.log(2.0)),
    "top1_agree": (0.0, 1.0), "nll_ref": (0.0, math.inf), "nll_kept": (0.0, math.inf),
}
METRICS = tuple(RANGES)  # ("tv", "kl", "kl_reverse", "js", "top1_agree", "nll_ref", "nll_kept")


def _clamp(values: torch.Tensor, name: str) -> Clamped:
    """:func:`clamp_rounding` into ``RANGES[name]`` (no upper clamp where it is unbounded)."""
    lo, hi = RANGES[name]
    return clamp_rounding(values, lo, hi if math.isfinite(hi) else None)


def all_metrics(logits_ref: torch.Tensor, logits_kept: torch.Tensor, token_id: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """Every metric for a batch of (reference, kept) next-token distribution pairs, in float64.

    Both inputs are normalized here in float64 (``log_softmax(x.double())``), so they may be raw
    logits or log-probabilities (``log_softmax`` is idempotent). Pass the raw float32 logits of the
    model: float32 log-probabilities already carry the rounding this avoids (module docstring).

    Args:
        logits_ref: [n, V] float32 or float64 logits (or log-probabilities) with the full reference context.
        logits_kept: [n, V] the same with the kept context.
        token_id: [n] the actual next token (for the NLLs).

    Returns:
        (metrics, n_clamped): ``metrics`` maps each name of :data:`METRICS` to an [n] tensor
        (float64; ``top1_agree`` int8); ``n_clamped`` counts entries clamped for rounding noise
        (outside :data:`RANGES`: TV outside [0, 1], KL / JS below 0 or JS above log 2, by at most 1e-4).

    Raises:
        ValueError: shapes differ, or a metric is NaN or out of range beyond rounding (non-finite logits).
        TypeError: an input is not float32 / float64.
    """
    logits_ref, logits_kept = _check(logits_ref, logits_kept)
    logp_ref = torch.log_softmax(logits_ref, dim=-1)  # [n, V] float64
    logp_kept = torch.log_softmax(logits_kept, dim=-1)  # [n, V] float64
    t = _clamp(tv(logp_ref, logp_kept), "tv")
    k = _clamp(kl(logp_ref, logp_kept), "kl")
    kr = _clamp(kl(logp_kept, logp_ref), "kl_reverse")
    j = _clamp(js(logp_ref, logp_kept), "js")
    out = {
        "tv": t.values,
        "kl": k.values,
        "kl_reverse": kr.values,
        "js": j.values,
        "top1_agree": top1_agree(logp_ref, logp_kept),
        "nll_ref": nll(logp_ref, token_id),
        "nll_kept": nll(logp_kept, token_id),
    }
    return out, t.n_clamped + k.n_clamped + kr.n_clamped + j.n_clamped
