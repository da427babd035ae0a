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

Two representations of a decision (docs/method.md, section 3):

- per query (:meth:`Policy.keep` -> :class:`Kept`): used by ``reencode`` and ``prefill_evict``, where
  each target's query has its own cache;
- one eviction step per key (:meth:`Policy.evict`, driven by
  :func:`truncsens.policies.streaming.run_stream`): used by ``streaming``, where one cache evicts as it
  goes. At each chunk end the policy sees a :class:`StreamView` (the keys still cached and the
  statistics the evicted run itself computed) and returns the keys it keeps (a subset: an evicted key
  never comes back).

Granularity (docs/method.md, "Granularity"): ``token`` (default) gives one kept set per sequence and
query, shared by every layer and head; ``head`` gives one per (sequence, key/value head), shared by
every layer (kvpress also differs per layer; we do not). Policies stay per row: the engine folds the
KV heads into the batch (:func:`fold_heads`, one seed per row from :func:`head_seeds`), runs
``keep``/``evict`` unchanged on B·Hkv rows, and unfolds the result (:func:`unfold_heads`).
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from truncsens.policies.errors import PolicyError  # (defined there, imported from here too)
from truncsens.policies.kept import Kept  # (defined there, imported from here too)
from truncsens.policies.steps import recent_eviction_steps
from truncsens.policies.stream_view import StreamStep, StreamView  # (defined there, imported from here too)

# What a policy may need from the semantics it runs under (see truncsens.engine.semantics, whose
# semantics each declare which of these they provide).
LOGIT_OFFSETS = "logit_offsets"  # additive attention-logit offsets on kept keys (the Hájek correction)
ATTENTION_SCORES = "attention_scores"  # attention each key received, from the attention weights of a pass
KEY_NORM_SCORES = "key_norm_scores"  # L2 norms of the cached keys
OBSERVATION_WINDOW = "observation_window"  # attention rows of the last prompt queries of a full prefill (SnapKV)
# the same per layer and key/value head, with kept sets per layer and head decoded exactly (SnapKV as published)
LAYER_OBSERVATION_WINDOW = "layer_observation_window"
PER_QUERY_DRAWS = "per_query_draws"  # an independent kept set per query (not one cache evicting as it goes)
MERGED_SLOTS = "merged_slots"  # cache slots whose keys/values are replaced by merges, with a per-slot logit bias
CAPABILITIES = (LOGIT_OFFSETS, ATTENTION_SCORES, KEY_NORM_SCORES, OBSERVATION_WINDOW, LAYER_OBSERVATION_WINDOW,
                PER_QUERY_DRAWS, MERGED_SLOTS)
# score kinds (Policy.score_kind) -> the capability they need
SCORE_KINDS = {"attention": ATTENTION_SCORES, "last_attention": ATTENTION_SCORES, "key_norm": KEY_NORM_SCORES,
               "window_attention": OBSERVATION_WINDOW, "layer_window_attention": LAYER_OBSERVATION_WINDOW}


TIE_TOLERANCE = 1e-4
"""Relative gap below which two neighbouring scores count as tied when a policy ranks them
(:func:`top_per_row`, :func:`smallest_k`). Scores come from float32 attention: another machine's
kernels (AVX-512 against AVX2, another thread count) move them by a few ulps (about 1e-7 relative
each), so scores that close are ordered by rounding, not by the model. In a previous-token head every
key of the window receives about 1 from its successor: the scores lie within a few 1e-5 of each
other, and ranked by value, which of them a policy kept changed from one CPU to the next. A run of
scores whose neighbours are within 1e-4 is one tie group, broken by position like exact ties, so the
kept set is the same on every machine."""


