"""``h2o``: Heavy-Hitter Oracle, keep the recent tokens and the keys of largest accumulated attention.

Source: Z. Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (arXiv 2306.14048). Score of key j at query q: the attention it received from every
query so far, ``s_j = Σ_{i <= q} a_{i,j}`` (the paper's accumulated attention, its Algorithm 1); the
cache keeps the most recent keys and the "heavy hitters" of largest ``s_j``, the budget split equally
between the two (the paper's default). [ours] One kept set for all layers and heads: ``a_{i,j}`` is
the attention averaged over layers and heads (the paper evicts per head). Under ``streaming`` the
attention is the evicted run's own: the softmax over the pruned cache as each query read it (no
renormalisation), a query's attention to its own key included (i = j), positions numbered from the
start of the reference context. Exactly: at budget k the cache holds at most k − 1 keys before the
next query; ``n_recent = max(1, int(recent_ratio·k))`` recent keys are kept, the next query's own
included (so n_recent − 1 cached ones are protected), and the other slots go to the largest
accumulated scores, ties to the later position (:func:`truncsens.policies.base.top_per_row`).
Under ``prefill_evict`` the attention is the full prefill's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Kept, Policy, PolicyError, StreamView, keep_top, recent


@dataclass
class H2OPolicy(Policy):
    """Recent tokens plus heavy hitters by accumulated attention.

    Attributes:
        recent_ratio: share of the budget kept as the most recent keys (the query's own included, at
            least 1); the rest are heavy hitters. 0.5 (default): the paper's equal split.
    """

    name: ClassVar[str] = "h2o"
    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.recent_ratio <= 1:
            raise PolicyError(f"h2o recent_ratio must lie in [0, 1], got {self.recent_ratio}")

    def score_kind(self) -> str:
        """``"attention"``: accumulated attention."""
        return "attention"

    def n_recent(self, budget: int) -> int:
        """Recent keys kept by a query at budget k, its own included: ``max(1, int(recent_ratio·k))``."""
        return max(1, int(self.recent_ratio * budget))

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys: per query the most recent keys and the heavy hitters, ``budget`` in all.

        Args:
            context_len: T; budget: k >= 1; queries: [Q]; seeds: one per sequence (unused);
            scores: [B, Q, T] accumulated attention of key j up to query ``queries[i]``.

        Returns:
            :class:`Kept` with zero offsets.

        Raises:
            PolicyError: budget out of range or scores missing / misshapen.
        """
        self.check(budget, context_len)
        _check_scores(self.name, scores, (len(seeds), queries.numel(), context_len))
        return keep_top(context_len, budget, queries, recent(context_len, queries, self.n_recent(budget)), scores)

    def stream_protected(self, end: int, budget: int, device) -> torch.Tensor:
        """[end] bool: the ``n_recent - 1`` most recent cached keys (the next query is the last recent one)."""
        return torch.arange(end, device=device) >= end - (self.n_recent(budget) - 1)

    def stream_value(self, view: StreamView) -> torch.Tensor:
        """[B, end] accumulated attention from the evicted run."""
        return view.scores("attention")


def _check_scores(name: str, scores: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """Raise PolicyError unless ``scores`` has ``shape`` and is finite."""
    if scores is None or tuple(scores.shape) != shape:
        raise PolicyError(f"policy {name} needs scores of shape {shape}, got {None if scores is None else tuple(scores.shape)}")
    if not bool(torch.isfinite(scores).all()):
        raise PolicyError(f"policy {name}: scores must be finite")
