"""``sink_recent``: keep the first S tokens (attention sinks) and the last k − S.

Sources: StreamingLLM, G. Xiao et al., "Efficient Streaming Language Models with Attention Sinks"
(arXiv 2309.17453), and the sink-plus-recent KL measurement of arXiv 2605.25085, which recovers the
truncation exponent. The default of 4 sinks is StreamingLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Kept, Policy, PolicyError, StreamView, expand, recent, sinks


@dataclass
class SinkRecentPolicy(Policy):
    """Keep sinks ``0..n_sink-1`` plus the ``k - n_sink`` most recent keys (query included).

    Attributes:
        n_sink: number of first tokens kept (tokens), >= 0.
    """

    name: ClassVar[str] = "sink_recent"
    n_sink: int = 4

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise PolicyError(f"sinks (--sinks) must be >= 0, got {self.n_sink}")

    def min_budget(self) -> int:
        """``n_sink + 1``: the query's own token needs a slot after the sinks."""
        return self.n_sink + 1

    def stream_protected(self, end: int, budget: int, device) -> torch.Tensor:
        """[end] bool the sinks ``0..n_sink-1``."""
        return torch.arange(end, device=device) < self.n_sink

    def stream_value(self, view: StreamView) -> torch.Tensor:
        """[B, end] the key's position: the oldest non-sink key is evicted first."""
        return view.columns().to(torch.float32)

    def recent_kept_first(self) -> int:
        """The sinks (closed-form streaming steps, :meth:`Policy.eviction_steps`)."""
        return self.n_sink

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys of ``len(seeds)`` sequences.

        Args:
            context_len: T; budget: k > n_sink; queries: [Q] int64; seeds: one per sequence
            (unused: deterministic); scores: unused.

        Returns:
            :class:`Kept` with keep [B, Q, T] and zero offsets.

        Raises:
            PolicyError: ``k <= n_sink`` or ``k > T``.
        """
        self.check(budget, context_len)
        mask = sinks(context_len, queries, self.n_sink) | recent(context_len, queries, budget - self.n_sink)  # [Q, T]
        keep = expand(mask, len(seeds))  # [B, Q, T]
        return Kept(keep, torch.zeros(keep.shape, dtype=torch.float32, device=keep.device), queries)
