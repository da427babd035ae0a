"""Streaming decisions as one eviction step per key: the loop every streaming run shares.

A cache that evicts as it goes (docs/method.md, section 3): the context x[0..T-1] is processed in
order; the prompt x[0..T-2] in chunks of C tokens, then the target's query x[T-1] alone (a decode
step). Before a chunk the cache holds at most k - 1 keys (k: the budget, the query's own token
included); the chunk's tokens read the cache and the chunk's earlier tokens (the chunked-prefill
convention: the cache holds up to C - 1 extra keys during a chunk); at the chunk's end the policy
evicts down to k - 1 keys, in expectation for an expected-budget design such as ``poisson``
(:meth:`truncsens.policies.base.Policy.evict`). With C = 1 every decision
is taken token by token, and the target's query reads at most k keys for every C.

A decision is recorded as ``evict[b, j]``: key j is read by the queries q with ``j <= q < evict[b, j]``
(``T``: never evicted within the context). Kept sets are therefore nested in time by construction;
:func:`run_stream` refuses a policy that tries to bring back an evicted key.

This loop holds every position 0..e-1 (O(T) per step): the offline path (policies without scores)
and synthetic sources use it; the engine's run with online scores holds its state for the live slots
only (:func:`truncsens.policies.live_stream.run_live_stream`, the same decisions in O(k + C) per step).

Statistics come only from the evicted run itself (``observe``): attention of the chunk's queries over
the keys they read, and the norms of the chunk's new keys. The chunk ends and the closed-form steps of
recency policies live in :mod:`truncsens.policies.steps` (imported from here too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from truncsens.policies.base import Kept, Policy, PolicyError, StreamView, unfold_heads, uniforms
from truncsens.policies.steps import chunk_bounds


@dataclass
class ChunkStats:
    """What processing one chunk of queries s..e-1 computed (B sequences, c = e - s).

    Attributes:
        attention: [B, c, e] float attention probabilities of each chunk query over keys 0..e-1 (0 on
            keys it did not read; mean over layers and heads), or None; [B, c, L + c] over the cache
            slots for :func:`truncsens.policies.live_stream.run_live_stream`.
        key_norm: [B, c] float L2 norms of the chunk's keys (mean over layers and key/value heads), or None.
        Under head granularity B counts (sequence, key/value head) rows and the statistics are per KV head.
    """

    attention: torch.Tensor | None = None
    key_norm: torch.Tensor | None = None


@dataclass
class Evictions:
    """Streaming decisions of B sequences of T tokens.

    Attributes:
        evict: [B, T] int64, key j is read by queries ``j <= q < evict[b, j]`` (T: never evicted);
            under head granularity [B, Hkv, T], one eviction step per key and key/value head.
        offset: [B, T] (or [B, Hkv, T]) float32 logit offset of each key for its life in the cache
            (0 if certain).
    """

    evict: torch.Tensor
    offset: torch.Tensor

    def kept(self) -> Kept:
        """Per-query kept sets [..., T, T] (query rows 0..T-1; ``...`` = B or B, Hkv) with the keys' offsets."""
        T = self.evict.shape[-1]
        q = torch.arange(T, device=self.evict.device)
        ev = self.evict.unsqueeze(-2)  # [..., 1, T]
        keep = (q.view(T, 1) >= q.view(1, T)) & (q.view(T, 1) < ev)  # [..., T, T]
        offset = torch.where(keep, self.offset.unsqueeze(-2).expand(keep.shape), torch.zeros((), device=keep.device))
        return Kept(keep, offset, q)

    def unfold(self, heads: int) -> "Evictions":
        """Decisions taken on B·Hkv folded (sequence, key/value head) rows as [B, Hkv, T] (:func:`unfold_heads`)."""
        return Evictions(unfold_heads(self.evict, heads), unfold_heads(self.offset, heads))

    def last(self) -> torch.Tensor:
        """[B, T] (or [B, Hkv, T]) bool keys the target's query (T - 1) read."""
        return self.evict >= self.evict.shape[-1]

    def last_rows(self, n: int) -> torch.Tensor:
        """[..., n, T] bool keys each of the last n queries (T - n .. T - 1) read: ``j <= q < evict[j]``
        (the rows of :meth:`kept` without building all T; ``last_rows(1)[..., 0, :]`` is :meth:`last`)."""
        T = self.evict.shape[-1]
        q = torch.arange(T - n, T, device=self.evict.device).view(n, 1)  # [n, 1] query positions
        j = torch.arange(T, device=self.evict.device).view(1, T)  # [1, T] key positions
        return (j <= q) & (q < self.evict.unsqueeze(-2))  # [..., n, T]


Observe = Callable[[int, int, torch.Tensor, torch.Tensor], ChunkStats]


