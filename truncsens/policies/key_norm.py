"""``key_norm``: keep the keys of lowest L2 norm.

Source: A. Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(arXiv 2406.11430): keys of low L2 norm receive high attention, so the cache keeps the keys of
lowest ``‖k_j‖₂``. Score of key j: ``s_j = -‖k_j‖₂``. [ours] One kept set for all layers and heads: the
norm is averaged over layers and key/value heads (the paper compresses per layer and head). Under
``streaming`` the norms are those of the keys the evicted run computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Kept, Policy, StreamView, keep_top
from truncsens.policies.h2o import _check_scores


@dataclass
class KeyNormPolicy(Policy):
    """Keep the query's own token and the ``k - 1`` earlier keys of lowest L2 norm."""

    name: ClassVar[str] = "key_norm"

    def score_kind(self) -> str:
        """``"key_norm"``."""
        return "key_norm"

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys of lowest norm.

        Args:
            context_len: T; budget: k; queries: [Q]; seeds: unused; scores: [B, Q, T] key L2 norms.

        Raises:
            PolicyError: budget out of range or scores missing / misshapen.
        """
        self.check(budget, context_len)
        _check_scores(self.name, scores, (len(seeds), queries.numel(), context_len))
        none = torch.zeros(queries.numel(), context_len, dtype=torch.bool, device=queries.device)
        return keep_top(context_len, budget, queries, none, -scores)

    def stream_value(self, view: StreamView) -> torch.Tensor:
        """[B, end] minus the key norms of the evicted run: the largest norm is evicted first."""
        return -view.scores("key_norm")
