"""``suffix``: keep the last k tokens (a sliding window).

Source: the suffix-window truncation of M. Kim, "Polynomial Context-Truncation Sensitivity in
Autoregressive Language Models" (arXiv 2605.25085), whose distortion decays as a power law in k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Kept, Policy, StreamView, expand, recent


@dataclass
class SuffixPolicy(Policy):
    """Keep the ``k`` most recent keys of each query, the query itself included (streaming: evict
    the oldest cached key)."""

    name: ClassVar[str] = "suffix"

    def stream_value(self, view: StreamView) -> torch.Tensor:
        """[B, end] the key's position: the oldest is evicted first."""
        return view.columns().to(torch.float32)

    def recent_kept_first(self) -> int:
        """0: no key is kept but the most recent ones (closed-form streaming steps, :meth:`Policy.eviction_steps`)."""
        return 0

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys of ``len(seeds)`` sequences.

        Args:
            context_len: T, keys are positions 0..T-1.
            budget: k >= 1 kept keys per query (all of them when q + 1 <= k).
            queries: [Q] int64 query positions in 0..T-1.
            seeds: one seed per sequence (unused: the policy is deterministic).
            scores: unused.

        Returns:
            :class:`Kept` with keep [B, Q, T] (the same for every sequence) and zero offsets.

        Raises:
            PolicyError: budget out of range (see :meth:`Policy.check`).
        """
        self.check(budget, context_len)
        keep = expand(recent(context_len, queries, budget), len(seeds))  # [B, Q, T]
        return Kept(keep, torch.zeros(keep.shape, dtype=torch.float32, device=keep.device), queries)
