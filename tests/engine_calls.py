"""Thin adapters from the tests' vocabulary to the engine's objects (semantics, policies, kernel)."""

from __future__ import annotations

import torch

from truncsens.engine.kernel import measure_targets
from truncsens.engine.reference_pass import ReferencePass
from truncsens.engine.semantics import SEMANTICS
from truncsens.policies import Kept, make_policy


def _kept(keep: torch.Tensor, offset: torch.Tensor | None, queries: torch.Tensor) -> Kept:
    return Kept(keep, torch.zeros(keep.shape) if offset is None else offset, queries)


def streaming_logprobs(model, ids: torch.Tensor, keep: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Streaming semantics: keep/offset [B, T, T] -> [B, V]."""
    T = ids.shape[1]
    return SEMANTICS["streaming"].kept_logprobs(model, ids, _kept(keep, offset, torch.arange(T)), None, "original")


def prefill_evict_logprobs(model, cache, ids: torch.Tensor, keep_last: torch.Tensor,
                           offset_last: torch.Tensor | None) -> torch.Tensor:
    """Prefill-evict semantics against the cache of ids[:, :T-1]: keep_last/offset_last [B, T] -> [B, V]."""
    T = ids.shape[1]
    kept = _kept(keep_last.unsqueeze(1), None if offset_last is None else offset_last.unsqueeze(1), torch.tensor([T - 1]))
    return SEMANTICS["prefill_evict"].kept_logprobs(model, ids, kept, ReferencePass(None, cache=cache), "original")


def window_metrics(model, targets, windows, n_sink: int, positions: str, device: str, max_batch_tokens: int):
    """A re-encode window sweep: (metrics name -> [n, W], n_clamped)."""
    policy = make_policy("sink_recent", n_sink=n_sink) if n_sink else make_policy("suffix")
    out = measure_targets(model, targets, [policy], [n_sink + w for w in windows], SEMANTICS["reencode"], positions, 0,
                          device, max_batch_tokens)
    return {k: v[0] for k, v in out.metrics.items()}, out.n_clamped


def retention_targets(model, targets, policies, budgets, semantics: str, positions: str, seed: int, device: str,
                      max_batch_tokens: int):
    """A policy sweep: (metrics name -> [P, n, K], extras, n_clamped)."""
    out = measure_targets(model, targets, policies, budgets, SEMANTICS[semantics], positions, seed, device, max_batch_tokens)
    extras = {"kept_tokens": out.kept_tokens}
    if out.evicted_attention_mass is not None:
        extras["evicted_attention_mass"] = out.evicted_attention_mass
    return out.metrics, extras, out.n_clamped
