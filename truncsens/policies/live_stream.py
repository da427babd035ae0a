"""Streaming decisions over the live slots only: the loop of a real evicting cache.

The same decisions as :func:`truncsens.policies.streaming.run_stream` (chunks of
:func:`~truncsens.policies.steps.chunk_bounds`, one :meth:`~truncsens.policies.base.Policy.evict` per
chunk end, the refusals of :func:`~truncsens.policies.streaming.check_step`), but the stream's state
(alive flags, offsets, drawn flags, inclusion probabilities π, uniforms, accumulated and last
attention, key norms) is held per cache slot, not per position: the slots of the keys the cache still
holds plus the current chunk, each with its position. The policy sees a compacted
:class:`~truncsens.policies.base.StreamView` (its ``positions``), so a token step costs O(k + C)
whatever the context, where ``run_stream`` costs O(T) per step.

Slots are shared by the ``heads`` rows of a sequence (head granularity: rows ``b·Hh + h``, one kept set
per key/value head, one physical cache per sequence): a slot stays while its key is cached in any head
of its sequence, and is dead (``alive`` False) in the heads that evicted it. Dead slots are dropped
once they outnumber the live ones (amortized: ``L > 2·n + slack`` slots, n the most live slots of a
sequence, checked before each chunk); the caller applies the same gather to its own cache
(:attr:`LiveChunk.index`). A sequence with fewer live slots than n keeps dead ones (any position).

Only the keys evicted at a step are written into the [B, T] results (a scatter over the n slots, the
others into a discard column), and the offsets of the keys cached at the end once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from truncsens.policies.base import Policy, PolicyError, StreamView, uniforms
from truncsens.policies.steps import chunk_bounds
from truncsens.policies.streaming import ChunkStats, Evictions, check_step

ROW_FIELDS = ("alive", "offset", "drawn", "pi", "u", "acc", "last", "norm")  # [B·Hh, L] per slot and row
NEW_SLOT = {"alive": True, "pi": 1.0}  # a new key's fields other than 0 (its uniform: from the row's seed)


def live_first(live: torch.Tensor, n: int) -> torch.Tensor:
    """[R, n] int64 slot indices: each row's live slots first, in their order, then its dead ones (in
    order) up to n, so a gather by it compacts the slots and keeps the live ones' relative order.

    Args:
        live: [R, L] bool; n: slots to keep, at least the most live slots of a row.
    """
    return torch.argsort((~live).to(torch.int8), dim=-1, stable=True)[:, :n]


@dataclass
class LiveChunk:
    """What the driver hands its ``observe`` for the chunk of queries s..e-1 (B sequences, Hh rows each).

    Attributes:
        index: [B, L'] int64 slots of the previous call's cache kept (in order) before this chunk, or
            None: nothing compacted (the caller gathers its cache by it, ``kvcache.gather_slots``).
        positions: [B, L + c] int64 position of each slot, the chunk's c new keys last (s..e-1).
        alive: [B·Hh, L + c] bool slots whose key the row still caches (the chunk's keys: True).
        offset: [B·Hh, L + c] float32 logit offset of each cached key (0 on dead slots).
    """

    index: torch.Tensor | None
    positions: torch.Tensor
    alive: torch.Tensor
    offset: torch.Tensor


LiveObserve = Callable[[int, int, LiveChunk], ChunkStats]
"""``observe(s, e, chunk) -> ChunkStats`` runs the queries s..e-1, query q reading the slots alive in
its row and the chunk's keys up to q, with their offsets; its ``attention`` is [B·Hh, c, L + c] per
slot (0 on dead slots), its ``key_norm`` [B·Hh, c] the chunk's keys."""


def run_live_stream(policy: Policy, budget: int, context_len: int, chunk: int, seeds: Sequence[int],
                    observe: LiveObserve, device: torch.device | str = "cpu", heads: int = 1,
                    slack: int | None = 32) -> Evictions:
    """Run a streaming policy over B·Hh = ``len(seeds)`` rows of T tokens, held per live slot.

    Args:
        policy: the policy (its :meth:`~truncsens.policies.base.Policy.evict`).
        budget: k >= the policy's minimum; context_len: T; chunk: C >= 1.
        seeds: one per row (:func:`~truncsens.policies.base.uniforms`), rows ``b·Hh + h``.
        observe: see :data:`LiveObserve`.
        heads: Hh, rows per sequence that share its slots (1: token granularity).
        slack: dead slots kept beyond the live ones before compacting (None: never compact, every
            slot stays and slot i is position i, for caches whose windows act on slot indices).

    Returns:
        :class:`~truncsens.policies.streaming.Evictions` [B·Hh, T], equal to ``run_stream``'s for the
        same statistics.

    Raises:
        PolicyError: bad budget or chunk, ``heads`` not dividing the rows, or a step
            :func:`~truncsens.policies.streaming.check_step` refuses.
    """
    policy.check(budget, context_len)
    R, T, Hh = len(seeds), context_len, heads
    if Hh < 1 or R % Hh:
        raise PolicyError(f"heads must divide the {R} rows of seeds (one per sequence and head), got heads={heads}")
    B = R // Hh
    kind = policy.score_kind()
    u_all = uniforms(seeds, (T,), device)  # [R, T]
    evict = torch.full((R, T + 1), T, dtype=torch.long, device=device)  # column T: discard
    offset_out = torch.zeros(R, T + 1, dtype=torch.float32, device=device)
    pos = torch.zeros(B, 0, dtype=torch.long, device=device)  # [B, L]
    dtypes = {"alive": torch.bool, "drawn": torch.bool, "pi": torch.float64, "u": torch.float64}
    rows = {f: torch.zeros(R, 0, dtype=dtypes.get(f, torch.float32), device=device) for f in ROW_FIELDS}
    for s, e in chunk_bounds(T, chunk):
        c, L = e - s, pos.shape[1]
        index = None
        if slack is not None and L and B:
            anywhere = rows["alive"].view(B, Hh, L).any(1)  # [B, L] slots cached in some head
            n = int(anywhere.sum(1).max())
            if L > 2 * n + slack:
                index = live_first(anywhere, n)  # [B, n]
                pos = pos.gather(1, index)
                by_row = index.repeat_interleave(Hh, 0)  # [R, n]
                rows = {f: t.gather(1, by_row) for f, t in rows.items()}  # dead fillers stay dead
        pos = torch.cat([pos, torch.arange(s, e, device=device).expand(B, c)], 1)  # [B, L + c]
        for f, t in rows.items():  # the chunk's keys: cached, never drawn, pi 1, their uniforms, no scores yet
            fill = u_all[:, s:e] if f == "u" else torch.full((R, c), NEW_SLOT.get(f, 0), dtype=t.dtype, device=device)
            rows[f] = torch.cat([t, fill], 1)
        stats = observe(s, e, LiveChunk(index, pos, rows["alive"], rows["offset"]))
        if e == T:
            break
        if stats.attention is not None:
            rows["acc"] += stats.attention.float().sum(1)  # [R, L + c]
            rows["last"] = stats.attention[:, -1].float().clone()
        if stats.key_norm is not None:
            rows["norm"][:, -c:] = stats.key_norm.float()
        positions = pos.repeat_interleave(Hh, 0)  # [R, L + c]
        view = StreamView(rows["alive"], rows["offset"], rows["drawn"], budget, e, rows["u"],
                          accumulated=rows["acc"] if kind == "attention" else None,
                          last=rows["last"] if kind == "last_attention" else None,
                          key_norm=rows["norm"] if kind == "key_norm" else None, pi=rows["pi"], positions=positions)
        step = policy.evict(view)
        check_step(policy, budget, view, step)
        gone = torch.where(rows["alive"] & ~step.keep, positions, T)  # [R, L + c] evicted now, else the discard
        evict.scatter_(1, gone, e)
        rows["offset"] = torch.where(step.keep, step.offset.float(), torch.zeros_like(rows["offset"]))
        rows["alive"], rows["drawn"] = step.keep.clone(), step.drawn.clone()
        if step.pi is not None:
            rows["pi"] = torch.where(step.keep, step.pi.to(torch.float64), torch.ones_like(rows["pi"]))
    cached = torch.where(rows["alive"], pos.repeat_interleave(Hh, 0), T)  # [R, L + c] keys cached at the end
    offset_out.scatter_(1, cached, rows["offset"])
    return Evictions(evict[:, :T].contiguous(), offset_out[:, :T].contiguous())
