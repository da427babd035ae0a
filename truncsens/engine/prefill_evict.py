"""Prefill-evict semantics: keys and values computed with the full context, then evicted before the
target's query reads them (the kvpress convention; research/method.md section C.3).

Three equal ways to compute it, all in this module:

- :func:`prefill_evict_logprobs` (what runs): decode the last token against the full-context cache
  of the first T - 1 tokens (from :func:`truncsens.engine.reference_pass.reference_pass`) with a
  [B, 1, 1, T] float mask that drops the evicted keys; the cache is truncated back afterwards, so
  one prefill serves every (policy, budget);
- :func:`prefill_evict_masked_logprobs`: one forward over all T tokens with a 4D mask whose rows are
  full causal except the last (earlier tokens' hidden states are then exactly the full-context
  ones, so this is prefill-evict too);
- :func:`prefill_evict_surgery_logprobs`: the naive reference: full prefill, index-select the kept
  keys/values of every layer into a new cache, run the last token against it.
"""

from __future__ import annotations

import torch

from truncsens.engine import kvcache
from truncsens.engine.masks import additive_mask, prefill_evict_mask
from truncsens.engine.streaming import _logprobs, model_dtype


@torch.no_grad()
def prefill_evict_logprobs(model, cache, input_ids: torch.Tensor, keep_last: torch.Tensor,
                           offset_last: torch.Tensor | None) -> torch.Tensor:
    """Decode the last token against the full-context cache with evicted keys masked out.

    Args:
        model: transformers causal LM.
        cache: key/value cache of ``input_ids[:, :T-1]`` (full context), left unchanged on return.
        input_ids: [B, T] int64 (only the last column is read).
        keep_last: [B, T] bool keys kept for the last query (column T - 1, its own key, must be kept).
        offset_last: [B, T] float offsets of kept keys, or None.

    Returns:
        [B, V] float32 log-softmax at position T - 1.
    """
    B, T = input_ids.shape
    mask = additive_mask(keep_last.unsqueeze(1), offset_last.unsqueeze(1) if offset_last is not None else None,
                         model_dtype(model))  # [B, 1, 1, T]
    pos = torch.full((B, 1), T - 1, dtype=torch.long, device=input_ids.device)  # [B, 1]
    try:
        out = model(input_ids=input_ids[:, T - 1 :], position_ids=pos, attention_mask=mask, use_cache=True,
                    logits_to_keep=1, **{kvcache.cache_keyword(model): cache})
    finally:
        kvcache.truncate(cache, T - 1)
    return _logprobs(out.logits[:, -1, :])


@torch.no_grad()
def prefill_evict_masked_logprobs(model, input_ids: torch.Tensor, keep_last: torch.Tensor,
                                  offset_last: torch.Tensor | None) -> torch.Tensor:
    """Prefill-evict in one forward pass with a 4D mask (all rows causal, the last row evicted).

    Args/Returns: as :func:`prefill_evict_logprobs`, without a cache.
    """
    B, T = input_ids.shape
    mask = prefill_evict_mask(keep_last, offset_last, model_dtype(model))  # [B, 1, T, T]
    pos = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
    return _logprobs(out.logits[:, -1, :])


@torch.no_grad()
def prefill_evict_surgery_logprobs(model, input_ids: torch.Tensor, keep_last: torch.Tensor,
                                   offset_last: torch.Tensor | None) -> torch.Tensor:
    """Naive reference: per sequence, full prefill of T - 1 tokens, keep only the kept keys/values
    of every layer (index_select into a new cache), then run the last token against it.

    Args/Returns: as :func:`prefill_evict_logprobs`, without a cache.
    """
    B, T = input_ids.shape
    kw = kvcache.cache_keyword(model)
    rows = []
    for b in range(B):
        full = kvcache.new_cache(model)
        ids = input_ids[b : b + 1]  # [1, T]
        model(input_ids=ids[:, : T - 1], position_ids=torch.arange(T - 1, device=ids.device).unsqueeze(0),
              attention_mask=torch.ones_like(ids[:, : T - 1]), use_cache=True, logits_to_keep=1, **{kw: full})
        earlier = keep_last[b, : T - 1].nonzero().flatten()  # [k-1]
        pruned = kvcache.select(model, full, earlier)
        cols = torch.cat([earlier, torch.tensor([T - 1], device=ids.device)])  # [k]
        off = offset_last[b, cols].view(1, 1, -1) if offset_last is not None else None  # [1, 1, k]
        mask = additive_mask(torch.ones(1, 1, cols.numel(), dtype=torch.bool, device=ids.device), off, model_dtype(model))
        out = model(input_ids=ids[:, T - 1 :], position_ids=torch.tensor([[T - 1]], device=ids.device),
                    attention_mask=mask, use_cache=True, logits_to_keep=1, **{kw: pruned})
        rows.append(_logprobs(out.logits[:, -1, :]))
    return torch.cat(rows)
