"""Streaming semantics: every token was processed when the cache held only its policy's kept keys.

With original positions this is exact in one parallel forward pass: a 4D float mask gives each
query row its own kept set (0 keep, -inf drop, ``log(1/π)`` Hájek offset), and since row q of every
layer reads only the keys row q's policy kept, every token's hidden states equal those it would
have had when processed one at a time against its evicted cache (research/method.md section C.2).
:func:`streaming_logprobs_loop` is that one-at-a-time process, kept as the naive reference for tests
and the benchmark.
"""

from __future__ import annotations

import torch

from truncsens.engine import kvcache
from truncsens.engine.masks import additive_mask, streaming_mask
from truncsens.engine.reencode import NonFiniteLogitsError


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    if not torch.isfinite(logits).all():
        raise NonFiniteLogitsError("the model produced non-finite logits (NaN/inf); try --dtype float32, or check the checkpoint")
    return torch.log_softmax(logits, dim=-1)


def model_dtype(model) -> torch.dtype:
    """The dtype of the model's parameters (the attention mask must match it)."""
    return next(model.parameters()).dtype


@torch.no_grad()
def streaming_logprobs(model, input_ids: torch.Tensor, keep: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Next-token log-probabilities after the last token, streaming semantics, one forward pass.

    Args:
        model: transformers causal LM whose attention adds a 4D float mask (eager or sdpa).
        input_ids: [B, T] int64; positions are the original 0..T-1.
        keep: [B, T, T] bool, row q = keys kept for query q (causal; q itself kept).
        offset: [B, T, T] float logit offsets of kept keys, or None.

    Returns:
        [B, V] float32 log-softmax at position T - 1.

    Raises:
        ValueError: a non-causal or empty row; NonFiniteLogitsError: NaN/inf logits.
    """
    B, T = input_ids.shape
    mask = streaming_mask(keep, offset, model_dtype(model))  # [B, 1, T, T]
    pos = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
    return _logprobs(out.logits[:, -1, :])  # [B, V]


@torch.no_grad()
def streaming_logprobs_loop(model, input_ids: torch.Tensor, keep: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """The naive reference of :func:`streaming_logprobs`: token by token, rebuilding the cache at every step.

    For each sequence and each step q: a fresh cache is built from the stored keys/values (of every
    layer) of the tokens kept for q, token q is run alone against it with position id q (and the
    offsets of its kept keys as a [1, 1, 1, k] mask), and its new keys/values are stored. Slow
    (T forward passes per sequence); for tests and the benchmark.

    Args/Returns: as :func:`streaming_logprobs`.
    """
    B, T = input_ids.shape
    dtype = model_dtype(model)
    kw = kvcache.cache_keyword(model)
    rows = []
    for b in range(B):
        keys: list[torch.Tensor] = []  # per layer [1, H_kv, T, d]: row q holds token q's key once processed
        values: list[torch.Tensor] = []
        logits = None
        for q in range(T):
            earlier = keep[b, q, :q].nonzero().flatten()  # [k-1] kept earlier keys
            cache = kvcache.new_cache(model)
            if earlier.numel():
                for layer in range(len(keys)):
                    cache.update(keys[layer].index_select(2, earlier), values[layer].index_select(2, earlier), layer)
            cols = torch.cat([earlier, torch.tensor([q], device=earlier.device)])  # [k]
            off = offset[b, q, cols] if offset is not None else None  # [k]
            mask = additive_mask(torch.ones(1, 1, cols.numel(), dtype=torch.bool, device=input_ids.device),
                                 off.view(1, 1, -1) if off is not None else None, dtype)  # [1, 1, 1, k]
            out = model(input_ids=input_ids[b : b + 1, q : q + 1], position_ids=torch.tensor([[q]], device=input_ids.device),
                        attention_mask=mask, use_cache=True, logits_to_keep=1, **{kw: cache})
            for layer in range(kvcache.n_layers(cache)):
                k_new, v_new = kvcache.layer_kv(cache, layer)  # [1, H_kv, k, d], the new token last
                if len(keys) <= layer:
                    keys.append(k_new.new_zeros(1, k_new.shape[1], T, k_new.shape[3]))
                    values.append(v_new.new_zeros(1, v_new.shape[1], T, v_new.shape[3]))
                keys[layer][:, :, q] = k_new[:, :, -1]
                values[layer][:, :, q] = v_new[:, :, -1]
            logits = out.logits[:, -1, :]
        rows.append(_logprobs(logits))
    return torch.cat(rows)  # [B, V]
