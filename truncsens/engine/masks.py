"""4D float attention masks from policy decisions (streaming and prefill-evict semantics).

transformers (>= 4.48, checked on 5.x) passes a 4D ``attention_mask`` of shape
``[B, 1, Tq, Tk]`` through unchanged (``masking_utils._preprocess_mask_arguments`` treats it as
already prepared) and both the ``eager`` and ``sdpa`` attention functions add a float mask to the
attention scores before the softmax. So one forward pass with such a mask gives every query its own
kept set: 0 on kept keys, the dtype's minimum on dropped keys (:func:`masked_value`; zero weight),
``log(1/π)`` (Hájek offset, arXiv 2607.21475) on randomly kept keys. Every query row must keep at
least one key (its own): the engine refuses a row that keeps none.

Such a mask replaces the model's own sliding-window mask, so for a model with windowed layers
(:mod:`truncsens.engine.attention_windows`) the window is put into it: :func:`within_window` keeps a key
only if ``q - j < W`` (transformers' ``sliding_window_overlay``), and :func:`layer_masks` builds one
mask per layer type (transformers 5.x models with ``config.layer_types`` take them as a dict).

These masks are O(T^2) in memory. Streaming decisions given as eviction steps
(:class:`truncsens.policies.streaming.Evictions`) do not need them: the one-pass streaming forward
computes attention from the steps directly (:mod:`truncsens.engine.evict_attention`, memory linear in T).
"""

from __future__ import annotations

import torch


def masked_value(dtype: torch.dtype) -> float:
    """The additive mask value of a dropped key: the dtype's most negative finite number, as
    transformers' own masks use (``torch.finfo(dtype).min``). Its softmax weight is exactly 0 next
    to any kept key, and a row whose keys were all dropped gives a finite (uniform) row instead of the
    NaN that ``-inf`` gives in some kernels; the engine refuses such rows before they reach a model."""
    return torch.finfo(dtype).min


def additive_mask(keep: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask from kept keys and offsets.

    Args:
        keep: [B, Tq, Tk] bool.
        offset: [B, Tq, Tk] float offsets of kept keys, or None for zeros.
        dtype: the model's compute dtype (sdpa needs the mask in the query dtype).

    Returns:
        [B, 1, Tq, Tk] tensor of ``dtype``: ``offset`` where kept, the dtype's minimum elsewhere
        (:func:`masked_value`).

    Raises:
        ValueError: a query row keeps no key.
    """
    if not keep.any(-1).all():
        raise ValueError("a query keeps no key at all; every query must keep at least its own token")
    values = offset.to(dtype) if offset is not None else torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    mask = torch.where(keep, values, torch.full_like(values, masked_value(dtype)))  # [B, Tq, Tk]
    return mask.unsqueeze(1)  # [B, 1, Tq, Tk]


def streaming_mask(keep: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Streaming semantics: every query row reads its own policy-kept keys.

    Args:
        keep: [B, T, T] bool, row q = keys kept when token q was processed (j <= q only).
        offset: [B, T, T] float or None.

    Returns:
        [B, 1, T, T] additive mask.

    Raises:
        ValueError: a key after its query is marked kept (not causal), or a row keeps nothing.
    """
    check_causal(keep)
    return additive_mask(keep, offset, dtype)


def check_causal(keep: torch.Tensor) -> None:
    """Raise ValueError when ``keep`` [B, T, T] marks a key after its query as kept."""
    T = keep.shape[-1]
    if (keep & ~torch.ones(T, T, dtype=torch.bool, device=keep.device).tril()).any():
        raise ValueError("streaming mask is not causal: a query keeps a later key")


def within_window(keep: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Kept keys a layer of attention window ``window`` can read: ``keep`` and ``q - j < window`` on
    positions (transformers ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``).

    Args:
        keep: [B, Tq, Tk] bool.
        q_pos: [B, Tq] int64 positions of the queries; k_pos: [B, Tk] int64 positions of the keys.
        window: W in tokens, or None (full attention: ``keep`` unchanged).

    Returns:
        [B, Tq, Tk] bool.
    """
    if window is None:
        return keep
    distance = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # [B, Tq, Tk]
    return keep & (distance < window)


def layer_masks(keep: torch.Tensor, offset: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
                windows: dict[str, int | None], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One additive mask per layer type: the kept keys within that type's window.

    Args:
        keep, offset: [B, Tq, Tk] (see :func:`additive_mask`).
        q_pos, k_pos: [B, Tq], [B, Tk] int64 positions.
        windows: layer type -> window (None: full attention).

    Returns:
        layer type -> [B, 1, Tq, Tk] tensor of ``dtype``.

    Raises:
        ValueError: a query row keeps no key within some window.
    """
    return {t: additive_mask(within_window(keep, q_pos, k_pos, w), offset, dtype) for t, w in windows.items()}
