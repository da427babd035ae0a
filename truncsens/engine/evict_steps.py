"""What both backends of attention from eviction steps share (:mod:`truncsens.engine.evict_attention`,
:mod:`truncsens.engine.evict_flex`): the error they raise, the check of the eviction tensors, and the
expansion of per-key/value-head rows to query heads."""

from __future__ import annotations

import torch


class EvictAttentionError(ValueError):
    """Attention from eviction steps cannot run as asked (shapes, dropout, a model it cannot reach)."""


def check_evictions(evict: torch.Tensor, offset: torch.Tensor, n_keys: int, n_kv_heads: int) -> None:
    """Raise :class:`EvictAttentionError` unless ``evict`` (int) and ``offset`` (float) are both [B, T] or
    both [B, Hkv, T] with T = ``n_keys`` and Hkv = ``n_kv_heads``."""
    if evict.shape != offset.shape:
        raise EvictAttentionError(f"evict {tuple(evict.shape)} and offset {tuple(offset.shape)} differ in shape")
    if evict.dim() not in (2, 3) or evict.shape[-1] != n_keys or (evict.dim() == 3 and evict.shape[1] != n_kv_heads):
        raise EvictAttentionError(f"evict must be [B, {n_keys}] or [B, {n_kv_heads}, {n_keys}] (B, key/value heads, "
                                  f"keys), got {tuple(evict.shape)}")
    if evict.dtype.is_floating_point or evict.dtype == torch.bool:
        raise EvictAttentionError(f"evict must hold integer eviction steps, got {evict.dtype}")


def head_rows(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, T] -> [B, 1, T]; [B, Hkv, T] -> [B, Hkv·groups, T] (query heads of a group share a row)."""
    return t.unsqueeze(1) if t.dim() == 2 else t.repeat_interleave(groups, dim=1)
