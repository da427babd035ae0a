"""``poisson``: certainty-plus-Poisson eviction with the Hájek correction.

Source: P. Xie, "Error Certificates for KV-Cache Eviction via Randomized Design" (arXiv 2607.21475),
docs/method.md, section 5. The certain set is the attention sinks, the most recent tokens and a
top slice by score; every other (tail) key i is kept independently with probability
``π_i = min(1, c·score_i)``, ``c`` found by bisection so that the expected kept count equals the
budget k; each kept tail key gets the logit offset ``log(1/π_i)`` (the Hájek estimator, see
:mod:`truncsens.policies.poisson_design`).

[ours] The paper keeps the 32 most recent tokens; budgets here go down to 16 tokens, so the recent
and top slices are fractions of the budget (defaults 1/4 each), which keeps half of each budget for
the random tail. Scores are per query: by default the attention each key received in the
full-context reference pass, accumulated over layers, heads and the queries up to the current one
(H2O-style, Zhang et al. arXiv 2306.14048); ``key_norm`` uses the key's L2 norm instead.

Streaming [ours] (:meth:`PoissonPolicy.evict`, scores online: the evicted run's own accumulated
attention or key norms), a design whose inclusion probabilities stay known (docs/method.md,
"Streaming design"): the certain set is the sinks, the r - 1 most recent cached keys and the top t
cached keys by score that were never drawn. Every other cached key is a tail key with a current
inclusion probability π_j (1 when it has just left the certain set). At each chunk end where more
than m tail keys are cached, key j survives with probability ``ρ_j = min(1, c·score_j/π_j)``, ``c``
such that ``Σ ρ_j = m`` (:func:`~truncsens.policies.poisson_design.inclusion_probabilities` of the
scores score/π): m tail keys stay in expectation given the run so far. Key j stays where its one
uniform ``u_j < ρ_j·π_j``: since the run so far depends on u_j only through whether j was kept, u_j
is uniform on [0, π_j) given the run, so j survives with probability ρ_j and its inclusion
probability becomes ``π_j ← ρ_j·π_j = min(π_j, c·score_j)``, known at every step, and
``E[I_j/π_j] = 1`` (tests/test_stream_design.py). Its offset is ``log(1/π_j)`` at every step. The
budget holds in expectation: k - 1 keys between queries on average, the certain ones surely (the
paper's Poisson design, arXiv 2607.21475, also holds its budget in expectation).

Nested budgets [ours] (:meth:`PoissonPolicy.keep`, per-query kept sets: ``reencode``,
``prefill_evict``): the engine's seeds do not depend on the budget, so key j of query q reads the
same uniform u_qj at every budget and is kept where ``u_qj < π_qj(k)``. The certain set grows with k
(the recent and top slices never shrink, :meth:`PoissonPolicy.slices`), and since R + T grows by at
most k' - k from k to k', the scale c of ``π = min(1, c·score)`` never decreases (the tail loses the
keys that became certain, whose π summed to at most what the tail budget lost), so every tail π_j
grows with k and the kept sets are nested in the budget. Under ``streaming`` the scores are those of
the evicted run itself, which differ between budgets, so nestedness in the budget is not guaranteed
there; what holds is that every budget reads the same uniform per key (tests/test_draws.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.poisson_design import (
    PoissonDesignError, draw, hajek_offsets, inclusion_probabilities,
)
from truncsens.policies.base import (
    LOGIT_OFFSETS, Kept, Policy, PolicyError, StreamStep, StreamView, causal, not_full, recent, sinks, smallest_k,
    top_per_row, uniforms,
)

SCORES = ("attention", "key_norm")


@functools.lru_cache(maxsize=256)  # a pure function of its arguments, asked at every streaming step
def _top_slice(budget: int, recent_fraction: float, top_fraction: float) -> int:
    """``max(0, max_{1 <= j <= k} ⌊(f_r + f_t)·j⌋ - max(1, ⌊f_r·j⌋))``: the top slice before the cap of
    :meth:`PoissonPolicy.slices`, non-decreasing in k, rising only where the recent slice does not."""
    best = 0
    for j in range(1, budget + 1):
        best = max(best, int((recent_fraction + top_fraction) * j) - max(1, int(recent_fraction * j)))
    return best


@dataclass
class PoissonPolicy(Policy):
    """Certainty-plus-Poisson retention.

    Attributes:
        n_sink: first tokens kept surely (tokens).
        recent_fraction: share of the budget kept surely as the most recent tokens (at least 1, the
            query itself).
        top_fraction: share of the budget kept surely as the highest-scoring remaining keys.
        score: "attention" (default) or "key_norm"; what ``scores`` passed to :meth:`keep` mean.
    """

    name: ClassVar[str] = "poisson"
    randomized: ClassVar[bool] = True  # measured once per draw (truncsens.engine.kernel.measure_draws)
    expected_budget: ClassVar[bool] = True  # streaming: the tail is thinned to m keys in expectation
    n_sink: int = 4
    recent_fraction: float = 0.25
    top_fraction: float = 0.25
    score: str = "attention"

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise PolicyError(f"sinks (--sinks) must be >= 0, got {self.n_sink}")
        if not (0 <= self.recent_fraction <= 1 and 0 <= self.top_fraction <= 1 and self.recent_fraction + self.top_fraction <= 1):
            raise PolicyError("poisson recent and top fractions must lie in [0, 1] and sum to at most 1")
        if self.score not in SCORES:
            raise PolicyError(f"unknown poisson score {self.score!r}; choose one of {', '.join(SCORES)}")

    def min_budget(self) -> int:
        """``n_sink + 1``."""
        return self.n_sink + 1

    def score_kind(self) -> str:
        """The configured score: "attention" or "key_norm"."""
        return self.score

    def requirements(self) -> frozenset[str]:
        """Scores of its kind, and logit offsets: the Hájek offsets log(1/π) act on attention logits
        (a re-encoded context cannot carry them)."""
        return super().requirements() | {LOGIT_OFFSETS}

    def slices(self, budget: int) -> tuple[int, int, int]:
        """(recent R, top T, tail budget m) for budget k, with ``n_sink + R + T + m = k`` and R >= 1.

        ``R = min(k - n_sink, max(1, ⌊f_r·k⌋))`` and ``T = min(k - n_sink - R, max_{j <= k} ⌊(f_r + f_t)·j⌋ -
        max(1, ⌊f_r·j⌋))`` ([ours]; f_r, f_t: the recent and top fractions). R and T never decrease
        with k and R + T grows by at most one per unit of k, which makes the kept sets nested in the
        budget under common random numbers (:meth:`keep`). At budgets that are multiples of 4 with
        the default fractions 1/4 this is ``R = T = k/4``, the split of ⌊f·k⌋ each.
        """
        free = budget - self.n_sink
        r = min(free, max(1, int(self.recent_fraction * budget)))
        t = min(free - r, _top_slice(budget, self.recent_fraction, self.top_fraction))
        return r, t, free - r - t

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys and Hájek offsets of ``len(seeds)`` sequences.

        Args:
            context_len: T; budget: k > n_sink; queries: [Q] int64.
            seeds: one seed per sequence (the Poisson draws).
            scores: [B, Q, T] non-negative importance of key j for query ``queries[i]`` (entries for
                j > query are ignored).

        Returns:
            :class:`Kept`: keep [B, Q, T]; offset [B, Q, T] float32, ``log(1/π_j)`` on kept tail
            keys and 0 on certain ones. Queries with ``q + 1 <= k`` keep everything (π = 1).

        Raises:
            PolicyError: budget out of range, scores missing / misshapen / negative, or all zero on a
                tail that must be drawn from.
        """
        self.check(budget, context_len)
        B, Q, T = len(seeds), queries.numel(), context_len
        if scores is None or tuple(scores.shape) != (B, Q, T):
            raise PolicyError(f"policy poisson needs scores of shape {(B, Q, T)}, got "
                              f"{None if scores is None else tuple(scores.shape)}")
        pi, tail = self.design(budget, queries, scores)  # [B, Q, T] each
        drawn = draw(pi, uniforms(seeds, (Q, T), scores.device)) & tail  # [B, Q, T]
        certain = (pi >= 1) & ~tail  # [B, Q, T]
        offset = hajek_offsets(pi, drawn).to(torch.float32)  # [B, Q, T]
        return Kept(certain | drawn, offset, queries)

    def design(self, budget: int, queries: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling design behind :meth:`keep` (also for certificates and tests).

        Args:
            budget: k; queries: [Q] int64; scores: [B, Q, T] non-negative.

        Returns:
            (pi, tail): pi [B, Q, T] float64, 1 on certain keys, ``min(1, c·score)`` on tail keys
            (summing to the tail budget m per evicting query), 0 on unavailable keys;
            tail [B, Q, T] bool, the keys drawn at random.

        Raises:
            PolicyError: scores negative, not finite, or all zero on a tail that must be drawn from.
        """
        B, Q, T = scores.shape
        r, t, m = self.slices(budget)
        avail = causal(T, queries)  # [Q, T]
        full = ~not_full(T, queries, budget)  # [Q] queries that must evict
        base = (sinks(T, queries, self.n_sink) | recent(T, queries, r) | ~full.unsqueeze(1)) & avail  # [Q, T]
        base = base.unsqueeze(0).expand(B, Q, T)  # [B, Q, T]
        avail = avail.unsqueeze(0).expand(B, Q, T)  # [B, Q, T]
        rest = avail & ~base  # [B, Q, T]
        top = smallest_k(-scores.to(torch.float64), rest, t) if t > 0 else torch.zeros_like(rest)  # [B, Q, T]
        tail = rest & ~top  # [B, Q, T]
        expected = (full.to(torch.float64) * m).unsqueeze(0).expand(B, Q)  # [B, Q]
        try:
            pi = inclusion_probabilities(torch.where(avail, scores, torch.zeros_like(scores)), tail, expected)
        except PoissonDesignError as exc:
            raise PolicyError(str(exc)) from None
        pi = torch.where(base | top, torch.ones_like(pi), pi)  # [B, Q, T]
        return pi, tail

    def evict(self, view: StreamView) -> StreamStep:
        """One streaming step (module docstring): certain keys kept, every tail key thinned with
        known probability, ``Σ π = m`` over the tail after the step.

        Args:
            view: :class:`~truncsens.policies.base.StreamView` with online scores of :meth:`score_kind`
                and the tail's inclusion probabilities (``pi``).

        Returns:
            :class:`~truncsens.policies.base.StreamStep` with the new ``pi`` (1 on certain keys; on
            the tail keys dropped now, the probability they had to stay); rows holding at most m tail
            keys are unchanged.

        Raises:
            PolicyError: scores negative or not finite, or all zero on a tail that must be thinned.
        """
        k = view.budget
        r, t, m = self.slices(k)
        score = view.scores(self.score).to(torch.float64)  # [B, e]
        if not bool(torch.isfinite(score).all()) or bool((score < 0).any()):
            raise PolicyError("poisson scores must be finite and non-negative")
        pos = view.columns()  # [B, e] each column's position
        base = ((pos < self.n_sink) | (pos >= view.end - (r - 1))) & view.alive  # [B, e] certain
        undrawn = view.alive & ~base & ~view.drawn  # [B, e]
        top = top_per_row(score, undrawn, t)  # [B, e] certain
        tail = view.alive & ~base & ~top  # [B, e] drawn keys and the keys leaving the certain set now
        caps = torch.where(view.drawn, view.inclusion(), torch.ones_like(score))  # [B, e] current π
        thin = tail.sum(-1) > m  # [B] rows holding more than m tail keys
        positive = tail & (score > 0)
        if m > 0 and bool((thin & ~positive.any(-1)).any()):
            raise PolicyError("poisson scores are all zero: no tail token can be drawn; use score='attention' (--score attention), or a "
                              "model whose keys are not all zero")
        # a zero score on a tail key gives it the smallest positive score of its row times 1e-6
        smallest = torch.where(positive, score, torch.full_like(score, math.inf)).amin(-1, keepdim=True)  # [B, 1]
        floor = torch.where(torch.isfinite(smallest), smallest * 1e-6, torch.ones_like(smallest))
        s = torch.where(tail & (score <= 0), floor.expand_as(score), score)  # [B, e]
        try:  # survival probability ρ_j = min(1, c·s_j/π_j), Σ ρ = m over the tail: m kept in expectation
            rho = inclusion_probabilities(s / caps, tail, torch.where(thin, float(m), 0.0).to(torch.float64))  # [B, e]
        except PoissonDesignError as exc:
            raise PolicyError(str(exc)) from None
        pi = caps * rho  # [B, e] new inclusion probability min(π_j, c·s_j)
        survive = torch.where(tail, draw(pi, view.uniforms) & (pi > 0), torch.zeros_like(tail))  # [B, e]
        keep = base | top | survive
        new_pi = torch.where(tail, pi, torch.ones_like(pi))  # [B, e] 1 on certain keys; dropped ones: the π they had
        offset = torch.where(survive, hajek_offsets(new_pi, survive).to(torch.float32), torch.zeros_like(view.offset))
        drawn = view.drawn | tail
        rows = thin.unsqueeze(-1)  # [B, 1]
        old_pi = view.inclusion()
        return StreamStep(torch.where(rows, keep, view.alive), torch.where(rows, offset, view.offset),
                          torch.where(rows, drawn, view.drawn), torch.where(rows, new_pi, old_pi))
