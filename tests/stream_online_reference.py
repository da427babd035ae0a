"""The streaming pass with online scores before its state was held per live slot, kept as the
reference the engine is held to (tests/test_streaming_live.py): the driver
(:func:`truncsens.policies.streaming.run_stream`) keeps every per-key tensor over all positions
0..e-1, the policy decides over every position, and ``observe`` scatters each chunk's attention from
cache slots back to positions ([B, Hh, c, e]). O(T) per token step, otherwise the same run; not an
oracle (it shares the model plumbing and the policies with the engine).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from truncsens.engine import kvcache
from truncsens.engine.attention_windows import kept_attention_mask
from truncsens.engine.forward import last_logprobs, model_dtype, rows_logprobs
from truncsens.engine.reference_pass import AttentionCollector, eager_attention
from truncsens.policies import Policy
from truncsens.policies.streaming import ChunkStats, Evictions, run_stream

ONLINE_ATTENTION_KINDS = ("attention", "last_attention")


@torch.no_grad()
def reference_stream_online(model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int], chunk: int,
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
        PolicyError: see :func:`~truncsens.policies.streaming.run_stream`.
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
    compact = not windows.applies_own  # GPT-Neo applies its windows on cache indices: keep every slot
    state = {"slots": torch.zeros(B, 0, dtype=torch.long, device=device)}  # [B, L] position of each slot, -1: dead
    result: dict[str, torch.Tensor] = {}

    def observe(s: int, e: int, alive: torch.Tensor, offset: torch.Tensor) -> ChunkStats:
        c = e - s
        alive, offset = alive.view(B, Hh, e), offset.view(B, Hh, e)  # [B·Hh, e] -> [B, Hh, e]
        slots = state["slots"]  # [B, L]
        L = slots.shape[1]
        live = (slots >= 0).unsqueeze(1) & alive.gather(2, slots.clamp(min=0).unsqueeze(1).expand(B, Hh, L))  # [B, Hh, L]
        anywhere = live.any(1)  # [B, L] slots whose key is still cached in some head
        n = int(anywhere.sum(1).max()) if L else 0
        if compact and L > 2 * n + slack:  # compaction is amortized: dead slots are masked until then
            index = torch.argsort((~anywhere).to(torch.int8), dim=1, stable=True)[:, :n]  # [B, n] live slots first, in order
            kvcache.gather_slots(cache, index)
            live = live.gather(2, index.unsqueeze(1).expand(B, Hh, n))  # [B, Hh, n]
            slots = torch.where(anywhere.gather(1, index), slots.gather(1, index), torch.full_like(index, -1))
        chunk_pos = torch.arange(s, e, device=device).expand(B, c)  # [B, c]
        slots = torch.cat([slots, chunk_pos], 1)  # [B, L + c]
        live = torch.cat([live, torch.ones(B, Hh, c, dtype=torch.bool, device=device)], 2)  # [B, Hh, L + c]
        state["slots"] = slots
        k_pos = slots.clamp(min=0)  # [B, L + c]
        causal = k_pos.unsqueeze(1) <= chunk_pos.unsqueeze(-1)  # [B, c, L + c]
        keep = live.unsqueeze(2) & causal.unsqueeze(1)  # [B, Hh, c, L + c]
        off = offset.gather(2, k_pos.unsqueeze(1).expand(live.shape)).unsqueeze(2).expand(keep.shape)  # [B, Hh, c, L + c]
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
            by_slot = att.view(B, Hh, c, -1) * live.unsqueeze(2)  # [B, Hh, c, L + c]
            by_pos = torch.zeros(B, Hh, c, e, device=device).scatter_add_(
                3, k_pos.view(B, 1, 1, -1).expand(by_slot.shape), by_slot)  # [B, Hh, c, e] by position
            stats.attention = by_pos.view(B * Hh, c, e)  # [B·Hh, c, e]
        if kind == "key_norm":
            norms = [kvcache.layer_kv(cache, layer)[0][:, :, -c:].float().norm(dim=-1)
                     for layer in range(kvcache.n_layers(cache))]  # [B, Hkv, c] each
            mean = torch.stack(norms).mean(0)  # [B, Hkv, c]
            stats.key_norm = mean.reshape(B * Hh, c) if heads else mean.mean(1)  # [B·Hkv, c] or [B, c]
        return stats

    with eager_attention(model) if collector else contextlib.nullcontext():
        evictions = run_stream(policy, budget, T, chunk, seeds, observe, device)
    if heads:
        evictions = evictions.unfold(heads)
    if n_last > 1:
        return torch.cat(result["rows"], 1), evictions  # [B, keep, V]
    return result["logprobs"], evictions
