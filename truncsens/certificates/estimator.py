"""Attention-level error records of one query: the exact output, the Hájek output over the kept
keys, its variance estimate and two certificate radii. Pure torch math, float64.

Source: P. Xie, "Error Certificates for KV-Cache Eviction via Randomized Design" (arXiv 2607.21475),
docs/method.md section 5; the estimator, variance and normal radius are those of
:mod:`truncsens.policies.poisson_design`. The empirical-Bernstein radius of a *sum* is [ours] (the paper names
an empirical-Bernstein radius without a formula we could read):

The linearized error is a sum over tail keys of independent zero-mean vectors
``X_i = (I_i/π_i − 1)·w_i·(v_i − o)/Z``. Maurer and Pontil (2009, Theorem 4) bound the mean of n
independent draws of range B with sample variance V_n by ``sqrt(2·V_n·ln(4/δ)/n) + 7·B·ln(4/δ)/(3(n − 1))``
(δ/2 per side). Taking the sum (n × the mean) with ``n·V_n = V̂`` (the Poisson variance estimate)
gives

    r_EB = sqrt(2·V̂·ln(4/δ)) + (7/3)·B̂·ln(4/δ)·n/(n − 1),

with n = |S ∩ tail| (kept random keys) and the plug-in range ``B̂ = max_{i∈S∩tail} w_i‖v_i − ô‖/(π_i·Ẑ)``
(the range of ``X_i`` is ``w_i‖v_i − o‖/(π_i Z)``). Both plug-ins are read off the kept set only, so
the radius is a heuristic finite-sample radius, not a theorem: its coverage is what
``truncsens certify`` measures. With no random key (nothing evicted, or a deterministic policy) the
radii are 0; with fewer than 2 kept random keys of a non-empty tail the EB radius is +inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from truncsens.policies.poisson_design import (
    certificate_radius, hajek_attention, hajek_bias, hajek_variance,
)

VARIANCES = ("hajek", "hajek_bias")
"""Variance estimates the radii may use (``truncsens certify --variance``): ``hajek``, the linearized
Poisson variance V̂ (:func:`~truncsens.policies.poisson_design.hajek_variance`); ``hajek_bias``,
V̂ + ‖b̂‖² with b̂ the estimated bias of the Hájek ratio (:func:`~truncsens.policies.poisson_design.hajek_bias`),
an estimate of the mean squared error (docs/method.md section 5)."""


@dataclass
class AttentionRecords:
    """Records of one query per row (``...`` = any leading shape, e.g. [B, H]).

    Attributes:
        o: [..., d] exact full-context output.
        o_hat: [..., d] Hájek output over the kept keys (plain attention when π = 1 on every kept key).
        error: [...] ``‖ô − o‖₂`` (units of the values); 0 below float64 resolution (:func:`resolved_error`).
        variance: [...] the variance estimate of the radii (``V̂``, or ``V̂ + ‖b̂‖²`` under ``hajek_bias``; squared units).
        radius_eb: [...] empirical-Bernstein radius (module docstring).
        radius_normal: [...] ``z_{1−δ/2}·sqrt(V̂)``.
        o_norm: [...] ``‖o‖₂`` (a full-cache, oracle quantity).
        o_hat_norm: [...] ``‖ô‖₂`` (of the kept set: a server has it).
        value_range: [...] ``B̂`` (0 without kept random keys).
        n_random: [...] int64 kept random keys n.
        has_tail: [...] bool, whether the design had random keys.
        o_hat_norm: [...] ``‖ô‖₂`` (server-side: read off the kept set).
        kept_share: [...] ``Σ_{i∈S} w_i / Ẑ``, the Hájek estimate of the share of the query's attention
            on kept keys (in (0, 1]; server-side) [ours].
        tail_mass: [...] ``Σ_{i∈tail} w_i / Σ_i w_i`` over every available key, the share of the
            query's full-cache attention on the keys drawn at random (in [0, 1]; a full-cache, oracle
            quantity) [ours].
        variance_hajek: [...] the plain ``V̂`` (equal to ``variance`` under the ``hajek`` variance).
    """

    o: torch.Tensor
    o_hat: torch.Tensor
    error: torch.Tensor
    variance: torch.Tensor
    radius_eb: torch.Tensor
    radius_normal: torch.Tensor
    o_norm: torch.Tensor
    value_range: torch.Tensor
    n_random: torch.Tensor
    has_tail: torch.Tensor
    o_hat_norm: torch.Tensor | None = None
    kept_share: torch.Tensor | None = None
    tail_mass: torch.Tensor | None = None
    variance_hajek: torch.Tensor | None = None


def eb_sum_radius(variance: torch.Tensor, value_range: torch.Tensor, n: torch.Tensor, has_tail: torch.Tensor,
                  delta: float) -> torch.Tensor:
    """``r_EB`` of the module docstring: ``n · MP(V̂/n, n, B̂, δ)`` (Maurer and Pontil 2009, Theorem 4).

    Args:
        variance: [...] V̂; value_range: [...] B̂; n: [...] kept random keys; has_tail: [...] bool,
            whether the design had random keys at all.
        delta: miss probability in (0, 1).

    Returns:
        [...] float64: 0 without random keys, +inf with fewer than 2 kept ones.

    Raises:
        ValueError: ``delta`` outside (0, 1).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    n = n.to(torch.float64)
    enough = n >= 2
    n_safe = torch.where(enough, n, torch.full_like(n, 2.0))
    log_term = math.log(4 / delta)
    r = (2 * variance.to(torch.float64).clamp(min=0) * log_term).sqrt() \
        + 7 * value_range.to(torch.float64) * log_term * n_safe / (3 * (n_safe - 1))
    r = torch.where(enough, r, torch.full_like(r, math.inf))
    return torch.where(has_tail, r, torch.zeros_like(r))