class Policy:
    """Base of the retention policies: subclasses are dataclasses that set ``name`` and implement
    :meth:`keep`.

    A policy never names a semantics: it declares what it needs (:meth:`requirements`, from
    :data:`CAPABILITIES`), and each semantics says what it provides.

    Class attributes:
        name: registry name (``--policy NAME``).
        randomized: whether the kept sets depend on the seeds (``random``, ``poisson``); such a policy
            is measured once per draw (:func:`truncsens.engine.kernel.measure_draws`).
        layer_heads: whether :meth:`keep` returns kept sets per layer and key/value head
            (:class:`~truncsens.policies.kept.HeadKept`: ``snapkv``, kvpress presses); such a policy
            sets its own granularity (``--granularity token`` only) and runs the exact protocol only.
        shared_variant: for a ``layer_heads`` policy, the registered policy that decides by the same
            rule with one kept set for every layer and head (``snapkv``: ``snapkv_shared``), named
            where per-layer, per-head sets cannot run (sliding-window layers); None when there is none.
        merges: whether the policy merges evicted keys into kept slots (:mod:`truncsens.policies.merging`)
            instead of returning kept sets.
    """

    name: ClassVar[str] = ""
    randomized: ClassVar[bool] = False  # kept sets depend on the seeds: measured once per draw (--draws)
    # streaming: the cache holds k - 1 keys between queries in expectation, not surely, and the
    # offsets of drawn keys follow their inclusion probabilities as they are thinned (poisson)
    expected_budget: ClassVar[bool] = False
    layer_heads: ClassVar[bool] = False  # kept sets per layer and key/value head (HeadKept)
    shared_variant: ClassVar[str | None] = None  # the same rule with one kept set for all layers and heads
    tie_tolerance: ClassVar[float] = TIE_TOLERANCE  # relative gap below which scores it ranks tie (0: exact ties only)
    merges: ClassVar[bool] = False  # folds evicted keys into kept slots (truncsens.policies.merging), no kept set

    def score_kind(self) -> str | None:
        """Which ``scores`` :meth:`keep` and :meth:`evict` need (a key of :data:`SCORE_KINDS`), or None:

        - ``"attention"``: attention each key received, accumulated over the queries so far (mean over
          layers and heads, or over layers and a KV head's query heads under head granularity; H2O,
          arXiv 2306.14048);
        - ``"last_attention"``: attention of the newest processed query (TOVA, arXiv 2401.06104);
        - ``"key_norm"``: L2 norm of each key (mean over layers and key/value heads);
        - ``"window_attention"``: attention of an observation window of prompt queries (SnapKV,
          arXiv 2404.14469; per-query only, see :meth:`window_scores`);
        - ``"layer_window_attention"``: the mean attention row of an observation window per layer and
          key/value head, [L, B, Hkv, Q, T] (:meth:`observation_window`; SnapKV as published).
        """
        return None

    def observation_window(self) -> int:  # pragma: no cover
        """w, the prompt queries before each query whose mean attention row a ``layer_window_attention``
        policy reads (only for those policies)."""
        raise NotImplementedError

    @property
    def needs_scores(self) -> bool:
        """Whether :meth:`keep` needs ``scores``."""
        return self.score_kind() is not None

    def requirements(self) -> frozenset[str]:
        """Capabilities (of :data:`CAPABILITIES`) the semantics must provide for this policy."""
        return frozenset({SCORE_KINDS[self.score_kind()]} if self.needs_scores else ())

    def window_rows(self, queries: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """[R] int64 sorted query positions whose attention rows :meth:`window_scores` reads for the
        queries [Q] (only for ``window_attention`` policies)."""
        raise NotImplementedError

    def window_scores(self, attention: torch.Tensor, queries: torch.Tensor,
                      rows: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover
        """[B, Q, T] scores from full-prefill attention rows [B, R, T] of the query positions ``rows``
        [R] (at least :meth:`window_rows`; None: the full matrix [B, T, T]); only for
        ``window_attention`` policies."""
        raise NotImplementedError

    def stream_protected(self, end: int, budget: int, device) -> torch.Tensor:
        """[end] bool keys surely kept at a chunk end of ``end`` processed tokens (default: none)."""
        return torch.zeros(end, dtype=torch.bool, device=device)

    def recent_kept_first(self) -> int | None:
        """S when the policy streams as "keep the first S keys and the most recent others" (``suffix``:
        0, ``sink_recent``: its sinks), else None (the default)."""
        return None

    def recent_span(self, budget: int) -> int | None:
        """Tokens of the recent past a budget of ``budget`` keys keeps, the query's own included:
        ``budget - S`` for a :meth:`recent_kept_first` policy (``suffix``: k, ``sink_recent``: k − its
        sinks), the window of a truncation run that keeps the same recent keys; None for any other
        policy (what it keeps is no recent window). ``compare-policies --truncation`` fits D against it."""
        first = self.recent_kept_first()
        return None if first is None else int(budget) - first

    def recent_span_rule(self) -> str | None:
        """:meth:`recent_span` in words, for reports: ``"span = k"``, or ``"span = k - 4 (the 4 first tokens
        kept are not recent past)"``; None for a policy without a recent span."""
        first = self.recent_kept_first()
        if first is None:
            return None
        return "span = k" if first == 0 else f"span = k - {first} (the {first} first tokens kept are not recent past)"

    def eviction_steps(self, budget: int, context_len: int, chunk: int, seeds: Sequence[int],
                       device) -> torch.Tensor | None:
        """[B, T] int64 streaming eviction step of every key of B = ``len(seeds)`` sequences, computed
        without the per-step loop when the policy's decisions need no model statistics: from positions
        alone for a :meth:`recent_kept_first` policy (:func:`truncsens.policies.steps.recent_eviction_steps`,
        the same for every sequence), or from the keys' priorities (``random`` overrides this); None
        when :func:`~truncsens.policies.streaming.run_stream` must decide chunk by chunk. Equal to what
        run_stream decides (tests/test_policies.py)."""
        first = self.recent_kept_first()
        if first is None:
            return None
        steps = recent_eviction_steps(first, budget, context_len, chunk, device)  # [T]
        return steps.expand(len(seeds), context_len).clone()  # [B, T]

    def stream_value(self, view: "StreamView") -> torch.Tensor:  # pragma: no cover - abstract
        """[B, end] float: the higher, the later a key is evicted (see :meth:`evict`)."""
        raise NotImplementedError(f"policy {self.name} has no streaming eviction rule")

    def evict(self, view: "StreamView") -> "StreamStep":
        """One streaming eviction step: keep the :meth:`stream_protected` keys and, of the other cached
        keys, those of highest :meth:`stream_value`, at most ``budget - 1`` in all (the next query's own
        token fills the budget). Rows that hold at most ``budget - 1`` keys keep them all.

        Args:
            view: :class:`StreamView` at a chunk end.

        Returns:
            :class:`StreamStep` (offsets and draws unchanged).
        """
        protected = view.by_position(self.stream_protected(view.end, view.budget, view.alive.device)) & view.alive  # [B, n]
        free = (view.budget - 1 - protected.sum(-1)).clamp(min=0)  # [B]
        keep = protected | top_per_row(self.stream_value(view), view.alive & ~protected, free, self.tie_tolerance)
        return StreamStep(keep, view.offset, view.drawn)

    def min_budget(self) -> int:
        """Smallest budget the policy accepts (tokens)."""
        return 1

    def check(self, budget: int, context_len: int) -> None:
        """Raise :class:`PolicyError` when ``budget`` does not fit this policy or a context of ``context_len`` tokens."""
        if budget < self.min_budget():
            raise PolicyError(f"policy {self.name}: budget {budget} is below its minimum of {self.min_budget()} token{'s' if self.min_budget() != 1 else ''}")
        if budget > context_len:
            raise PolicyError(
                f"budget {budget} is larger than the available context of {context_len} tokens; "
                f"use budgets up to {context_len} (or a longer --reference-context)")

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None) -> Kept:  # pragma: no cover - abstract
        """Kept keys and offsets for ``len(seeds)`` sequences; see the subclasses."""
        raise NotImplementedError


def tie_groups(ordered: torch.Tensor, tolerance: float) -> torch.Tensor:
    """[..., T] int64 group ids of values already sorted along the last dim: a new group starts where
    the gap to the previous value exceeds ``tolerance`` times the larger magnitude of the two
    (:data:`TIE_TOLERANCE`); ``tolerance`` 0 groups exactly equal values only. Infinite values (entries
    that are not allowed) form their own group."""
    a, b = ordered[..., :-1], ordered[..., 1:]  # [..., T-1] neighbours
    gap = (b - a).abs()  # [..., T-1]; inf - inf is NaN: the same group
    new = (gap > tolerance * torch.maximum(a.abs(), b.abs())) | (a.isinf() ^ b.isinf())  # [..., T-1]
    first = torch.zeros_like(ordered[..., :1], dtype=torch.int64)  # [..., 1]
    return torch.cat([first, new.to(torch.int64).cumsum(-1)], dim=-1)  # [..., T]


def _rank_by_groups(masked: torch.Tensor, descending: bool, later_first: bool, tolerance: float) -> torch.Tensor:
    """[..., T] rank (0 = kept first) of every entry: by value (tie groups of :func:`tie_groups`), then
    by position (the later first where ``later_first``)."""
    T = masked.shape[-1]
    ordered, order = torch.sort(masked, dim=-1, descending=descending, stable=True)  # [..., T] each
    group = torch.empty_like(order)
    group.scatter_(-1, order, tie_groups(ordered, tolerance))  # [..., T] group of each position
    pos = torch.arange(T, device=masked.device).expand_as(order)  # [..., T]
    key = group * T + ((T - 1 - pos) if later_first else pos)  # [..., T] distinct per row
    ranked = torch.argsort(key, dim=-1)  # [..., T] positions in keep order
    rank = torch.empty_like(ranked)
    rank.scatter_(-1, ranked, torch.arange(T, device=masked.device).expand_as(ranked))  # [..., T]
    return rank


def top_per_row(values: torch.Tensor, allowed: torch.Tensor, counts: torch.Tensor | int,
                tolerance: float = TIE_TOLERANCE) -> torch.Tensor:
    """[B, T] bool marking, in each row, the ``counts[b]`` allowed entries of largest ``values``
    (ties, values within ``tolerance`` relative of each other (:data:`TIE_TOLERANCE`): the later
    position first; every allowed entry where a row has fewer).

    Args:
        values: [B, T] float; allowed: [B, T] bool; counts: [B] int64 or an int, >= 0;
        tolerance: relative gap below which values tie (0: exact ties only).
    """
    B, T = values.shape
    counts = torch.as_tensor(counts, device=values.device).expand(B)  # [B]
    masked = torch.where(allowed, values.to(torch.float64), torch.full((B, T), float("-inf"), dtype=torch.float64,
                                                                        device=values.device))  # [B, T]
    rank = _rank_by_groups(masked, descending=True, later_first=True, tolerance=tolerance)  # [B, T]
    return allowed & (rank < counts.unsqueeze(-1))


def keep_top(context_len: int, budget: int, queries: torch.Tensor, protected: torch.Tensor,
             scores: torch.Tensor) -> Kept:
    """Per-query kept sets: the ``protected`` keys (and the query's own token) plus the available keys
    of highest score, ``budget`` in all (everything for queries with ``q + 1 <= budget``).

    Args:
        context_len: T; budget: k; queries: [Q] int64; protected: [Q, T] bool; scores: [B, Q, T].

    Returns:
        :class:`Kept` with zero offsets.
    """
    B, Q, T = scores.shape
    avail = causal(context_len, queries)  # [Q, T]
    own = torch.arange(T, device=queries.device).unsqueeze(0) == queries.unsqueeze(1)  # [Q, T]
    prot = ((protected | own) & avail).unsqueeze(0).expand(B, Q, T)  # [B, Q, T]
    free = (budget - prot.sum(-1)).clamp(min=0).reshape(B * Q)  # [B*Q]
    rest = (avail.unsqueeze(0) & ~prot).reshape(B * Q, T)  # [B*Q, T]
    top = top_per_row(scores.reshape(B * Q, T), rest, free).view(B, Q, T)  # [B, Q, T]
    keep = prot | top
    return Kept(keep, torch.zeros(keep.shape, dtype=torch.float32, device=keep.device), queries)


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


def smallest_k(values: torch.Tensor, allowed: torch.Tensor, k: int, tolerance: float = TIE_TOLERANCE) -> torch.Tensor:
    """[..., T] bool marking the ``k`` smallest ``values`` among ``allowed`` entries of each row
    (every allowed entry where a row has at most ``k``).

    ``torch.topk`` gives the k-th and (k+1)-th smallest values; where they are more than ``tolerance``
    apart (relative, :data:`TIE_TOLERANCE`) in every row, the k-th is the threshold. Other rows are
    ranked by tie groups (:func:`tie_groups`), ties broken by position (the earlier first).

    Args:
        values: [..., T] float.
        allowed: [..., T] bool.
        k: entries to keep per row, >= 0.
        tolerance: relative gap below which values tie (0: exact ties only, e.g. for seeded uniforms).
    """
    if k <= 0:
        return torch.zeros_like(allowed)
    T = values.shape[-1]
    masked = torch.where(allowed, values, torch.full_like(values, float("inf")))  # [..., T]
    if allowed.sum(-1).max() <= k:
        return allowed.clone()
    two = torch.topk(masked, min(k + 1, T), dim=-1, largest=False).values  # [..., k+1] ascending
    kth, after = two[..., k - 1 : k], two[..., k : k + 1]  # [..., 1] each
    separated = (after - kth) > tolerance * torch.maximum(kth.abs(), after.abs())  # [..., 1]; inf - inf: NaN
    few = allowed.sum(-1, keepdim=True) <= k  # [..., 1] rows keeping every allowed entry
    if bool((separated | few).all()):
        return allowed & ((masked <= kth) | few)
    rank = _rank_by_groups(masked, descending=False, later_first=False, tolerance=tolerance)  # [..., T]
    return allowed & (rank < k)


GRANULARITIES = ("token", "head")


def check_granularity(granularity: str) -> None:
    """Raise :class:`PolicyError` unless ``granularity`` is one of :data:`GRANULARITIES`."""
    if granularity not in GRANULARITIES:
        raise PolicyError(f"granularity (--granularity) must be token or head, got {granularity!r}")


def head_seeds(seeds: Sequence[int], n_heads: int) -> list[int]:
    """One seed per (sequence, key/value head), in the folded row order ``b·Hkv + h``.

    Seed of head h of a sequence of seed s: the first 8 bytes of BLAKE2b("s:kv_head:h") as an
    integer below 2^63, so heads draw independently and a head's draw depends neither on batching
    nor on the other heads.

    Args:
        seeds: B sequence seeds; n_heads: Hkv >= 1.

    Returns:
        B·Hkv seeds.
    """
    import hashlib

    out = []
    for s in seeds:
        for h in range(n_heads):
            digest = hashlib.blake2b(f"{int(s)}:kv_head:{h}".encode(), digest_size=8).digest()
            out.append(int.from_bytes(digest, "big") % (2**63))
    return out


def fold_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, ...] -> [B·Hkv, ...] (row ``b·Hkv + h``; a view when contiguous)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def unfold_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B·Hkv, ...] -> [B, Hkv, ...] (the inverse of :func:`fold_heads`)."""
    return x.reshape(x.shape[0] // n_heads, n_heads, *x.shape[1:])


def expand(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """[Q, T] -> [B, Q, T] (a view)."""
    return mask.unsqueeze(0).expand(batch, *mask.shape)
