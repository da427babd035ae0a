"""Server-side records of one draw of the design: what a server that drew the kept set knows about
the keys it evicted, before the target's query exists [ours].

The design draws key i with probability π_i from a score computed at eviction time (the per-head
``window`` attention of the last W prefill queries, or the token-level received attention,
:mod:`truncsens.certificates.designs`). Normalized over the row, that score is the server's proxy
``p_i`` (Σ_i p_i = 1) of the attention the next query will pay to key i. The records compare the
score share the draw evicted with what the design expected to evict (Poisson sampling: independent
draws, Särndal, Swensson and Wretman 1992, section 3.3):

- ``evicted_share`` ``E = Σ_{i∉S} p_i``;
- ``evicted_share_expected`` ``E[E] = Σ_i (1 − π_i) p_i``;
- ``evicted_share_var`` ``Var[E] = Σ_i π_i (1 − π_i) p_i²``;
- ``evicted_share_max`` ``max_{i∉S} p_i`` (0 when nothing was evicted).

None of them reads the target's query, the evicted keys' values or the full-cache output: a draw
that misses a key the window attended heavily shows as ``E`` above ``E[E]``, which the kept set alone
(the certificate radius) cannot show.
"""

from __future__ import annotations

import torch

DESIGN_RECORDS = ("evicted_share", "evicted_share_expected", "evicted_share_var", "evicted_share_max")


def score_shares(scores: torch.Tensor) -> torch.Tensor:
    """[..., T] float64 scores normalized to sum 1 over the last axis (a row without score: uniform).

    Args:
        scores: [..., T] non-negative design scores (any float dtype).
    """
    s = scores.to(torch.float64).clamp_min(0)
    total = s.sum(-1, keepdim=True)  # [..., 1]
    uniform = torch.full_like(s, 1.0 / s.shape[-1])
    return torch.where(total > 0, s / torch.where(total > 0, total, torch.ones_like(total)), uniform)


def design_records(kept: torch.Tensor, pi: torch.Tensor, share: torch.Tensor) -> dict[str, torch.Tensor]:
    """The records of the module docstring, one per row.

    Args:
        kept: [..., T] bool kept keys; pi: [..., T] inclusion probabilities (1 on certain keys, 0 on keys
            never kept); share: [..., T] score shares ``p`` (:func:`score_shares`); broadcastable.

    Returns:
        name (:data:`DESIGN_RECORDS`) -> [...] float64.

    Raises:
        ValueError: a π outside [0, 1].
    """
    pi = pi.to(torch.float64)
    if bool(((pi < 0) | (pi > 1)).any()):
        raise ValueError("inclusion probabilities must lie in [0, 1]")
    p = share.to(torch.float64)
    evicted = torch.where(kept, torch.zeros_like(p), p)  # [..., T] shares of the evicted keys
    return {"evicted_share": evicted.sum(-1), "evicted_share_expected": ((1 - pi) * p).sum(-1),
            "evicted_share_var": (pi * (1 - pi) * p ** 2).sum(-1), "evicted_share_max": evicted.amax(-1)}


def per_head(values: torch.Tensor, n_layers: int, n_heads: int) -> torch.Tensor:
    """[B, L', Hkv'] records (L' = 1 and Hkv' = 1 under a shared design) -> [B, L, H], every query head
    of a key/value group reading its group's record."""
    B, Lp, Hp = values.shape
    out = values.expand(B, n_layers, Hp) if Lp == 1 else values
    return out.repeat_interleave(n_heads // Hp, dim=2) if Hp != n_heads else out
