"""4D float attention masks from policy decisions.

transformers (>= 4.48, checked on 5.x) passes a 4D ``attention_mask`` of shape
``[B, 1, Tq, Tk]`` through unchanged (``masking_utils._preprocess_mask_arguments`` treats it as
already prepared) and both the ``eager`` and ``sdpa`` attention functions add a float mask to the
attention scores before the softmax. So one forward pass with such a mask gives every query its own
kept set: 0 on kept keys, ``-inf`` on dropped keys, ``log(1/π)`` (Hájek offset, arXiv 2607.21475)
on randomly kept keys. Every query row must keep at least one key (its own), or softmax gives NaN.
"""

from __future__ import annotations

import torch


def additive_mask(keep: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask from kept keys and offsets.

    Args:
        keep: [B, Tq, Tk] bool.
        offset: [B, Tq, Tk] float offsets of kept keys, or None for zeros.
        dtype: the model's compute dtype (sdpa needs the mask in the query dtype).

    Returns:
        [B, 1, Tq, Tk] tensor of ``dtype``: ``offset`` where kept, ``-inf`` elsewhere.

    Raises:
        ValueError: a query row keeps no key.
    """
    if not keep.any(-1).all():
        raise ValueError("a query keeps no key at all; every query must keep at least its own token")
    values = offset.to(dtype) if offset is not None else torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    mask = torch.where(keep, values, torch.full_like(values, float("-inf")))  # [B, Tq, Tk]
    return mask.unsqueeze(1)  # [B, 1, Tq, Tk]


def causal_keep(length: int, batch: int, device: torch.device | str) -> torch.Tensor:
    """[B, T, T] bool lower-triangular: every query keeps its full causal past."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril().unsqueeze(0).expand(batch, length, length)


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
    T = keep.shape[-1]
    if (keep & ~torch.ones(T, T, dtype=torch.bool, device=keep.device).tril()).any():
        raise ValueError("streaming mask is not causal: a query keeps a later key")
    return additive_mask(keep, offset, dtype)


def prefill_evict_mask(keep_last: torch.Tensor, offset_last: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Prefill-evict semantics in one forward: every row full causal except the last (the target's
    query), which reads only its kept keys.

    With this mask the hidden states of all earlier tokens are exactly the full-context ones (their
    rows are unmasked), so the keys and values the last query reads are the full-prefill keys and
    values of the kept tokens: one forward equals "prefill everything, evict, then decode".

    Args:
        keep_last: [B, T] bool, keys kept for the last query (its own key included).
        offset_last: [B, T] float or None.

    Returns:
        [B, 1, T, T] additive mask.
    """
    B, T = keep_last.shape
    keep = causal_keep(T, B, keep_last.device).clone()  # [B, T, T]
    keep[:, -1, :] = keep_last
    offset = None
    if offset_last is not None:
        offset = torch.zeros(B, T, T, dtype=offset_last.dtype, device=offset_last.device)
        offset[:, -1, :] = offset_last
    return additive_mask(keep, offset, dtype)
