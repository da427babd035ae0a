"""What every retention policy returns, and the index helpers they share.

A policy decides, for each query position ``q`` of a context of ``T`` tokens (positions 0..T-1),
which keys ``j <= q`` stay in the cache and which additive logit offset each kept key gets.

Conventions (shared by all policies, [ours]):

- the budget ``k`` counts the query's own token, which is always kept (it is the token being
  processed); a query with ``q + 1 <= k`` available keys keeps all of them (the cache is not full);
- offsets are 0 on surely kept keys, ``log(1/π)`` on randomly kept keys of an unequal-probability
  design (Hájek correction), and ignored on dropped keys;
- randomness comes from one seed per sequence (see :func:`uniforms`), so a target's draw does not
  depend on batching, sharding or resuming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

# What a policy may need from the semantics it runs under (see truncsens.engine.semantics, whose
# semantics each declare which of these they provide).
LOGIT_OFFSETS = "logit_offsets"  # additive attention-logit offsets on kept keys (the Hájek correction)
ATTENTION_SCORES = "attention_scores"  # attention each key received, from the attention weights of a pass
KEY_NORM_SCORES = "key_norm_scores"  # L2 norms of the cached keys
CAPABILITIES = (LOGIT_OFFSETS, ATTENTION_SCORES, KEY_NORM_SCORES)


class PolicyError(ValueError):
    """A policy cannot run as asked; the message names the problem and the fix."""


@dataclass
class Kept:
    """The kept keys of a batch of sequences, per query.

    Attributes:
        keep: [B, Q, T] bool, key j kept for query ``queries[i]`` (never true for j > query).
        offset: [B, Q, T] float32 additive logit offsets of kept keys (0 elsewhere).
        queries: [Q] int64 query positions.
    """

    keep: torch.Tensor
    offset: torch.Tensor
    queries: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        """[B, Q] int64 number of kept keys per query."""
        return self.keep.sum(-1)

    def has_offsets(self) -> bool:
        """Whether any kept key carries a non-zero offset."""
        return bool((self.offset[self.keep] != 0).any())


class Policy:
    """Base of the retention policies: subclasses are dataclasses that set ``name`` and implement
    :meth:`keep`.

    A policy never names a semantics: it declares what it needs (:meth:`requirements`, from
    :data:`CAPABILITIES`), and each semantics says what it provides.

    Class attributes:
        name: registry name (``--policy NAME``).
    """

    name: ClassVar[str] = ""

    def score_kind(self) -> str | None:
        """Which ``scores`` :meth:`keep` needs: None, "attention" or "key_norm"."""
        return None

    @property
    def needs_scores(self) -> bool:
        """Whether :meth:`keep` needs ``scores``."""
        return self.score_kind() is not None

    def requirements(self) -> frozenset[str]:
        """Capabilities (of :data:`CAPABILITIES`) the semantics must provide for this policy."""
        return frozenset({f"{self.score_kind()}_scores"} if self.needs_scores else ())

    def min_budget(self) -> int:
        """Smallest budget the policy accepts (tokens)."""
        return 1

    def check(self, budget: int, context_len: int) -> None:
        """Raise :class:`PolicyError` when ``budget`` does not fit this policy or a context of ``context_len`` tokens."""
        if budget < self.min_budget():
            raise PolicyError(f"policy {self.name}: budget {budget} is below its minimum of {self.min_budget()} tokens")
        if budget > context_len:
            raise PolicyError(
                f"budget {budget} is larger than the available context of {context_len} tokens; "
                f"use budgets up to {context_len} (or a longer --reference-context)")

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:  # pragma: no cover - abstract
        """Kept keys and offsets for ``len(seeds)`` sequences; see the subclasses."""
        raise NotImplementedError


def causal(context_len: int, queries: torch.Tensor) -> torch.Tensor:
    """[Q, T] bool: key j is available to query q (j <= q)."""
    keys = torch.arange(context_len, device=queries.device)  # [T]
    return keys.unsqueeze(0) <= queries.unsqueeze(1)


def recent(context_len: int, queries: torch.Tensor, r: int) -> torch.Tensor:
    """[Q, T] bool: the ``r`` most recent available keys of each query, the query itself included."""
    keys = torch.arange(context_len, device=queries.device)  # [T]
    return (keys.unsqueeze(0) <= queries.unsqueeze(1)) & (keys.unsqueeze(0) > queries.unsqueeze(1) - r)


def sinks(context_len: int, queries: torch.Tensor, s: int) -> torch.Tensor:
    """[Q, T] bool: the first ``s`` keys, where available to the query."""
    keys = torch.arange(context_len, device=queries.device)  # [T]
    return (keys.unsqueeze(0) < s) & (keys.unsqueeze(0) <= queries.unsqueeze(1))


def not_full(context_len: int, queries: torch.Tensor, budget: int) -> torch.Tensor:
    """[Q] bool: queries whose available keys (q + 1) fit in the budget (they keep everything)."""
    return queries + 1 <= budget


def uniforms(seeds: Sequence[int], shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """[B, *shape] float64 uniforms in [0, 1), row b drawn from a CPU generator seeded with ``seeds[b]``.

    Per-row generators make each sequence's draw independent of its batch.
    """
    rows = []
    for s in seeds:
        g = torch.Generator().manual_seed(int(s) % (2**63))
        rows.append(torch.rand(shape, generator=g, dtype=torch.float64))
    if not rows:
        return torch.zeros((0, *shape), dtype=torch.float64, device=device)
    return torch.stack(rows).to(device)


def smallest_k(values: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[..., T] bool marking the ``k`` smallest ``values`` among ``allowed`` entries of each row
    (every allowed entry where a row has at most ``k``).

    ``torch.topk`` gives the k-th smallest value as a threshold; rows where ties at the threshold
    would keep more than k entries are redone with a stable sort (ties broken by position).

    Args:
        values: [..., T] float.
        allowed: [..., T] bool.
        k: entries to keep per row, >= 0.
    """
    if k <= 0:
        return torch.zeros_like(allowed)
    masked = torch.where(allowed, values, torch.full_like(values, float("inf")))  # [..., T]
    kk = min(k, values.shape[-1])
    threshold = torch.topk(masked, kk, dim=-1, largest=False).values[..., -1:]  # [..., 1]
    keep = allowed & (masked <= threshold)
    want = torch.clamp(allowed.sum(-1), max=k)  # [...]
    if bool((keep.sum(-1) == want).all()):
        return keep
    order = torch.sort(masked, dim=-1, stable=True).indices  # [..., T]
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(values.shape[-1], device=values.device).expand_as(order))  # [..., T]
    return allowed & (rank < k)


def expand(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """[Q, T] -> [B, Q, T] (a view)."""
    return mask.unsqueeze(0).expand(batch, *mask.shape)
