"""Merging retention policies: a cache that folds what it evicts into what it keeps (docs/method.md, §4).

A merging policy does not drop keys: when the cache holds more than k − 1 slots (k: the budget, the
query's own token included), it maps every slot to one of at most k − 1 new slots. A new slot's key
and value are the count-weighted means of the keys and values of the slots mapped to it (keys as the
cache stores them, after the rotary embedding), and it stands for the sum of their counts n. The
attention logit of a slot gets ``log n`` added (proportional attention: a slot standing for n equal
tokens weighs as they did together). Memory: k − 1 key/value slots between queries, plus one float
per slot (its count).

The policy decides the map from what the engine shows it (:class:`MergeView`: each slot's first
token, its count, and the cosine similarity of slot keys); the engine applies it
(:mod:`truncsens.engine.merge_pass`). The decision is one per slot shared by every layer and head
(token granularity), as for the other policies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch

from truncsens.policies.base import MERGED_SLOTS, Kept, Policy, PolicyError


@dataclass
class MergeView:
    """What a merging policy sees when B caches hold n > k − 1 slots each (slots in cache order).

    Attributes:
        anchor: [B, n] int64 position of the token a slot holds unmerged, or of the kept token other
            slots were merged into; -1 for a summary slot (``merge_mean``).
        count: [B, n] float64 tokens each slot stands for (1: a token not merged).
        budget: k; at most k − 1 slots stay.
        end: tokens processed.
        similarity: ``similarity(victims)`` with victims [B, r] int64 slot indices -> [B, r, n] float32
            cosine similarity of each victim's key with every slot's key, mean over layers and
            key/value heads (keys after the rotary embedding).
    """

    anchor: torch.Tensor
    count: torch.Tensor
    budget: int
    end: int
    similarity: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class MergeStep:
    """A merging policy's answer: dest [B, n] int64 the new slot of every old slot (0..n' − 1, every
    new slot receiving at least one), anchor [B, n'] int64 the new slots' anchors (see :class:`MergeView`)."""

    dest: torch.Tensor
    anchor: torch.Tensor


class MergePolicy(Policy):
    """Base of the merging policies (``merge_mean``, ``merge_nearest``): sinks ``0..n_sink − 1`` are
    never merged; subclasses implement :meth:`merge` and :meth:`min_budget`."""

    merges: ClassVar[bool] = True
    n_sink: int  # (a dataclass field of each subclass)

    def requirements(self) -> frozenset[str]:
        """:data:`~truncsens.policies.base.MERGED_SLOTS`: replaced keys and values and a per-slot logit bias."""
        return frozenset({MERGED_SLOTS})

    def merge(self, view: MergeView) -> MergeStep:  # pragma: no cover - abstract
        """Map the n slots of ``view`` onto at most k − 1 (:class:`MergeStep`)."""
        raise NotImplementedError

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Refused: a merging cache has no kept set of tokens.

        Raises:
            PolicyError: always, naming the policy.
        """
        raise PolicyError(f"policy {self.name} merges the keys it evicts into kept slots: it has no kept set of "
                          "tokens; run it with --semantics streaming or prefill_evict")

    def stream_value(self, view) -> torch.Tensor:
        """Refused (merging policies run through :meth:`merge`).

        Raises:
            PolicyError: always."""
        raise PolicyError(f"policy {self.name} merges: it takes no eviction steps")

    def sinks_of(self, anchor: torch.Tensor) -> torch.Tensor:
        """[B, n] bool slots holding a sink (anchor ``0..n_sink − 1``)."""
        return (anchor >= 0) & (anchor < self.n_sink)


def groups_to_step(groups: list[list[list[int]]], anchors: list[list[int]], n: int, device) -> MergeStep:
    """A :class:`MergeStep` from, per row, the new slots as lists of old slot indices (in new-slot order)."""
    rows = []
    for row in groups:
        dest = [0] * n
        for new, members in enumerate(row):
            for i in members:
                dest[i] = new
        rows.append(dest)
    return MergeStep(torch.tensor(rows, dtype=torch.long, device=device),
                     torch.tensor(anchors, dtype=torch.long, device=device))
