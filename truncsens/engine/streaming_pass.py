"""Streaming runs of a policy: one cache that evicts as it goes (:mod:`truncsens.policies.streaming`).

Two exact ways to run the same decisions, chosen by what the policy reads:

- a policy that needs no scores (``suffix``, ``sink_recent``, ``random``) decides without the model:
  its eviction steps are computed first, and the model runs once over the whole context with a 4D
  mask in which row q reads the keys j with ``j <= q < evict_j`` (the one-pass forward of
  :class:`truncsens.engine.semantics.Streaming`);
- a policy with online scores (``h2o``, ``tova``, ``key_norm``, ``poisson``) runs sequentially, chunk
  by chunk, with a batched cache that evicts: evicted keys are masked with ``-inf`` (zero weight, exact)
  and, once dead slots outnumber the cached keys (plus 32), every sequence's cache is compacted to its
  cached keys (``kvcache.gather_slots``; sequences that cache fewer keys than others keep dead slots),
  so the cache holds O(k + C) slots; then the chunk's tokens are appended,
  each query reading the cached keys (with their Hájek offsets) and the chunk's tokens up to itself,
  within each layer's window on original positions
  (:func:`truncsens.engine.layer_windows.kept_attention_mask`). Models that apply their windows on
  cache indices (GPT-Neo) keep every slot instead, so indices stay positions. The statistics the
  policy reads are those of this run: attention probabilities from the attention modules (eager
  attention, forward hooks) and the norms of the new keys in the cache.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs, model_dtype
from truncsens.engine.layer_windows import kept_attention_mask
from truncsens.engine.reference_pass import AttentionCollector, eager_attention
from truncsens.policies import Policy
from truncsens.policies.streaming import ChunkStats, Evictions, run_stream

ATTENTION_KINDS = ("attention", "last_attention")


def decide_offline(policy: Policy, budget: int, context_len: int, chunk: int, seeds: Sequence[int],
                   device: torch.device | str) -> Evictions:
    """Eviction steps of a policy that reads no scores (no model run)."""
    return run_stream(policy, budget, context_len, chunk, seeds, lambda s, e, alive, offset: ChunkStats(), device)


@torch.no_grad()
def stream_online(model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int], chunk: int,
                  windows, slack: int = 32) -> tuple[torch.Tensor, Evictions]:
    """Run ``policy`` over ``input_ids`` [B, T] sequentially in chunks of ``chunk`` tokens.

    Args:
        model: transformers causal LM; windows: its :class:`~truncsens.engine.layer_windows.LayerWindows`.
        policy: a policy with online scores; budget: k; seeds: one per sequence.
        slack: the cache is compacted once it holds more than ``2·(cached keys) + slack`` slots.

    Returns:
        (log-probabilities [B, V] float64 after the last token, :class:`Evictions`).

    Raises:
        PolicyError: see :func:`~truncsens.policies.streaming.run_stream`.
        NonFiniteLogitsError: NaN or infinite logits.
    """
    B, T = input_ids.shape
    device = input_ids.device
    kind = policy.score_kind()
    cache = kvcache.new_full_cache(model) if windows.windowed else kvcache.new_cache(model)
    kw = kvcache.cache_keyword(model)
    dtype = model_dtype(model)
    collector = AttentionCollector(model) if kind in ATTENTION_KINDS else None
    compact = not windows.applies_own  # GPT-Neo applies its windows on cache indices: keep every slot
    state = {"slots": torch.zeros(B, 0, dtype=torch.long, device=device)}  # [B, L] position of each slot, -1: dead
    result: dict[str, torch.Tensor] = {}

    def observe(s: int, e: int, alive: torch.Tensor, offset: torch.Tensor) -> ChunkStats:
        c = e - s
        slots = state["slots"]  # [B, L]
        live = (slots >= 0) & alive.gather(1, slots.clamp(min=0))  # [B, L] slots whose key is still cached
        n = int(live.sum(1).max()) if slots.shape[1] else 0
        if compact and slots.shape[1] > 2 * n + slack:  # compaction is amortized: dead slots are masked until then
            index = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, :n]  # [B, n] live slots first, in order
            kvcache.gather_slots(cache, index)
            live = live.gather(1, index)  # [B, n]
            slots = torch.where(live, slots.gather(1, index), torch.full_like(index, -1))
        chunk_pos = torch.arange(s, e, device=device).expand(B, c)  # [B, c]
        slots = torch.cat([slots, chunk_pos], 1)  # [B, L + c]
        live = torch.cat([live, torch.ones(B, c, dtype=torch.bool, device=device)], 1)  # [B, L + c]
        state["slots"] = slots
        k_pos = slots.clamp(min=0)  # [B, L + c]
        keep = live.unsqueeze(1) & (k_pos.unsqueeze(1) <= chunk_pos.unsqueeze(-1))  # [B, c, L + c]
        off = offset.gather(1, k_pos).unsqueeze(1).expand(keep.shape)  # [B, c, L + c]
        mask = kept_attention_mask(windows, keep, off, chunk_pos, k_pos, dtype)
        with collector.collect() if collector else contextlib.nullcontext():
            out = model(input_ids=input_ids[:, s:e], position_ids=chunk_pos, attention_mask=mask, use_cache=True,
                        logits_to_keep=1, **{kw: cache})
        if e == T:
            result["logprobs"] = last_logprobs(out.logits[:, -1, :])  # [B, V]
            return ChunkStats()
        stats = ChunkStats()
        if collector:
            by_slot = collector.mean() * live.unsqueeze(1)  # [B, c, L + c]
            stats.attention = torch.zeros(B, c, e, device=device).scatter_add_(
                2, k_pos.unsqueeze(1).expand(by_slot.shape), by_slot)  # [B, c, e] by position
        if kind == "key_norm":
            norms = [kvcache.layer_kv(cache, layer)[0][:, :, -c:].float().norm(dim=-1).mean(1)
                     for layer in range(kvcache.n_layers(cache))]  # [B, c] each
            stats.key_norm = torch.stack(norms).mean(0)  # [B, c]
        return stats

    with eager_attention(model) if collector else contextlib.nullcontext():
        evictions = run_stream(policy, budget, T, chunk, seeds, observe, device)
    return result["logprobs"], evictions