def attention_records(logits: torch.Tensor, values: torch.Tensor, available: torch.Tensor, kept: torch.Tensor,
                      pi: torch.Tensor, tail: torch.Tensor, delta: float = 0.05,
                      variance: str = "hajek") -> AttentionRecords:
    """Exact and Hájek outputs of one query per row, the variance estimate and both radii.

    Args:
        logits: [..., n] attention logits ``q·k_i·scale`` (float64 recommended).
        values: [..., n, d] values.
        available: [..., n] bool keys the query may read (causal); broadcastable.
        kept: [..., n] bool kept keys (a subset of ``available``, at least one per row); broadcastable.
        pi: [..., n] inclusion probabilities, 1 on surely kept keys; broadcastable.
        tail: [..., n] bool keys drawn at random; broadcastable.
        delta: miss probability of the radii, in (0, 1).
        variance: the variance estimate of the radii, one of :data:`VARIANCES`.

    Returns:
        :class:`AttentionRecords` (float64).

    Raises:
        ValueError: ``delta`` outside (0, 1), a π outside [0, 1] / zero on a kept key, or an unknown
            ``variance`` (named).
    """
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {', '.join(VARIANCES)}, got {variance!r}")
    logits = logits.to(torch.float64)
    values = values.to(torch.float64)
    shape = logits.shape
    available, kept, tail = (t.expand(shape) for t in (available, kept, tail))
    pi = pi.to(torch.float64).expand(shape)
    pi_kept = torch.where(kept & tail, pi, torch.ones_like(pi))  # [..., n] π on kept random keys, 1 on certain ones
    o = hajek_attention(logits, values, available, torch.ones_like(logits))  # [..., d] exact: every key, π = 1
    o_hat = hajek_attention(logits, values, kept, pi_kept)  # [..., d]
    plain = hajek_variance(logits, values, kept, pi_kept, tail)  # [...] V̂
    estimate = plain if variance == "hajek" else plain + (hajek_bias(logits, values, kept, pi_kept, tail) ** 2).sum(-1)
    # plug-in range B̂ = max over kept random keys of w_i ‖v_i − ô‖ / (π_i Ẑ) (module docstring)
    shift = torch.where(kept, logits, torch.full_like(logits, -math.inf)).amax(-1, keepdim=True)  # [..., 1]
    w = torch.where(kept, (logits - shift).exp(), torch.zeros_like(logits))  # [..., n]
    z_hat = (w / pi_kept).sum(-1, keepdim=True)  # [..., 1]
    spread = ((values - o_hat.unsqueeze(-2)) ** 2).sum(-1).sqrt()  # [..., n]
    terms = torch.where(kept & tail, w * spread / (pi_kept * z_hat), torch.zeros_like(w))  # [..., n]
    value_range = terms.amax(-1)  # [...]
    n_random = (kept & tail).sum(-1)  # [...]
    has_tail = tail.any(-1)  # [...]
    radius_eb = eb_sum_radius(estimate, value_range, n_random, has_tail, delta)
    radius_normal = certificate_radius(estimate, delta)
    kept_share = (w.sum(-1, keepdim=True) / z_hat).squeeze(-1)  # [...] Σ_S w_i / Ẑ
    top = torch.where(available, logits, torch.full_like(logits, -math.inf)).amax(-1, keepdim=True)  # [..., 1]
    w_all = torch.where(available, (logits - top).exp(), torch.zeros_like(logits))  # [..., n] full-cache weights
    tail_mass = torch.where(tail & available, w_all, torch.zeros_like(w_all)).sum(-1) / w_all.sum(-1)  # [...]
    o_norm, o_hat_norm = o.norm(dim=-1), o_hat.norm(dim=-1)  # [...] each
    error = resolved_error((o_hat - o).norm(dim=-1), torch.maximum(o_norm, o_hat_norm))
    return AttentionRecords(o, o_hat, error, estimate, radius_eb, radius_normal, o_norm,
                            value_range, n_random, has_tail, o_hat_norm, kept_share, tail_mass, plain)


F64_RESOLUTION = 64 * torch.finfo(torch.float64).eps
"""Relative size (to the larger of ‖o‖, ‖ô‖) below which ‖ô − o‖ is float64 rounding of its own
computation (about 1.4e-14): where the kept set holds every key with attention mass (a tail whose
weights underflow, e.g. e^-50), ô and o differ only by the order of float64 sums, and the "error" is
0 on one CPU and 4e-17 on another. Such errors are stored as 0, so coverage decisions do not depend on
the machine (docs/precision.md)."""


def resolved_error(error: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``error`` where it exceeds :data:`F64_RESOLUTION` · ``scale``, else exactly 0 (same shape, float64).

    Args:
        error: [...] ‖ô − o‖ in float64; scale: [...] max(‖o‖, ‖ô‖) (same units).
    """
    error = error.to(torch.float64)
    return torch.where(error > F64_RESOLUTION * scale.to(torch.float64), error, torch.zeros_like(error))
