"""``random``: keep k uniformly random keys (the query's own token and k − 1 of the earlier ones).

Source: the random-retention baseline of arXiv 2605.25085, which has about two orders of magnitude
more distortion than recency eviction at equal budget. Keeping the query's own token is [ours]: it is
the token being processed, so every cache holds it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import PER_QUERY_DRAWS, Kept, Policy, StreamView, causal, smallest_k, uniforms
from truncsens.policies.steps import chunk_bounds


@dataclass
class RandomPolicy(Policy):
    """Uniform random retention.

    Attributes:
        per_query: False (default): one draw per sequence, a random priority ``u_j ~ U(0, 1)`` per
            key; each query keeps itself and the k − 1 earlier keys of lowest priority. The kept sets
            are nested over time (an evicted key never returns), so this is a cache that a server
            could run (evict the lowest-priority key when full), and at each query the k − 1 kept
            earlier keys are a uniform random subset. True: every query draws its own independent
            uniform subset (not realizable as one cache; the same marginal law per query), so it is
            refused under ``streaming``.

    Budgets: the priorities come from the seeds alone, and the engine's seeds do not depend on the
    budget (:func:`truncsens.engine.kernel.policy_seeds`), so the kept set at budget k is a subset of
    the one at k' > k (the k - 1 lowest priorities are among the k' - 1 lowest), under every
    semantics and chunk size.

    Streaming (:meth:`evict`): the cached key of highest priority ``u_j`` is evicted, so with chunks of
    one token the kept sets equal those of :meth:`keep` (the k - 1 earlier keys of lowest priority).
    """

    name: ClassVar[str] = "random"
    randomized: ClassVar[bool] = True  # measured once per draw (truncsens.engine.kernel.measure_draws)
    tie_tolerance: ClassVar[float] = 0.0  # it ranks seeded uniforms, which no kernel rounds: exact ties only
    per_query: bool = False

    def requirements(self) -> frozenset[str]:
        """With ``per_query``: independent kept sets per query (no single cache evicting as it goes)."""
        return frozenset({PER_QUERY_DRAWS}) if self.per_query else frozenset()

    def stream_value(self, view: StreamView) -> torch.Tensor:
        """[B, end] minus the key's priority ``u_j`` (drawn once per key): the highest priority goes first."""
        return -view.uniforms

    def eviction_steps(self, budget: int, context_len: int, chunk: int, seeds: Sequence[int],
                       device) -> torch.Tensor | None:
        """[B, T] int64 streaming eviction steps without the per-step loop (None with ``per_query``).

        At every chunk end e < T the cache keeps the k - 1 keys of lowest priority among those it
        holds; since an evicted key had k - 1 lower priorities in the cache, and the cache only gets
        lower ones, this is the k - 1 lowest priorities of all keys 0..e-1. One max-heap of the kept
        priorities per sequence gives every key's step in O(T log k) (chunk ends of
        :func:`~truncsens.policies.steps.chunk_bounds`); keys never evicted get T."""
        if self.per_query:
            return None
        T = context_len
        u = uniforms(seeds, (T,), "cpu")  # [B, T] the priorities run_stream draws
        steps = torch.full((len(seeds), T), T, dtype=torch.long)  # [B, T]
        ends = [e for _, e in chunk_bounds(T, chunk) if e < T]  # the prompt chunk ends (eviction points)
        for b, row in enumerate(u.tolist()):
            heap: list[tuple[float, int]] = []  # (-u_j, j): the highest priority on top
            start = 0
            for e in ends:
                for j in range(start, e):
                    heapq.heappush(heap, (-row[j], j))
                start = e
                while len(heap) > budget - 1:
                    steps[b, heapq.heappop(heap)[1]] = e
        return steps.to(device)

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:
        """Kept keys of ``len(seeds)`` sequences.

        Args:
            context_len: T; budget: k >= 1; queries: [Q] int64.
            seeds: one seed per sequence; the same seed gives the same draw.
            scores: unused.

        Returns:
            :class:`Kept` with keep [B, Q, T] (exactly min(k, q + 1) keys per query) and zero offsets.

        Raises:
            PolicyError: budget out of range.
        """
        self.check(budget, context_len)
        B, Q, T = len(seeds), queries.numel(), context_len
        device = queries.device
        if self.per_query:
            u = uniforms(seeds, (Q, T), device)  # [B, Q, T]
        else:
            u = uniforms(seeds, (T,), device).unsqueeze(1).expand(B, Q, T)  # [B, Q, T]
        earlier = causal(T, queries) & (torch.arange(T, device=device).unsqueeze(0) != queries.unsqueeze(1))  # [Q, T]
        earlier = earlier.unsqueeze(0).expand(B, Q, T)  # [B, Q, T]
        keep = smallest_k(u, earlier, budget - 1, self.tie_tolerance)  # [B, Q, T] min(q, k - 1) earlier keys per query
        keep = keep | (torch.arange(T, device=device).unsqueeze(0) == queries.unsqueeze(1)).unsqueeze(0)  # + self
        return Kept(keep, torch.zeros(keep.shape, dtype=torch.float32, device=device), queries)
