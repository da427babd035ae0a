"""Granularity of kept sets: one per target (``token``) or one per key/value head (``head``).

Under ``head`` (docs/method.md, "Granularity") the decision unit is (sequence, key/value head), one
kept set per KV head index shared by all layers (kvpress, https://github.com/NVIDIA/kvpress, also
differs per layer; we do not): statistics of KV head h are means over layers and over the query
heads of h's group, the policy runs on B·Hkv folded rows, and query head ``h·G + i`` reads KV head
h's kept keys (G = H / Hkv). This module holds the small pure helpers the semantics and the kernel
share: the head count of a run, folding a per-head reference pass into rows, and the per-target
summaries of per-head kept sets (kept keys, evicted attention mass).
"""

from __future__ import annotations

import torch

from truncsens.engine.reference_pass import ReferencePass, head_counts
from truncsens.policies.base import check_granularity, fold_heads


def heads_of(model, granularity: str) -> int | None:
    """None under token granularity; the model's number of key/value heads Hkv under ``head``.

    Raises:
        PolicyError: an unknown granularity.
    """
    check_granularity(granularity)
    return head_counts(model)[1] if granularity == "head" else None


def groups_of(model, per_head: bool) -> int:
    """Query heads per key/value head (G = H / Hkv) when ``per_head``, else 1."""
    if not per_head:
        return 1
    h, kv = head_counts(model)
    return h // kv


def fold_reference(ref: ReferencePass) -> ReferencePass:
    """A per-head reference pass ([B, Hkv, ...] statistics) with its heads folded into rows
    ([B·Hkv, ...], row ``b·Hkv + h``), for policies that run per row; log-probabilities and cache dropped."""
    def fold(x):
        return None if x is None else fold_heads(x)

    return ReferencePass(ref.logprobs, fold(ref.last_attention), fold(ref.attention), fold(ref.key_norm),
                         rows=None if ref.rows is None else ref.rows.fold())


def kept_count(keep_last: torch.Tensor) -> torch.Tensor:
    """[B] float32 keys the target's query read: keep_last [B, T] summed, or [B, Hkv, T] summed and
    averaged over key/value heads (mean kept per head)."""
    counts = keep_last.sum(-1).float()  # [B] or [B, Hkv]
    return counts.mean(-1) if keep_last.dim() == 3 else counts


def evicted_mass(last_attention: torch.Tensor, keep_last: torch.Tensor) -> torch.Tensor:
    """[B] attention probability mass of the full-context target query on the keys it did not read.

    Args:
        last_attention: [B, T] (mean over layers and heads) or [B, Hkv, T] (per key/value head:
            mean over layers and the group's query heads).
        keep_last: [B, T] or [B, Hkv, T] bool (per-head keys broadcast against head-averaged attention
            only if ``last_attention`` has no heads dimension).

    Returns:
        [B] float32: ``Σ_j a_j (1 - keep_j)``, per head then averaged over key/value heads (equal
        to the mean over all query heads, as every group has H / Hkv of them).
    """
    lost = (last_attention * (~keep_last).float()).sum(-1)  # [B] or [B, Hkv]
    return lost.mean(-1) if lost.dim() == 2 else lost
