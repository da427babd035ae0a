"""Ranges over the undrawn tail: what a server would have to keep of the evicted keys to see them.

The empirical-Bernstein radius of :mod:`truncsens.certificates.estimator` reads its range ``B̂`` off
the kept random keys only, so a key that was not drawn and that the target's query leans on never
enters it: every miss of ``truncsens certify`` is such a key (docs/certify.md, "Where the default
design misses"). The range the Maurer–Pontil bound asks for is over *every* tail key,

    B = max_{i ∈ tail} w_i·‖v_i − ô‖ / (π_i·Ẑ),     w_i = exp(l_i − m),

with ``l_i`` the key's logit ``q·k_i·scale`` and ``m``, ``Ẑ`` the shift and Hájek normalizer of the
kept set. For an undrawn key a server knows neither ``l_i`` nor ``v_i`` unless it kept something of
them; this module gives upper bounds ``u_i ≥ l_i`` and ``ν_i ≥ ‖v_i‖`` from summaries a server could
keep beside the evicted cache, and the range they imply, ``max(B̂, max_{i undrawn} exp(u_i − m)·(ν_i + ‖ô‖)
/ (π_i·Ẑ))`` (``‖v_i − ô‖ ≤ ‖v_i‖ + ‖ô‖``). Memory per evicted token and head, against the
``2·d`` numbers of its key and value:

- the key itself (``u_i = l_i``) and ``‖v_i‖``: ``d + 1`` numbers;
- a ``b``-bit per-channel uniform quantization of the evicted keys (KIVI, Liu et al. 2024,
  arXiv 2402.02750, quantizes keys per channel): ``k̃_ij = lo_j + round((k_ij − lo_j)/s_j)·s_j``,
  ``s_j = (hi_j − lo_j)/(2^b − 1)``, so ``|k_ij − k̃_ij| ≤ s_j/2`` and
  ``u_i = scale·(q·k̃_i + Σ_j |q_j|·s_j/2)`` (``d·b`` bits and ``‖v_i‖``);
- page summaries of ``P`` consecutive positions (Quest, Tang et al. 2024, arXiv 2406.10774): the
  channel-wise minimum and maximum of the page's evicted keys, ``u_i = scale·Σ_j max(q_j·min_j,
  q_j·max_j)`` for every key of the page, and the page's largest ``‖v‖`` (``(2·d + 1)/P`` numbers).

Pure torch math (float64). Which of these gives a useful radius is measured by
``benchmarks/certify_tail_range.py``.
"""

from __future__ import annotations

import math

import torch


