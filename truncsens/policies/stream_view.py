"""What a streaming policy sees at a chunk end and what it answers (docs/method.md, section 3).

The engine's streaming driver (:func:`truncsens.policies.streaming.run_stream`) builds a
:class:`StreamView` after each chunk and passes it to :meth:`truncsens.policies.base.Policy.evict`,
which returns a :class:`StreamStep`: the keys kept (a subset of the cached ones: an evicted key never
comes back), their logit offsets, which were drawn at random and, for a thinning design, their
inclusion probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from truncsens.policies.errors import PolicyError


@dataclass
class StreamView:
    """What a streaming policy sees at a chunk end, after ``end`` tokens were processed (B sequences).

    Attributes:
        alive: [B, end] bool keys still cached (the chunk just processed included).
        offset: [B, end] float32 logit offsets of cached keys (fixed when a key is drawn).
        drawn: [B, end] bool keys that were already drawn at random (random policies draw once per key).
        budget: k, kept keys of a query, its own included: at most k - 1 keys stay cached.
        end: tokens processed.
        uniforms: [B, end] float64, one uniform per key from the sequence's seed (:func:`uniforms`).
        accumulated: [B, end] float32 attention each key received from the processed queries of the
            evicted run (mean over layers and heads), or None when the policy needs none.
        Under head granularity the B rows are (sequence, key/value head) pairs (:func:`fold_heads`),
        and the statistics are those of the row's KV head (mean over layers and its query heads).
        last: [B, end] float32 attention of the newest processed query, or None.
        key_norm: [B, end] float32 key L2 norms (mean over layers and key/value heads), or None.
        pi: [B, end] float64 inclusion probability of each cached key given the run so far (1 on keys
            never drawn), for designs that thin drawn keys (``poisson``); None: ``exp(-offset)`` on
            drawn keys, 1 elsewhere (:meth:`inclusion`).
        positions: [B, n] int64 position of each column, or None: column j is key j (n = end). A
            cache compacted to its live slots (``certify --semantics streaming``) passes its n slots,
            in increasing position within each row (columns of keys not cached: any position); every
            other [B, ...] tensor then has n columns instead of end.
    """

    alive: torch.Tensor
    offset: torch.Tensor
    drawn: torch.Tensor
    budget: int
    end: int
    uniforms: torch.Tensor
    accumulated: torch.Tensor | None = None
    last: torch.Tensor | None = None
    key_norm: torch.Tensor | None = None
    pi: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def columns(self) -> torch.Tensor:
        """[B, n] int64 the position of each column (``arange(end)`` on every row without :attr:`positions`)."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.end, device=self.alive.device).expand(self.alive.shape)

    def by_position(self, values: torch.Tensor) -> torch.Tensor:
        """[B, n] ``values`` [end] (one per position) read at each column's position (0 on a column
        whose position lies outside 0..end-1)."""
        if self.positions is None:
            return values.unsqueeze(0).expand(self.alive.shape)
        inside = (self.positions >= 0) & (self.positions < self.end)
        return torch.where(inside, values[self.positions.clamp(0, self.end - 1)], torch.zeros((), dtype=values.dtype,
                                                                                              device=values.device))

    def inclusion(self) -> torch.Tensor:
        """[B, end] float64 :attr:`pi`, or, without it, ``exp(-offset)`` on drawn keys and 1 elsewhere."""
        if self.pi is not None:
            return self.pi.to(torch.float64)
        return torch.where(self.drawn, torch.exp(-self.offset.to(torch.float64)), torch.ones_like(self.offset, dtype=torch.float64))

    def scores(self, kind: str) -> torch.Tensor:
        """[B, end] online scores of a kind (``attention``, ``last_attention`` or ``key_norm``).

        Raises:
            PolicyError: the kind has no online version (``window_attention``) or was not computed.
        """
        value = {"attention": self.accumulated, "last_attention": self.last, "key_norm": self.key_norm}.get(kind)
        if value is None:
            raise PolicyError(f"no online {kind} scores in this streaming step")
        return value


@dataclass
class StreamStep:
    """A policy's answer to a :class:`StreamView`: keep [B, end] bool (a subset of ``alive``),
    offset [B, end] float32, drawn [B, end] bool and, for a thinning design, pi [B, end] float64
    (see :class:`StreamView`; None: unchanged)."""

    keep: torch.Tensor
    offset: torch.Tensor
    drawn: torch.Tensor
    pi: torch.Tensor | None = None
