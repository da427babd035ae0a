"""What a policy's per-query decision is: plain data, no model and no engine (docs/method.md, section 3).

- :class:`Kept`: one kept set per sequence and query (or per key/value head under ``--granularity
  head``), with the additive logit offset of each kept key;
- :class:`HeadKept`: a :class:`Kept` plus kept sets per layer and key/value head, as kvpress presses
  keep (:mod:`truncsens.policies.kvpress_adapter`); the engine decodes it against a cache gathered per
  layer and head (:func:`truncsens.engine.rerotation.decode_gathered`).

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
