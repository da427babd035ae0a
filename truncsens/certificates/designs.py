"""Which sampling design certify draws, and from which score: one design per layer and key/value
head (the default), or one shared by every layer and head (the token-level ablation, the design of
truncsens before per-head designs).

A per-head design gives each (layer l, key/value head h) its own kept set and inclusion
probabilities π from that head's own score, one a server has at eviction time (after the prefill of
the first T − 1 tokens, before the target's query exists):

- ``window``: the attention the last W prefill queries paid to each key, summed over those rows and
  the query heads of the group (the observation window of SnapKV, Li et al. 2024, arXiv 2404.14469;
  default W = 32);
- ``h2o``: the attention every prefill query paid to each key, summed (H2O, Zhang et al. 2023,
  arXiv 2306.14048);
- ``key_norm``: the L2 norm of each key (the ``key_norm`` score of the poisson policy).

Budgets count per head, as kvpress counts them: every (layer, head) keeps k keys of the target's
query (in expectation for poisson). The token-level design reads one score, the attention each key
received summed over layers, heads and every query row including the target's (the
``attention`` score of :mod:`truncsens.certificates.passes` before per-head designs), and one kept set
serves every layer and head.

Why per head: an independent float64 Monte Carlo (docs/certify.md) found the shared
design's coverage far below nominal at small budgets because a head whose query leans on a key the
shared score ranks low gives that key a tiny π; π from the head's own observation-window attention
closed most of the gap.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

GRANULARITIES = ("head", "token")
SCORES = ("window", "h2o", "key_norm")
DEFAULT_OBS_WINDOW = 32
DEFAULT_TEMPER = 0.5  # γ of the default design, chosen on development documents (benchmarks/certify_designs.py)


class DesignError(ValueError):
    """A design option out of range; the message names the option."""


@dataclass(frozen=True)
class CertifyDesign:
    """The sampling design of a certify run.

    Attributes:
        granularity: "head" (one design per layer and key/value head) or "token" (one shared design).
        score: the per-head score, one of :data:`SCORES` (ignored under "token").
        obs_window: W, prefill query rows of the ``window`` score (>= 1).
        temper: γ > 0: π is drawn from score^γ (γ < 1 flattens the score, spreading π over more keys).

    Raises:
        DesignError: an unknown granularity or score, or W < 1.
    """

    granularity: str = "head"
    score: str = "window"
    obs_window: int = DEFAULT_OBS_WINDOW
    temper: float = DEFAULT_TEMPER

    def __post_init__(self) -> None:
        if not (self.temper > 0 and self.temper < float("inf")):
            raise DesignError(f"temper (--temper) must be a positive number, got {self.temper}")
        if self.granularity not in GRANULARITIES:
            raise DesignError(f"granularity (--granularity) must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.score not in SCORES:
            raise DesignError(f"score (--score) must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.obs_window < 1:
            raise DesignError(f"obs_window (--obs-window) must be at least 1 query row, got {self.obs_window}")

    @property
    def per_head(self) -> bool:
        return self.granularity == "head"

    def describe(self) -> str:
        """The ``design`` attr, e.g. ``"per layer and key/value head, score window (W = 32)"``."""
        if not self.per_head:
            return "one design shared by every layer and head, score: attention received over all layers, heads and queries"
        score = f"window (W = {self.obs_window})" if self.score == "window" else self.score
        temper = "" if self.temper == 1 else f", tempered (score^{self.temper:g})"
        return f"per layer and key/value head, score {score}{temper}"

    def tempered(self, scores):
        """``scores ** temper`` (scores unchanged at the default 1)."""
        return scores if self.temper == 1 else scores.clamp_min(0) ** self.temper


def layer_head_seeds(seeds: Sequence[int], n_layers: int, n_kv_heads: int) -> list[int]:
    """One seed per (target, layer, key/value head), in the row order ``(b·L + l)·Hkv + h``: the first
    8 bytes of BLAKE2b("s:layer:l:kv_head:h") below 2^63 for a target of seed s, so every head draws
    independently of the others and of batching."""
    out = []
    for s in seeds:
        for layer in range(n_layers):
            for h in range(n_kv_heads):
                digest = hashlib.blake2b(f"{s}:layer:{layer}:kv_head:{h}".encode(), digest_size=8).digest()
                out.append(int.from_bytes(digest, "little") & (2**63 - 1))
    return out
