"""What a policy's per-query decision is: plain data, no model and no engine (docs/method.md, section 3).

- :class:`Kept`: one kept set per sequence and query (or per key/value head under ``--granularity
  head``), with the additive logit offset of each kept key;
- :class:`HeadKept`: a :class:`Kept` plus kept sets per layer and key/value head, as kvpress presses
  keep (:mod:`truncsens.policies.kvpress_adapter`); the engine decodes it against a cache gathered per
  layer and head (:func:`truncsens.engine.rerotation.decode_gathered`); :func:`head_kept` builds one
  from the kept positions of each layer and head.

Both are re-exported by :mod:`truncsens.policies.base` (``Kept``) and :mod:`truncsens.engine.rerotation`
(``HeadKept``), where they were defined before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Kept:
    """The kept keys of a batch of sequences, per query.

    Attributes:
        keep: [B, Q, T] bool, key j kept for query ``queries[i]`` (never true for j > query); under
            head granularity [B, Hkv, Q, T], one kept set per key/value head (shared by its layers).
        offset: [B, Q, T] (or [B, Hkv, Q, T]) float32 additive logit offsets of kept keys (0 elsewhere).
        queries: [Q] int64 query positions.
    """

    keep: torch.Tensor
    offset: torch.Tensor
    queries: torch.Tensor

    @property
    def per_head(self) -> bool:
        """Whether the kept sets are per key/value head (keep [B, Hkv, Q, T])."""
        return self.keep.dim() == 4

    def last(self) -> torch.Tensor:
        """Keys the last query read: [B, T] bool, or [B, Hkv, T] under head granularity."""
        return self.keep[..., -1, :]

    @property
    def counts(self) -> torch.Tensor:
        """[B, Q] (or [B, Hkv, Q]) int64 number of kept keys per query."""
        return self.keep.sum(-1)

    def has_offsets(self) -> bool:
        """Whether any kept key carries a non-zero offset."""
        return bool((self.offset[self.keep] != 0).any())


@dataclass
class HeadKept(Kept):
    """:class:`Kept` plus kept sets per layer and key/value head.

    Attributes:
        heads: [L, B, H_kv, n] int64 positions (in 0..T-2, increasing along the last axis) of the
            prefix keys each layer's head keeps; the query's own key (T - 1) is always read. ``keep``
            is the token-level view the results record (kept tokens, evicted attention mass).
    """

    heads: torch.Tensor | None = None


def head_kept(heads: torch.Tensor, context_len: int, queries: torch.Tensor) -> HeadKept:
    """:class:`HeadKept` of kept prefix keys per layer and key/value head, with its token-level view
    [ours]: the n prefix keys kept by the most (layer, head) pairs (ties: the later key) and the
    query's own key T - 1 (exact when every head keeps the same keys).

    Args:
        heads: [L, B, Hkv, n] int64 kept prefix positions (in 0 .. T - 2) of each layer and head.
        context_len: T; queries: [1] = [T - 1].

    Returns:
        :class:`HeadKept` with ``keep`` [B, 1, T], zero offsets, and ``heads``.
    """
    L, B, H, n = heads.shape
    T = context_len
    votes = torch.zeros(B, T, dtype=torch.float64, device=heads.device)
    votes.scatter_add_(1, heads.permute(1, 0, 2, 3).reshape(B, L * H * n),
                       torch.ones(B, L * H * n, dtype=torch.float64, device=heads.device))  # [B, T] pairs keeping each key
    pos = torch.arange(T, device=heads.device, dtype=torch.float64)  # [T]
    rank = torch.where((votes > 0) & (pos < T - 1), votes * T + pos, -1.0)  # [B, T] by votes, then the later key
    top = rank.topk(min(n, T), dim=-1).indices  # [B, n]
    keep = torch.zeros(B, T, dtype=torch.bool, device=heads.device)
    keep.scatter_(1, top, rank.gather(1, top) >= 0)  # only keys some pair keeps
    keep[:, -1] = True
    keep = keep.unsqueeze(1)  # [B, 1, T]
    return HeadKept(keep, torch.zeros(keep.shape, dtype=torch.float32, device=keep.device), queries, heads)