def run_stream(policy: Policy, budget: int, context_len: int, chunk: int, seeds: Sequence[int], observe: Observe,
               device: torch.device | str = "cpu") -> Evictions:
    """Run a streaming policy over B = ``len(seeds)`` sequences of T tokens.

    Args:
        policy: the policy (its :meth:`~truncsens.policies.base.Policy.evict`).
        budget: k >= the policy's minimum; context_len: T; chunk: C >= 1 (see :func:`chunk_bounds`).
        seeds: one seed per row (one uniform per key, :func:`~truncsens.policies.base.uniforms`): a
            sequence, or a (sequence, key/value head) pair under head granularity
            (:func:`~truncsens.policies.base.head_seeds`).
        observe: ``observe(s, e, alive [B, e] bool, offset [B, e] float32) -> ChunkStats`` processes
            the queries s..e-1, query q reading the keys ``alive[:, :s]`` and the chunk's tokens up to q
            with their offsets (the model run of the engine, or a synthetic source in tests).

    Returns:
        :class:`Evictions`.

    Raises:
        PolicyError: bad budget or chunk, a policy that keeps a key already evicted, more than k - 1
            keys, or changes the offset of a key it drew earlier.
    """
    policy.check(budget, context_len)
    B, T = len(seeds), context_len
    kind = policy.score_kind()
    alive = torch.zeros(B, T, dtype=torch.bool, device=device)
    drawn = torch.zeros(B, T, dtype=torch.bool, device=device)
    offset = torch.zeros(B, T, dtype=torch.float32, device=device)
    evict = torch.full((B, T), T, dtype=torch.long, device=device)
    pi = torch.ones(B, T, dtype=torch.float64, device=device)  # inclusion probability of each cached key
    u = uniforms(seeds, (T,), device)  # [B, T]
    acc = torch.zeros(B, T, dtype=torch.float32, device=device)
    last = torch.zeros(B, T, dtype=torch.float32, device=device)
    norms = torch.zeros(B, T, dtype=torch.float32, device=device)
    for s, e in chunk_bounds(T, chunk):
        alive[:, s:e] = True
        stats = observe(s, e, alive[:, :e], offset[:, :e])
        if e == T:
            break
        if stats.attention is not None:
            acc[:, :e] += stats.attention.float().sum(1)  # [B, e]
            last[:, :e] = stats.attention[:, -1].float()
        if stats.key_norm is not None:
            norms[:, s:e] = stats.key_norm.float()
        # the view reads the loop's own buffers (policies return new tensors and never write into a view)
        view = StreamView(alive[:, :e], offset[:, :e], drawn[:, :e], budget, e, u[:, :e],
                          accumulated=acc[:, :e] if kind == "attention" else None,
                          last=last[:, :e] if kind == "last_attention" else None,
                          key_norm=norms[:, :e] if kind == "key_norm" else None, pi=pi[:, :e])
        step = policy.evict(view)
        check_step(policy, budget, view, step)
        evict[:, :e] = torch.where(alive[:, :e] & ~step.keep, torch.full_like(evict[:, :e], e), evict[:, :e])
        alive[:, :e] = step.keep
        offset[:, :e] = torch.where(step.keep, step.offset.float(), torch.zeros_like(offset[:, :e]))
        drawn[:, :e] = step.drawn
        if step.pi is not None:
            pi[:, :e] = torch.where(step.keep, step.pi.to(torch.float64), torch.ones_like(pi[:, :e]))
    return Evictions(evict, offset)


def check_step(policy: Policy, budget: int, view: StreamView, step) -> None:
    """Refuse a streaming step no real cache could take: keeping a key already evicted; for a policy
    with a hard budget, more than k - 1 keys or a changed offset of a drawn key (fixed for its life);
    for an :attr:`~truncsens.policies.base.Policy.expected_budget` design, a drawn key whose inclusion
    probability rises (a thinned key cannot regain probability) or an offset other than log(1/π).

    Raises:
        PolicyError: naming the policy and the rule broken.
    """
    before = view.alive
    if bool((step.keep & ~before).any()):
        raise PolicyError(f"policy {policy.name} kept a key it had evicted: a streaming cache cannot bring it back")
    if getattr(policy, "expected_budget", False):
        if step.pi is None:
            raise PolicyError(f"policy {policy.name} thins its tail but returned no inclusion probabilities")
        kept_drawn = view.drawn & step.keep
        if bool((kept_drawn & (step.pi.to(torch.float64) > view.inclusion() * (1 + 1e-12))).any()):
            raise PolicyError(f"policy {policy.name} raised the inclusion probability of a key drawn earlier")
        want = torch.where(step.keep, -torch.log(step.pi.to(torch.float64)), torch.zeros_like(step.pi, dtype=torch.float64))
        if bool(((step.offset.double() - want).abs() > 1e-5 * (1 + want.abs())).any()):
            raise PolicyError(f"policy {policy.name} gave a kept key an offset other than log(1/pi)")
        return
    if bool((step.keep.sum(-1) > budget - 1).any()):
        raise PolicyError(f"policy {policy.name} kept more than budget - 1 = {budget - 1} keys between queries")
    redrawn = view.drawn & step.keep & (step.offset != view.offset)
    if bool(redrawn.any()):
        raise PolicyError(f"policy {policy.name} changed the offset of a key drawn earlier (fixed for its life)")
