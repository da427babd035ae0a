"""Streaming runs of a policy: one cache that evicts as it goes (:mod:`truncsens.policies.streaming`).

Two exact ways to run the same decisions, chosen by what the policy reads:

- a policy that needs no scores (``suffix``, ``sink_recent``, ``random``) decides without the model:
  its eviction steps are computed first, and the model runs once over the whole context with a 4D
  mask in which row q reads the keys j with ``j <= q < evict_j`` (the one-pass forward of
  :class:`truncsens.engine.semantics.Streaming`);
- a policy with online scores (``h2o``, ``tova``, ``key_norm``, ``poisson``) runs sequentially, chunk
  by chunk: the chunk's tokens are appended to a cache that holds every key so far (evicted keys are
  masked with ``-inf``, which is exact: they get zero weight), each query reading the keys cached
  before the chunk (with their Hájek offsets) and the chunk's tokens up to itself, within each
  layer's window (:func:`truncsens.engine.layer_windows.kept_attention_mask`). The statistics the
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
                  windows) -> tuple[torch.Tensor, Evictions]:
    """Run ``policy`` over ``input_ids`` [B, T] sequentially in chunks of ``chunk`` tokens.

    Args:
        model: transformers causal LM; windows: its :class:`~truncsens.engine.layer_windows.LayerWindows`.
        policy: a policy with online scores; budget: k; seeds: one per sequence.

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
    k_pos_all = torch.arange(T, device=device).expand(B, T)  # [B, T]
    result: dict[str, torch.Tensor] = {}

    def observe(s: int, e: int, alive: torch.Tensor, offset: torch.Tensor) -> ChunkStats:
        c = e - s
        q_pos = k_pos_all[:, s:e]  # [B, c]
        keep = alive.unsqueeze(1).repeat(1, c, 1)  # [B, c, e]
        keep[:, :, s:] = torch.ones(c, c, dtype=torch.bool, device=device).tril()  # the chunk, causally
        mask = kept_attention_mask(windows, keep, offset.unsqueeze(1).expand(B, c, e), q_pos, k_pos_all[:, :e], dtype)
        with collector.collect() if collector else contextlib.nullcontext():
            out = model(input_ids=input_ids[:, s:e], position_ids=q_pos, attention_mask=mask, use_cache=True,
                        logits_to_keep=1, **{kw: cache})
        if e == T:
            result["logprobs"] = last_logprobs(out.logits[:, -1, :])  # [B, V]
            return ChunkStats()
        stats = ChunkStats(attention=collector.mean() if collector else None)  # [B, c, e]
        if kind == "key_norm":
            norms = [kvcache.layer_kv(cache, layer)[0][:, :, s:e].float().norm(dim=-1).mean(1)
                     for layer in range(kvcache.n_layers(cache))]  # [B, c] each
            stats.key_norm = torch.stack(norms).mean(0)  # [B, c]
        return stats

    with eager_attention(model) if collector else contextlib.nullcontext():
        evictions = run_stream(policy, budget, T, chunk, seeds, observe, device)
    return result["logprobs"], evictions
