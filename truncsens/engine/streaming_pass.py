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
  (:func:`truncsens.engine.attention_windows.kept_attention_mask`). Models that apply their windows on
  cache indices (GPT-Neo) keep every slot instead, so indices stay positions. The statistics the
  policy reads are those of this run: attention probabilities from the attention modules (eager
  attention, forward hooks) and the norms of the new keys in the cache. The decisions are taken by
  :func:`truncsens.policies.live_stream.run_live_stream`, which holds the stream's state per cache
  slot and decides when to compact (the same slots as the cache): the policy sees the cached keys
  and the chunk only, and ``observe`` returns the chunk's attention per slot, so a token step costs
  O(k + C) whatever the context.

Head granularity (``heads=Hkv``): the policy runs on B·Hkv rows (sequence, key/value head), each
with its own kept set; the cache is shared by the heads of a sequence, each head's evicted keys are
masked with ``-inf`` in a [B, H, c, L + c] mask (query heads of a group read their KV head's set),
and a slot is compacted away once it is dead in every head of its sequence.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs, rows_logprobs, model_dtype
from truncsens.engine.attention_windows import kept_attention_mask
from truncsens.engine.reference_pass import AttentionCollector, eager_attention
from truncsens.policies import Policy
from truncsens.policies.live_stream import LiveChunk, run_live_stream
from truncsens.policies.streaming import ChunkStats, Evictions, run_stream

ONLINE_ATTENTION_KINDS = ("attention", "last_attention")  # score kinds read from the run's own attention


def decide_offline(policy: Policy, budget: int, context_len: int, chunk: int, seeds: Sequence[int],
                   device: torch.device | str) -> Evictions:
    """Eviction steps of a policy that reads no scores (no model run): in closed form when the policy
    has one (:meth:`~truncsens.policies.base.Policy.eviction_steps`: O(T) for suffix and sink_recent,
    O(T log k) for random), else by :func:`~truncsens.policies.streaming.run_stream` (O(T) per step,
    no model).

    Returns:
        :class:`Evictions` with evict and offset [B, T] (B = ``len(seeds)``).

    Raises:
        PolicyError: a bad budget or chunk.
    """
    policy.check(budget, context_len)
    steps = policy.eviction_steps(budget, context_len, chunk, seeds, device)  # [B, T] or None
    if steps is not None:
        return Evictions(steps, torch.zeros(steps.shape, dtype=torch.float32, device=device))
    return run_stream(policy, budget, context_len, chunk, seeds, lambda s, e, alive, offset: ChunkStats(), device)


@torch.no_grad()
def stream_online(model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int], chunk: int,
                  windows, slack: int = 32, heads: int | None = None, groups: int = 1,
                  keep: int = 1) -> tuple[torch.Tensor, Evictions]:
    """Run ``policy`` over ``input_ids`` [B, T] sequentially in chunks of ``chunk`` tokens.

    Args:
        model: transformers causal LM; windows: its :class:`~truncsens.engine.attention_windows.LayerWindows`.
        policy: a policy with online scores; budget: k (per key/value head under head granularity);
        seeds: one per row: B sequences, or B·Hkv (sequence, KV head) rows in the order of
            :func:`~truncsens.policies.base.head_seeds` when ``heads`` is set.
        slack: the cache is compacted once it holds more than ``2·(cached keys) + slack`` slots.
        heads: None (one kept set per sequence) or Hkv (head granularity: one per key/value head,
            statistics per KV head: attention mean over layers and the group's query heads, key
            norms mean over layers); groups: query heads per KV head (H / Hkv).
        keep: 1 (the target's query only) or k > 1: the log-probabilities after each of the last k
            tokens of this one run (the block protocol, :mod:`truncsens.engine.block.policies`; with
            ``chunk`` 1, row q is what a run over the prefix x[0..q] gives).

    Returns:
        (log-probabilities [B, V] float64 after the last token ([B, keep, V] after the last ``keep``
        tokens when keep > 1), :class:`Evictions` with evict [B, T], or [B, Hkv, T] under head granularity).

    Raises:
        PolicyError: see :func:`~truncsens.policies.live_stream.run_live_stream`.
        NonFiniteLogitsError: NaN or infinite logits.
    """
    B, T = input_ids.shape
    n_last = keep  # (``keep`` is a mask inside observe)
    Hh = heads or 1  # kept sets per sequence
    device = input_ids.device
    kind = policy.score_kind()
    cache = kvcache.new_full_cache(model) if windows.windowed else kvcache.new_cache(model)
    kw = kvcache.cache_keyword(model)
    dtype = model_dtype(model)
    collector = AttentionCollector(model, heads) if kind in ONLINE_ATTENTION_KINDS else None
    result: dict[str, torch.Tensor] = {}

    def observe(s: int, e: int, live: LiveChunk) -> ChunkStats:
        c = e - s
        if live.index is not None:  # the driver dropped dead slots: the same gather on the cache
            kvcache.gather_slots(cache, live.index)
        k_pos = live.positions  # [B, L + c] position of each slot, the chunk's last
        alive = live.alive.view(B, Hh, -1)  # [B·Hh, L + c] -> [B, Hh, L + c]
        chunk_pos = torch.arange(s, e, device=device).expand(B, c)  # [B, c]
        causal = k_pos.unsqueeze(1) <= chunk_pos.unsqueeze(-1)  # [B, c, L + c]
        keep = alive.unsqueeze(2) & causal.unsqueeze(1)  # [B, Hh, c, L + c]
        off = live.offset.view(B, Hh, 1, -1).expand(keep.shape)  # [B, Hh, c, L + c]
        if heads is None:
            mask = kept_attention_mask(windows, keep[:, 0], off[:, 0], chunk_pos, k_pos, dtype)
        else:
            mask = kept_attention_mask(windows, keep, off, chunk_pos, k_pos, dtype, groups)
        rows = e - max(s, T - n_last)  # the chunk's positions among the last ``keep`` ones
        with collector.collect() if collector else contextlib.nullcontext():
            out = model(input_ids=input_ids[:, s:e], position_ids=chunk_pos, attention_mask=mask, use_cache=True,
                        logits_to_keep=max(1, rows), **{kw: cache})
        if n_last > 1 and rows > 0:
            result.setdefault("rows", []).append(rows_logprobs(out.logits, rows))  # [B, rows, V]
        if e == T:
            result["logprobs"] = last_logprobs(out.logits[:, -1, :])  # [B, V]
            return ChunkStats()
        stats = ChunkStats()
        if collector:
            att = collector.mean()  # [B, c, L + c], or [B, Hkv, c, L + c] per head
            by_slot = att.view(B, Hh, c, -1) * alive.unsqueeze(2)  # [B, Hh, c, L + c], 0 on dead slots
            stats.attention = by_slot.view(B * Hh, c, -1)  # [B·Hh, c, L + c] per slot
        if kind == "key_norm":
            norms = [kvcache.layer_kv(cache, layer)[0][:, :, -c:].float().norm(dim=-1)
                     for layer in range(kvcache.n_layers(cache))]  # [B, Hkv, c] each
            mean = torch.stack(norms).mean(0)  # [B, Hkv, c]
            stats.key_norm = mean.reshape(B * Hh, c) if heads else mean.mean(1)  # [B·Hkv, c] or [B, c]
        return stats

    compact = not windows.applies_own  # GPT-Neo applies its windows on cache indices: keep every slot
    with eager_attention(model) if collector else contextlib.nullcontext():
        evictions = run_live_stream(policy, budget, T, chunk, seeds, observe, device, Hh, slack if compact else None)
    if heads:
        evictions = evictions.unfold(heads)
    if n_last > 1:
        return torch.cat(result["rows"], 1), evictions  # [B, keep, V]
    return result["logprobs"], evictions
