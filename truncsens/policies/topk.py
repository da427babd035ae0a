"""``topk``: deterministic retention of the sinks, the most recent keys and the top-scoring keys.

Source: the "deterministic selection" baseline of P. Xie, "Error Certificates for KV-Cache Eviction
via Randomized Design" (arXiv 2607.21475), whose Theorem 1 says its error cannot be estimated from
what it keeps (docs/method.md section 5). [ours] It uses the certain set of :class:`PoissonPolicy`
(``n_sink`` sinks, the same recent slice ``R = max(1, ⌊recent_fraction·k⌋)``) and fills the rest of
the budget, ``k − n_sink − R`` keys, with the highest-scoring remaining keys by the same score
(attention received, H2O-style, arXiv 2306.14048; or key norm), so both policies spend the same
budget from the same ranking; exactly ``min(k, q + 1)`` keys per query, no offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Kept, Policy, PolicyError, StreamView, causal, not_full, recent, sinks, smallest_k
from truncsens.policies.poisson import SCORES


@dataclass
class TopKPolicy(Policy):
    """Sinks + recent + top-scoring keys at budget k.

    Attributes:
        n_sink: first tokens kept (tokens).
        recent_fraction: share of the budget kept as the most recent tokens (at least 1, the query).
        score: "attention" (default) or "key_norm".
    """

    name: ClassVar[str] = "topk"
    n_sink: int = 4
    recent_fraction: float = 0.25
    score: str = "attention"

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise PolicyError(f"sinks (--sinks) must be >= 0, got {self.n_sink}")
        if not 0 <= self.recent_fraction <= 1:
            raise PolicyError("topk recent fraction must lie in [0, 1]")
        if self.score not in SCORES:
            raise PolicyError(f"unknown topk score {self.score!r}; choose one of {', '.join(SCORES)}")

    def min_budget(self) -> int:
        """``n_sink + 1``."""
        return self.n_sink + 1

    def score_kind(self) -> str:
        """The configured score: "attention" or "key_norm"."""
        return self.score

    def n_recent(self, budget: int) -> int:
        """Recent keys R kept surely at budget k, the query's own included: ``min(k - n_sink, max(1, ⌊recent_fraction·k⌋))``."""
        return min(budget - self.n_sink, max(1, int(self.recent_fraction * budget)))

    def stream_protected(self, end: int, budget: int, device) -> torch.Tensor:
        """[end] bool: the sinks and the ``R - 1`` most recent cached keys (the next query is the last recent one)."""
        keys = torch.arange(end, device=device)
        return (keys < self.n_sink) | (keys >= end - (self.n_recent(budget) - 1))

    def stream_value(self, view: StreamView) -> torch.Tensor:
        """[B, end] the configured score from the evicted run (accumulated attention or key norm): the
        lowest-scoring unprotected key is evicted first."""
        return view.scores(self.score)

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys of ``len(seeds)`` sequences (the seeds are unused: the policy is deterministic).

        Args:
            context_len: T; budget: k > n_sink; queries: [Q] int64.
            scores: [B, Q, T] non-negative importance of key j for query ``queries[i]``.

        Returns:
            :class:`Kept` with keep [B, Q, T] (exactly min(k, q + 1) keys per query; ties by
            position) and zero offsets.

        Raises:
            PolicyError: budget out of range, scores missing or misshapen.
        """
        self.check(budget, context_len)
        B, Q, T = len(seeds), queries.numel(), context_len
        if scores is None or tuple(scores.shape) != (B, Q, T):
            raise PolicyError(f"policy topk needs scores of shape {(B, Q, T)}, got "
                              f"{None if scores is None else tuple(scores.shape)}")
        r = self.n_recent(budget)
        avail = causal(T, queries)  # [Q, T]
        full = ~not_full(T, queries, budget)  # [Q] queries that must evict
        base = (sinks(T, queries, self.n_sink) | recent(T, queries, r) | ~full.unsqueeze(1)) & avail  # [Q, T]
        base = base.unsqueeze(0).expand(B, Q, T)  # [B, Q, T]
        rest = avail.unsqueeze(0).expand(B, Q, T) & ~base  # [B, Q, T]
        top = smallest_k(-scores.to(torch.float64), rest, budget - self.n_sink - r)  # [B, Q, T]
        keep = base | (top & full.view(1, Q, 1))  # [B, Q, T]
        return Kept(keep, torch.zeros(keep.shape, dtype=torch.float32, device=scores.device), queries)