def _member_range(k: torch.Tensor, members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise minimum and maximum over the members along dim -2.

    Args:
        k: [..., M, d] keys; members: [..., M, 1] bool.

    Returns:
        (lo, hi), each [..., d]: +inf / -inf where a group has no member.
    """
    lo = torch.where(members, k, torch.full_like(k, math.inf)).amin(-2)  # [..., d]
    hi = torch.where(members, k, torch.full_like(k, -math.inf)).amax(-2)  # [..., d]
    return lo, hi


def quantized_logit_bound(query: torch.Tensor, keys: torch.Tensor, members: torch.Tensor, bits: int,
                          scaling: float) -> torch.Tensor:
    """Upper bounds of the logits of ``members`` from a ``bits``-bit per-channel quantization of their
    keys (module docstring; the channel ranges ``lo``, ``hi`` are taken over the members of each row).

    Args:
        query: [..., d] one query per row.
        keys: [..., T, d] keys.
        members: [..., T] bool, the keys that were quantized (e.g. the undrawn tail).
        bits: bits per channel, at least 1.
        scaling: the attention's logit scale (``1/√d`` for most models).

    Returns:
        [..., T] float64: ``u_i ≥ q·k_i·scaling`` on members, ``-inf`` elsewhere.

    Raises:
        ValueError: ``bits`` below 1.
    """
    if bits < 1:
        raise ValueError(f"bits must be at least 1, got {bits}")
    q = query.to(torch.float64)
    k = keys.to(torch.float64)
    lo, hi = (t.unsqueeze(-2) for t in _member_range(k, members.unsqueeze(-1)))  # [..., 1, d] each
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))  # rows without members
    hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi))
    step = (hi - lo) / (2**bits - 1)  # [..., 1, d]
    codes = torch.where(step > 0, torch.round((k - lo) / torch.where(step > 0, step, torch.ones_like(step))),
                        torch.zeros_like(k))  # [..., T, d]
    shadow = lo + codes * step  # [..., T, d] the dequantized keys
    slack = (q.abs().unsqueeze(-2) * step / 2).sum(-1)  # [..., 1]
    u = (torch.matmul(shadow, q.unsqueeze(-1)).squeeze(-1) + slack) * scaling  # [..., T]
    return torch.where(members, u, torch.full_like(u, -math.inf))


def page_logit_bound(query: torch.Tensor, keys: torch.Tensor, members: torch.Tensor, page: int,
                     scaling: float) -> torch.Tensor:
    """Quest's page bound: for every member key, ``scaling·Σ_j max(q_j·min_j, q_j·max_j)`` over the
    channel-wise minimum and maximum of the members of its page (positions ``[p·P, (p + 1)·P)``).

    Args:
        query: [..., d]; keys: [..., T, d]; members: [..., T] bool; page: P ≥ 1 positions per page;
        scaling: the logit scale.

    Returns:
        [..., T] float64: ``u_i ≥ q·k_i·scaling`` on members, ``-inf`` elsewhere.

    Raises:
        ValueError: ``page`` below 1.
    """
    if page < 1:
        raise ValueError(f"page must be at least 1, got {page}")
    q = query.to(torch.float64)
    k = keys.to(torch.float64)
    T, d = k.shape[-2], k.shape[-1]
    pad = (-T) % page
    m = torch.nn.functional.pad(members, (0, pad), value=False)  # [..., T + pad]
    k = torch.nn.functional.pad(k, (0, 0, 0, pad))  # [..., T + pad, d]
    k = k.reshape(*k.shape[:-2], -1, page, d)  # [..., n_pages, P, d]
    m = m.reshape(*m.shape[:-1], -1, page, 1)  # [..., n_pages, P, 1]
    lo, hi = _member_range(k, m)  # [..., n_pages, d] each
    qd = q.unsqueeze(-2)  # [..., 1, d]
    u = torch.maximum(qd * lo, qd * hi).sum(-1) * scaling  # [..., n_pages]; nan/inf on empty pages, masked below
    u = u.repeat_interleave(page, dim=-1)[..., :T]  # [..., T] each key gets its page's bound
    return torch.where(members, u, torch.full_like(u, -math.inf))


def page_max(x: torch.Tensor, members: torch.Tensor, page: int) -> torch.Tensor:
    """For every member, the largest ``x`` among the members of its page of ``page`` positions.

    Args:
        x: [..., T]; members: [..., T] bool; page: P ≥ 1.

    Returns:
        [..., T] float64, ``-inf`` off the members.
    """
    T = x.shape[-1]
    pad = (-T) % page
    y = torch.where(members, x.to(torch.float64), torch.full_like(x, -math.inf, dtype=torch.float64))
    y = torch.nn.functional.pad(y, (0, pad), value=-math.inf).reshape(*y.shape[:-1], -1, page)  # [..., n_pages, P]
    y = y.amax(-1).repeat_interleave(page, dim=-1)[..., :T]  # [..., T]
    return torch.where(members, y, torch.full_like(y, -math.inf))


def tail_range(logits: torch.Tensor, logit_upper: torch.Tensor, value_norm_upper: torch.Tensor,
               o_hat: torch.Tensor, kept: torch.Tensor, pi: torch.Tensor, tail: torch.Tensor,
               plug_in: torch.Tensor) -> torch.Tensor:
    """The range over the whole tail that the bounds imply (module docstring):
    ``max(B̂, max_{i ∈ tail, not kept} exp(u_i − m)·(ν_i + ‖ô‖)/(π_i·Ẑ))``.

    Args:
        logits: [..., n] logits (only the kept ones are read: they give ``m`` and ``Ẑ``).
        logit_upper: [..., n] ``u_i`` (read on undrawn tail keys).
        value_norm_upper: [..., n] ``ν_i ≥ ‖v_i‖`` (read on undrawn tail keys).
        o_hat: [..., d] the Hájek output.
        kept, tail: [..., n] bool; pi: [..., n] inclusion probabilities (1 on sure keys).
        plug_in: [...] ``B̂`` over the kept random keys (:class:`~truncsens.certificates.estimator.AttentionRecords`).

    Returns:
        [...] float64 range, at least ``plug_in``.
    """
    lg = logits.to(torch.float64)
    pi = pi.to(torch.float64)
    pi_kept = torch.where(kept & tail, pi, torch.ones_like(pi))  # [..., n]
    shift = torch.where(kept, lg, torch.full_like(lg, -math.inf)).amax(-1, keepdim=True)  # [..., 1]
    z_hat = torch.where(kept, (lg - shift).exp() / pi_kept, torch.zeros_like(lg)).sum(-1, keepdim=True)  # [..., 1]
    undrawn = tail & ~kept  # [..., n]
    spread = value_norm_upper.to(torch.float64) + o_hat.to(torch.float64).norm(dim=-1, keepdim=True)  # [..., n]
    terms = (logit_upper.to(torch.float64) - shift).exp() * spread / (pi.clamp_min(torch.finfo(torch.float64).tiny) * z_hat)
    terms = torch.where(undrawn, terms, torch.zeros_like(terms))  # [..., n]
    return torch.maximum(plug_in.to(torch.float64), terms.amax(-1))
