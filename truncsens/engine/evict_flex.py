"""Attention from eviction steps with FlexAttention (arXiv 2412.05496): the CUDA backend of
:mod:`truncsens.engine.evict_attention` (uncompiled it also runs on CPU, which the tests use to check
it against the dense mask)."""

from __future__ import annotations

import functools

import torch

from truncsens.engine.evict_steps import EvictAttentionError, check_evictions


def flex_available() -> bool:
    """Whether the installed torch has FlexAttention (:mod:`torch.nn.attention.flex_attention`)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    except ModuleNotFoundError:  # no torch.nn.attention at all
        return False


@functools.lru_cache(maxsize=2)
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def flex_evict_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, evict: torch.Tensor,
                         offset: torch.Tensor, scaling: float | None, window: int | None = None,
                         compiled: bool | None = None, plans: dict | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """The same attention as :func:`chunked_attention` with FlexAttention (arXiv 2412.05496): a block
    mask from ``mask_mod`` and the offsets in ``score_mod``.

    Args:
        query, key, value, evict, offset, scaling, window: as in :func:`chunked_attention`.
        compiled: run ``torch.compile(flex_attention)`` (default: on CUDA only; uncompiled flex
            materializes the scores and is for checking only).
        plans: a dict that lives for one forward call (as in :func:`chunked_attention`): the block
            mask built for one layer is kept there (keyed by window, Tq and heads) and reused by the
            other layers, which read the same eviction steps.
        softcap: attention-logit soft-capping (applied in ``score_mod``); learned sinks are not
            supported here (:func:`evict_attention_forward` takes the chunked backend for them).

    Returns:
        [B, H, Tq, Dv] (value [B, Hkv, Tk, Dv] may be narrower or wider than the keys).

    Raises:
        EvictAttentionError: bad shapes, or torch without FlexAttention.
    """
    if not flex_available():
        raise EvictAttentionError(f"torch {torch.__version__} has no torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, Tq, D = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
    check_evictions(evict, offset, Tk, Hkv)
    groups = H // Hkv
    first = Tk - Tq
    per_head = evict.dim() == 3
    off = offset.to(torch.float32)

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + first
        step = evict[b, h // groups, kv_idx] if per_head else evict[b, kv_idx]
        keep = (kv_idx <= q) & (q < step)
        return keep & (q - kv_idx < window) if window is not None else keep

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:  # soft-capping applies to the logit before the mask's offset
            score = torch.tanh(score / softcap) * softcap
        return score + (off[b, h // groups, kv_idx] if per_head else off[b, kv_idx])

    compiled = query.is_cuda if compiled is None else compiled
    key_ = ("flex", window, Tq, H if per_head else None)
    block_mask = plans.get(key_) if plans is not None else None
    if block_mask is None:
        # compiled, the block mask is built block by block; uncompiled it evaluates mask_mod on all Tq x Tk pairs
        block_mask = create_block_mask(mask_mod, B, H if per_head else None, Tq, Tk, device=query.device,
                                       _compile=compiled)
        if plans is not None:
            plans[key_] = block_mask
    return _flex(compiled)(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
                           enable_gqa=groups > 1)
