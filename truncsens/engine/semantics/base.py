"""The base of the semantics objects (one module per semantics: :mod:`.reencode`, :mod:`.streaming`,
:mod:`.prefill_evict`; their registry in :mod:`truncsens.engine.semantics`): what a semantics declares
(positions, capabilities it provides, options and protocols it runs, the texts its results and reports
carry, cost, reference and kept passes) and the checks every semantics shares (positions, policies,
granularity, model). A refusal names the semantics able to run what was asked: each object reads them
from the registry it is built with (this module never imports the registry).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Mapping, Sequence

import torch

from truncsens.engine.attention_features import ALIBI, attention_features
from truncsens.engine.attention_rows import AttentionNeeds, AttentionRows
from truncsens.engine.granularity import fold_reference, heads_of
from truncsens.engine.attention_windows import WindowError, layer_windows
from truncsens.engine.reference_pass import ReferencePass, reference_pass
from truncsens.results import POSITIONS
from truncsens.policies.base import (
    ATTENTION_SCORES, KEY_NORM_SCORES, LAYER_OBSERVATION_WINDOW, LOGIT_OFFSETS, MERGED_SLOTS, OBSERVATION_WINDOW,
    PER_QUERY_DRAWS, Kept, Policy, PolicyError, check_granularity, head_seeds, unfold_heads,
)
from truncsens.policies.kvpress_adapter import PREFILL_LAYERS


_CAPABILITY_TEXT = {
    LOGIT_OFFSETS: "attention-logit offsets on kept keys",
    ATTENTION_SCORES: "attention scores",
    KEY_NORM_SCORES: "key norms",
    OBSERVATION_WINDOW: "the attention of an observation window of a full prefill",
    LAYER_OBSERVATION_WINDOW: ("the attention of an observation window of a full prefill per layer and key/value head, "
                               "and a decode of kept sets per layer and head"),
    PER_QUERY_DRAWS: "an independent kept set per query (--per-query; a streaming cache evicts once per key)",
    PREFILL_LAYERS: "each attention layer's inputs and keys of a full prefill (a kvpress press)",
    MERGED_SLOTS: "a cache whose slots' keys and values are replaced by merges, with a logit bias per slot",
}
ATTENTION_KINDS = ("attention", "last_attention", "window_attention", "layer_window_attention")


class SemanticsError(ValueError):
    """A semantics cannot run as asked (positions, model); the message names the fix."""


class Semantics:
    """Base of the three semantics.

    Class attributes:
        name: registry name (``--semantics NAME``, the ``semantics`` attr).
        positions: position modes it supports.
        provides: capabilities it offers policies.
        needs_transformers: whether it needs a transformers model (4D masks, caches, attention weights).
        keeps_cache: whether the reference pass keeps the full-context cache (``prefill_evict`` decodes on it).
        reference_state: whether the kept passes read state of the reference pass of the same batch
            (a cache or attention statistics); if not, reference and kept passes are batched apart.
        reference_apart: whether, although the semantics has attention statistics (``reference_state``),
            its kept passes read nothing of the reference pass but what the results record of it
            (log-probabilities, the target query's attention row): the reference pass is then batched on
            its own over N-token sequences and each (policy, budget)'s kept passes in batches sized by
            :meth:`stream_cost` (``streaming``).
        streams: whether it is one cache evicting as it goes: its decisions are taken every ``--chunk``
            tokens (the only semantics where ``--chunk`` may differ from 1; the results attr ``chunk``),
            and under the block protocol a block's targets share one stream (and its draws).
        policy_blocks: whether the block protocol runs its policy sweeps, one pass serving a block's
            targets (:mod:`truncsens.engine.block.policies`); if not, the block protocol runs only
            window-like sweeps, by re-encode passes (:mod:`truncsens.engine.block.passes`).
        score_source: where policies that read scores take them from (the results attr ``score_source``).
        block_passes: what one block's passes are under the block protocol of a policy sweep (``show``'s
            protocol note, :func:`truncsens.report.printed.protocol_note`); None without ``policy_blocks``.
        per_layer: whether it runs per-layer window sweeps (``measure --per-layer``, ``truncsens plan``;
            :mod:`truncsens.engine.layer_windows_pass`): with ``keeps_cache`` each configuration decodes the
            target's query on the one prefilled cache, without it each configuration processes the whole
            context under its layers' windows (the forward tokens of one configuration: :meth:`cost`).
        window_distances: per ``--positions`` mode, the distance a sliding-window layer's window is applied
            on (the results attr ``sliding_window_distance``, one of
            :data:`truncsens.results.SLIDING_WINDOW_DISTANCES`): keys are cached or re-encoded at
            their original positions, so sinks farther back than W from the query are not seen.
    """

    name: ClassVar[str] = ""
    positions: ClassVar[tuple[str, ...]] = ("original",)
    provides: ClassVar[frozenset[str]] = frozenset()
    needs_transformers: ClassVar[bool] = True
    reference_state: ClassVar[bool] = True
    reference_apart: ClassVar[bool] = False
    keeps_cache: ClassVar[bool] = False  # the reference pass keeps its cache for the kept passes
    streams: ClassVar[bool] = False
    policy_blocks: ClassVar[bool] = False
    score_source: ClassVar[str] = ""
    block_passes: ClassVar[str | None] = None
    per_layer: ClassVar[bool] = False
    window_distances: ClassVar[Mapping[str, str]] = {"original": "original_position"}

    def __init__(self, registry: Mapping[str, "Semantics"] | None = None) -> None:
        """``registry``: every registered semantics by name, this one included (the alternatives its
        refusals name; :data:`truncsens.engine.semantics.SEMANTICS` passes itself); None: this one alone."""
        self.registry: Mapping[str, Semantics] = {self.name: self} if registry is None else registry

    def names_where(self, able: Callable[["Semantics"], bool]) -> list[str]:
        """Names of the registered semantics for which ``able`` holds, in registry order."""
        return [s.name for s in self.registry.values() if able(s)]

    def check_positions(self, positions: str) -> None:
        """Raise :class:`SemanticsError` for an unknown or unsupported position mode."""
        if positions not in POSITIONS:
            raise SemanticsError(f"positions (--positions) must be one of {POSITIONS}, got {positions!r}")
        if positions not in self.positions:
            able = " or ".join(self.names_where(lambda s: positions in s.positions))
            raise SemanticsError(
                f"semantics {self.name} keeps original positions (keys are computed once, at their own position); "
                f"positions={positions!r} (--positions {positions}) works only with semantics (--semantics) {able}")

    def check_policy(self, policy: Policy) -> None:
        """Raise :class:`~truncsens.policies.PolicyError` when the policy needs what this semantics lacks."""
        missing = sorted(policy.requirements() - self.provides)
        if missing:
            what = ", ".join(_CAPABILITY_TEXT.get(m, m) for m in missing)
            able = self.names_where(lambda s: policy.requirements() <= s.provides)
            raise PolicyError(f"policy {policy.name} cannot be run with semantics {self.name}: it needs {what}, "
                              f"which {self.name} does not provide; use --semantics {' or '.join(able) or '?'}")

    def check_model(self, model, name: str) -> None:
        """Raise :class:`SemanticsError` when ``model`` cannot run this semantics: not a transformers
        model, attention layers whose windows the kept masks cannot express, or ALiBi position biases,
        which these models build from a 2D padding mask and cannot combine with a kept-key mask (the
        message names the feature and the semantics that runs it)."""
        if self.needs_transformers and not hasattr(model, "set_attn_implementation"):
            raise SemanticsError(
                f"semantics {self.name} needs a transformers model (masked attention and attention statistics); "
                f"{name!r} is not one: use --semantics reencode")
        if self.needs_transformers:
            if ALIBI in attention_features(model):
                raise SemanticsError(f"model {name!r} has {ALIBI.description}, which semantics {self.name} cannot "
                                     "combine with a mask of kept keys; use --semantics reencode")
            windows_of(model, self.name, name)

    def check_policy_model(self, policy: Policy, model) -> None:
        """Raise :class:`SemanticsError` when ``policy``'s kept sets cannot run on ``model`` under this
        semantics (checked before any pass): a merging policy on a model with sliding-window layers
        (a merged slot has no single position to window)."""
        if policy.merges and hasattr(model, "set_attn_implementation"):
            windows = windows_of(model, self.name)
            if windows.windowed:
                raise SemanticsError(f"policy {policy.name} merges keys of different positions into one slot, which "
                                     f"sliding-window layers cannot window; this model has {windows.describe()}")

    def check_merging(self, policy: Policy, positions: str, granularity: str) -> None:
        """Raise :class:`~truncsens.policies.PolicyError` for a merging policy with ``--positions
        reindexed`` or ``--granularity head`` (one merge decision per slot, at original positions)."""
        if positions != "original" or granularity != "token":
            raise PolicyError(f"policy {policy.name} merges slots at their original positions, one decision for "
                              "every head: use --positions original and --granularity token")

    def check_granularity(self, granularity: str) -> None:
        """Raise :class:`~truncsens.policies.PolicyError` for an unknown granularity, or
        :class:`SemanticsError` for ``head`` under a semantics without per-head caches."""
        check_granularity(granularity)
        if granularity == "head" and not self.needs_transformers:
            raise SemanticsError(f"granularity='head' (--granularity head) needs a per-head cache; semantics {self.name} re-encodes one "
                                 "sequence of kept tokens, which has a single kept set: use --granularity token")

    def queries(self, context_len: int, device: torch.device | str) -> torch.Tensor:
        """[Q] int64 query positions a policy decides kept keys for: the target's query (T - 1) only."""
        return torch.tensor([context_len - 1], device=device)

    def cost(self, context_len: int, budget: int) -> int:
        """Forward tokens per target of one kept pass at ``budget`` (the reference pass not included)."""
        raise NotImplementedError

    def stream_cost(self, context_len: int, budget: int, chunk: int, policy: Policy, model=None,
                    granularity: str = "token") -> int:
        """Tokens one target's kept pass of ``policy`` at ``budget`` holds at once, what its batch is sized
        by (``max_batch_tokens // stream_cost`` targets, :mod:`truncsens.engine.kernel`): here one
        forward over the whole context, ``context_len`` (N)."""
        return context_len

    def reference(self, model, input_ids: torch.Tensor, policies: Sequence[Policy],
                  granularity: str = "token", queries: int = 1) -> ReferencePass:
        """Full-context pass over ``input_ids`` [B, T] with what ``policies`` and the kept passes need
        (statistics per key/value head under head granularity; the attention rows of
        :meth:`attention_needs`, without a T × T matrix); the outputs of the last ``queries``
        positions (the block protocol: :func:`~truncsens.engine.reference_pass.reference_pass`)."""
        kinds = {p.score_kind() for p in policies}
        needs = self.attention_needs(policies, input_ids.shape[1], queries)
        return reference_pass(model, input_ids, last_attention=True, key_norm="key_norm" in kinds,
                              keep_cache=self.keeps_cache, heads=heads_of(model, granularity), queries=queries,
                              needs=needs)

    def attention_needs(self, policies: Sequence[Policy], context_len: int, queries: int = 1) -> AttentionNeeds:
        """The attention rows and accumulated rows :meth:`scores` reads for ``policies`` at the target
        queries (those of :meth:`queries`, and the last ``queries`` positions of the block protocol,
        whose prefixes are the targets' references): accumulated attention at each target query
        (``attention``), the row before it (``last_attention``), the policy's observation windows
        (``window_attention``, :meth:`~truncsens.policies.base.Policy.window_rows`), the observation
        window of each target query per layer and key/value head (``layer_window_attention``,
        :meth:`~truncsens.policies.base.Policy.observation_window`)."""
        T = context_len
        targets = sorted(set(self.queries(T, "cpu").tolist()) | set(range(T - queries, T)))
        rows, cumulative, windows = set(), set(), set()
        for policy in policies:
            kind = policy.score_kind()
            if kind == "attention":
                cumulative |= set(targets)
            elif kind == "last_attention":
                rows |= {t - 1 for t in targets if t > 0}
            elif kind == "window_attention":
                rows |= set(policy.window_rows(torch.tensor(targets)).tolist())
            elif kind == "layer_window_attention":
                windows |= {(t, policy.observation_window()) for t in targets}
        return AttentionNeeds.of(rows, cumulative, windows)

    def scores(self, policy: Policy, ref: ReferencePass, queries: torch.Tensor) -> torch.Tensor | None:
        """[B, Q, T] scores for ``policy`` from the full-context reference pass, or None when it needs none
        (with a per-head ``ref`` folded by :func:`fold_reference`, B counts (sequence, KV head) rows).

        ``attention``: attention each key received, accumulated over layers, heads and the queries
        up to each query (H2O-style, arXiv 2306.14048); ``last_attention``: the attention row of the
        query before each query (TOVA, arXiv 2401.06104; zeros for query 0); ``window_attention``: the
        policy's :meth:`~truncsens.policies.base.Policy.window_scores` of the attention rows (SnapKV,
        arXiv 2404.14469); ``layer_window_attention``: [L, B, Hkv, Q, T], the mean row of each query's
        observation window per layer and key/value head (SnapKV as published); ``key_norm``: mean L2
        norm of each key. Attention scores read ``ref.rows`` (:meth:`attention_needs`), or the full
        matrix ``ref.attention`` when only that is there (not for ``layer_window_attention``).

        Raises:
            ValueError: ``ref`` lacks a row, accumulated row or window the policy reads.
        """
        kind = policy.score_kind()
        if kind is None:
            return None
        if kind in ATTENTION_KINDS:
            att = ref.rows if ref.rows is not None else AttentionRows.of_matrix(ref.attention)
            if kind == "layer_window_attention":
                w = policy.observation_window()
                return torch.stack([att.layer_window(int(q), w) for q in queries.tolist()], 3)  # [L, B, Hkv, Q, T]
            if kind == "attention":
                return att.accumulated(queries)  # [B, Q, T]
            if kind == "last_attention":
                rows = att.row((queries - 1).clamp(min=0))  # [B, Q, T]
                return torch.where((queries > 0).view(1, -1, 1), rows, torch.zeros_like(rows))
            window = policy.window_rows(queries)  # [R]
            return policy.window_scores(att.row(window), queries, window)  # [B, Q, T]
        B, T = ref.key_norm.shape
        return ref.key_norm.unsqueeze(1).expand(B, queries.numel(), T)  # [B, Q, T]

    def policy_logprobs(self, model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int],
                        ref: ReferencePass | None, positions: str, chunk: int = 1,
                        granularity: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``policy`` at ``budget`` on ``input_ids`` [B, T]: per-query kept sets from the reference
        pass's scores (:meth:`scores`), then :meth:`kept_logprobs`. Under head granularity the policy
        runs on B·Hkv rows (scores of ``ref`` computed with ``heads``, seeds from
        :func:`~truncsens.policies.base.head_seeds`), k keys kept per KV head.

        Returns:
            (log-probabilities [B, V] float64, keep_last [B, T] bool keys the target's query read;
            [B, Hkv, T] under head granularity).
        """
        if policy.merges:  # a merging cache (truncsens.engine.merge_pass): no kept sets
            self.check_merging(policy, positions, granularity)
            return self.merged_logprobs(model, input_ids, policy, budget, ref, chunk)
        T = input_ids.shape[1]
        queries = self.queries(T, input_ids.device)  # [Q]
        heads = heads_of(model, granularity)
        if heads:
            rows = head_seeds(seeds, heads)  # B·Hkv seeds
            scores = self.scores(policy, fold_reference(ref), queries) if ref is not None else None  # [B·Hkv, Q, T]
            kept = policy.keep(T, budget, queries, rows, scores)  # [B·Hkv, Q, T]
            kept = Kept(unfold_heads(kept.keep, heads), unfold_heads(kept.offset, heads), kept.queries)  # [B, Hkv, Q, T]
        else:
            kept = policy.keep(T, budget, queries, seeds, self.scores(policy, ref, queries) if ref is not None else None)
        return self.kept_logprobs(model, input_ids, kept, ref, positions), kept.last()

    def merged_logprobs(self, model, input_ids: torch.Tensor, policy: Policy, budget: int, ref: ReferencePass | None,
                        chunk: int) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - refused by check_policy
        """(log-probabilities [B, V], [B, T] tokens read unmerged) of a merging policy (semantics that
        provide :data:`~truncsens.policies.base.MERGED_SLOTS`)."""
        raise NotImplementedError

    def kept_logprobs(self, model, input_ids: torch.Tensor, kept: Kept, ref: ReferencePass | None,
                      positions: str) -> torch.Tensor:  # pragma: no cover - abstract
        """[B, V] float64 log-probabilities after the last token of ``input_ids`` [B, T] under ``kept``."""
        raise NotImplementedError


def windows_of(model, semantics: str, name: str | None = None):
    """The model's :class:`~truncsens.engine.attention_windows.LayerWindows`, checked for ``semantics``.

    Raises:
        SemanticsError: the model's attention layers cannot be masked per layer (see
            :meth:`~truncsens.engine.attention_windows.LayerWindows.check_supported`).
    """
    try:
        windows = layer_windows(model)
        windows.check_supported(name or getattr(getattr(model, "config", None), "_name_or_path", "") or "model", semantics)
    except WindowError as exc:
        raise SemanticsError(str(exc)) from None
    return windows
