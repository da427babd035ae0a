"""``tova``: Token Omission Via Attention, evict the key the newest query attends to least.

Source: M. Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104), TOVA: when the cache
is full, drop the key of lowest attention weight of the current (newest) query, weights averaged over
heads. Score of key j: ``s_j = a_{q',j}``, the attention of the newest processed query q' (under
``streaming`` the evicted run's own; under ``prefill_evict`` the last prompt query's in the full
prefill, q' = T - 2). [ours] One kept set for all layers: the attention is averaged over layers too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Kept, Policy, StreamView, keep_top
from truncsens.policies.h2o import _check_scores


@dataclass
class TOVAPolicy(Policy):
    """Keep the keys of highest attention from the newest query (and the query's own token)."""

    name: ClassVar[str] = "tova"

    def score_kind(self) -> str:
        """``"last_attention"``: the newest processed query's attention."""
        return "last_attention"

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys: the query's own token and the ``budget - 1`` keys of highest score.

        Args:
            context_len: T; budget: k; queries: [Q]; seeds: unused;
            scores: [B, Q, T] attention of the query processed before ``queries[i]``.

        Raises:
            PolicyError: budget out of range or scores missing / misshapen.
        """
        self.check(budget, context_len)
        _check_scores(self.name, scores, (len(seeds), queries.numel(), context_len))
        none = torch.zeros(queries.numel(), context_len, dtype=torch.bool, device=queries.device)
        return keep_top(context_len, budget, queries, none, scores)

    def stream_value(self, view: StreamView) -> torch.Tensor:
        """[B, end] attention of the newest processed query of the evicted run."""
        return view.scores("last_attention")
