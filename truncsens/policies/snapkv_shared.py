"""``snapkv_shared``: SnapKV's observation-window votes with one kept set for all layers and heads
(what this package measured as ``snapkv`` before ``snapkv`` became SnapKV as published,
:mod:`truncsens.policies.snapkv`).

Source: Y. Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"
(arXiv 2404.14469). After a full prefill, the last ``w`` prompt queries (the observation window) vote:
``v_j = Σ_{i ∈ window} a_{i,j}``; the votes are pooled over neighbouring keys (1-D average pooling,
kernel ``p``, stride 1, the released code's default pooling); the cache keeps the window's own keys and
the keys of largest pooled vote. The released defaults are w = 32, p = 5 (kvpress: 64, 5); [ours]:
w = 8 by default because budgets here go down to 16 tokens;
one kept set for all layers and heads (attention averaged over layers and heads; with
``--granularity head`` one per key/value head, shared by the layers); the votes of every key before
the query (the window's own included) are pooled, padding left out of the mean. It needs the
attention rows of a full prefill, so it runs under ``prefill_evict`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Kept, Policy, keep_top, recent
from truncsens.policies.h2o import _check_scores
from truncsens.policies.snapkv import check_window


@dataclass
class SnapKVSharedPolicy(Policy):
    """Observation-window votes, pooled, one kept set for all layers and heads (the earlier ``snapkv``).

    Attributes:
        window: w, prompt queries in the observation window (tokens), >= 1.
        kernel: p, odd pooling kernel over keys (tokens), >= 1.
    """

    name: ClassVar[str] = "snapkv_shared"
    window: int = 8
    kernel: int = 5

    def __post_init__(self) -> None:
        check_window(self.name, self.window, self.kernel)

    def score_kind(self) -> str:
        """``"window_attention"``."""
        return "window_attention"

    def window_rows(self, queries: torch.Tensor) -> torch.Tensor:
        """[R] int64 sorted prompt queries the observation windows of ``queries`` [Q] cover (the rows
        :meth:`window_scores` reads): ``max(0, q - w) .. q - 1`` for each q."""
        rows = {r for q in queries.tolist() for r in range(max(0, q - self.window), q)}
        return torch.tensor(sorted(rows), dtype=torch.long, device=queries.device)

    def window_scores(self, attention: torch.Tensor, queries: torch.Tensor,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled votes of the observation window of each query.

        Args:
            attention: [B, R, T] attention rows of a full prefill (mean over layers and heads) of
                the query positions ``rows`` [R] (at least :meth:`window_rows`); ``rows`` None: the
                full matrix [B, T, T], rows 0 .. T - 1.
            queries: [Q] int64; the window of query q is the prompt queries ``max(0, q - w) .. q - 1``.

        Returns:
            [B, Q, T] float32 pooled votes (keys j >= q get 0 before pooling).
        """
        B, R, T = attention.shape
        keys = torch.arange(T, device=attention.device)  # [T]
        rows = keys if rows is None else rows.to(attention.device)  # [R] query position of each row
        out = []
        for q in queries.tolist():
            in_window = (rows < q) & (rows >= q - self.window)  # [R]
            votes = attention[:, in_window].sum(1)  # [B, T]
            votes = torch.where(keys < q, votes, torch.zeros_like(votes))
            pooled = torch.nn.functional.avg_pool1d(votes.unsqueeze(1), self.kernel, stride=1, padding=self.kernel // 2,
                                                    count_include_pad=False)  # [B, 1, T]
            out.append(pooled[:, 0])
        return torch.stack(out, 1)  # [B, Q, T]

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys: the observation window (and the query) plus the keys of largest pooled vote.

        Args:
            context_len: T; budget: k; queries: [Q]; seeds: unused; scores: [B, Q, T] from :meth:`window_scores`.

        Raises:
            PolicyError: budget out of range or scores missing / misshapen.
        """
        self.check(budget, context_len)
        _check_scores(self.name, scores, (len(seeds), queries.numel(), context_len))
        protected = recent(context_len, queries, min(self.window, budget - 1) + 1)  # [Q, T] window + the query
        return keep_top(context_len, budget, queries, protected, scores)
