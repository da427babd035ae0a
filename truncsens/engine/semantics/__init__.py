"""The three semantics of a kept context, one object each (docs/method.md, "Semantics").

Every result says which one produced it (the ``semantics`` attr), and they are never mixed:

- ``reencode``: the model reads only the kept tokens of the target's query, as a fresh sequence
  (positions ``original`` or ``reindexed``); a suffix window of w tokens is the ``suffix`` policy at
  budget w (arXiv 2605.25085).
- ``streaming``: one cache that evicts as it goes, so every token was processed when the cache held
  only the keys its policy had kept so far; an evicted key never comes back, and the policy decides
  only from what this evicted run computed (online scores). Decisions are one eviction step per key
  (:mod:`truncsens.policies.streaming`), taken every ``chunk`` tokens, and run by
  :mod:`truncsens.engine.streaming_pass`: one parallel forward when the policy reads no scores,
  attention computed from the eviction steps and ``log(1/π)`` Hájek offsets without a T x T mask
  (:mod:`truncsens.engine.evict_attention`, memory linear in T), else chunk by chunk.
- ``prefill_evict``: keys and values computed with the full context, then evicted before the
  target's query reads them (the kvpress convention): the last token is decoded against the
  full-context cache of the first T - 1 tokens with the evicted keys masked out.

A semantics declares what it needs from the model (``needs_transformers``), which position modes it
supports, what it provides to policies (:data:`truncsens.policies.base.CAPABILITIES`), which query
rows a policy decides for, its cost in forward tokens, and how it computes the kept next-token
log-probabilities of a batch. The engine (:mod:`truncsens.engine.kernel`) only calls these.

Sliding-window models (:mod:`truncsens.engine.attention_windows`): in every semantics a layer of window
W reads key j from query q only if the policy keeps j for q and ``q - j < W`` on original positions
(reindexed positions under ``reencode``). A model whose layers have different windows gets a dict
``{layer type: 4D mask}``; a model with layers that are neither full nor sliding-window attention
is refused with an error naming its windows.

Granularity (docs/method.md, "Granularity"): ``token`` gives one kept set per target shared by all
layers and heads; ``head`` (``streaming`` and ``prefill_evict`` only) one per key/value head, shared
by all layers. The policy runs unchanged on B·Hkv folded rows (scores of KV head h: mean over layers
and over the query heads of h's group; one seed per row, :func:`truncsens.policies.base.head_seeds`),
and the kept pass masks each query head with its KV head's kept set ([B, H, Tq, Tk] masks).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from truncsens.engine import evict_attention, kvcache
from truncsens.engine.forward import model_dtype, next_token_logprobs, rows_logprobs
from truncsens.engine.attention_windows import kept_attention_mask, own_window_differs
from truncsens.engine.masks import check_causal
from truncsens.engine.granularity import groups_of, heads_of
from truncsens.engine.prefill_layers import PrefillReference, record_prefill
from truncsens.engine.reference_pass import ReferencePass, reference_pass
from truncsens.engine.rerotation import HeadKept, decode_gathered
from truncsens.engine.streaming_pass import decide_offline, stream_online
from truncsens.results import POSITIONS, SEMANTICS as SEMANTICS_NAMES  # the results file's vocabulary
from truncsens.policies.base import (
    ATTENTION_SCORES, KEY_NORM_SCORES, LOGIT_OFFSETS, OBSERVATION_WINDOW, PER_QUERY_DRAWS, Kept, Policy, PolicyError,
    head_seeds,
)
from truncsens.policies.kvpress_adapter import PREFILL_LAYERS
from truncsens.policies.streaming import Evictions
from truncsens.engine.semantics.base import Semantics, SemanticsError, windows_of  # noqa: F401 (SemanticsError, windows_of re-exported)


class Reencode(Semantics):
    """The model reads only the kept tokens of the target's query, as a new sequence."""

    name = "reencode"
    positions = POSITIONS
    provides = frozenset({PER_QUERY_DRAWS})
    needs_transformers = False
    reference_state = False

    def cost(self, context_len: int, budget: int) -> int:
        """``budget`` tokens: the kept tokens are re-encoded."""
        return budget

    def reference(self, model, input_ids: torch.Tensor, policies: Sequence[Policy],
                  granularity: str = "token") -> ReferencePass:
        """Reference log-probabilities only (positions 0..T-1; ``granularity`` is always token here)."""
        B, T = input_ids.shape
        return ReferencePass(next_token_logprobs(model, input_ids, torch.arange(T, device=input_ids.device).expand(B, T)))

    @staticmethod
    def gather(kept: Kept, budget: int, positions: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept token indices and their position ids, both [B, k] int64 in increasing order.

        Raises:
            PolicyError: a row does not keep exactly ``budget`` tokens (re-encoding batches rows of one length).
        """
        keep_last = kept.keep[:, -1, :]  # [B, T] the target's query
        counts = keep_last.sum(-1)
        if not bool((counts == budget).all()):
            raise PolicyError(f"re-encoding needs exactly {budget} kept tokens per target, the policy kept {counts.tolist()}")
        B, T = keep_last.shape
        order = torch.arange(T, device=keep_last.device).expand(B, T)  # [B, T]
        index = order[keep_last].view(B, budget)  # [B, k]
        pos = index if positions == "original" else torch.arange(budget, device=index.device).expand(B, budget)
        return index, pos

    def kept_logprobs(self, model, input_ids: torch.Tensor, kept: Kept, ref: ReferencePass | None,
                      positions: str) -> torch.Tensor:
        """Re-encode ``input_ids`` [B, T] gathered at the kept indices (exactly k per row).

        With original positions and sliding-window layers, each layer's window is applied on the
        original positions (the model's own mask would apply it on indices of the re-encoded
        sequence, which differ once sinks are kept in front of a window).

        Raises:
            SemanticsError: original positions, and a model whose layers cannot be masked per layer
                or that applies its windows on sequence indices where they differ from positions.
        """
        index, pos = self.gather(kept, int(kept.keep[0, -1].sum()), positions)  # [B, k] each
        mask = None
        if positions == "original" and hasattr(model, "set_attn_implementation"):  # a transformers model
            windows = windows_of(model, f"{self.name} with --positions original")
            if windows.windowed and windows.applies_own:
                if own_window_differs(windows, pos):
                    raise SemanticsError(
                        f"the model applies its {windows.describe()} on sequence indices, which differ from the kept "
                        f"tokens' original positions; use --positions reindexed or a contiguous policy (suffix)")
            elif windows.windowed:
                B, k = pos.shape
                causal = torch.ones(k, k, dtype=torch.bool, device=pos.device).tril().expand(B, k, k)  # [B, k, k]
                mask = kept_attention_mask(windows, causal, None, pos, pos, model_dtype(model))
        return next_token_logprobs(model, input_ids.gather(1, index), pos, mask)


class Streaming(Semantics):
    """One cache evicting as it goes, decisions from online scores (module docstring)."""

    name = "streaming"
    provides = frozenset({LOGIT_OFFSETS, ATTENTION_SCORES, KEY_NORM_SCORES})

    def reference(self, model, input_ids: torch.Tensor, policies: Sequence[Policy],
                  granularity: str = "token", queries: int = 1) -> ReferencePass:
        """Reference log-probabilities and the target query's attention row (for the evicted mass; per
        key/value head under head granularity), of the last ``queries`` positions; policies take no
        score from it (their scores are online)."""
        return reference_pass(model, input_ids, last_attention=True, heads=heads_of(model, granularity), queries=queries)

    def policy_logprobs(self, model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int],
                        ref: ReferencePass | None, positions: str, chunk: int = 1,
                        granularity: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``policy`` as one evicting cache over ``input_ids`` [B, T] in chunks of ``chunk`` tokens
        (:mod:`truncsens.engine.streaming_pass`), one cache per key/value head under head granularity.

        Returns:
            (log-probabilities [B, V] float64, keep_last [B, T] bool keys the target's query read;
            [B, Hkv, T] under head granularity).

        Raises:
            PolicyError: a bad chunk or budget (see :func:`truncsens.policies.streaming.run_stream`).
        """
        lp, evictions = self.stream(model, input_ids, policy, budget, seeds, chunk, granularity)
        return lp, evictions.last()

    @torch.no_grad()
    def stream(self, model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int],
               chunk: int = 1, granularity: str = "token", keep: int = 1):
        """(log-probabilities [B, V] float64, :class:`~truncsens.policies.streaming.Evictions`) of one
        streaming run: offline decisions and one forward from the eviction steps (:meth:`kept_logprobs`)
        when the policy reads no scores, else the sequential run with online scores. Under head
        granularity the decisions are taken on B·Hkv rows (:func:`~truncsens.policies.base.head_seeds`)
        and ``evict`` is [B, Hkv, T]. With ``keep`` > 1 the log-probabilities after each of the last
        ``keep`` tokens, [B, keep, V] (the block protocol, :mod:`truncsens.engine.block.policies`)."""
        B, T = input_ids.shape
        heads = heads_of(model, granularity)
        rows = head_seeds(seeds, heads) if heads else seeds
        if policy.needs_scores:
            return stream_online(model, input_ids, policy, budget, rows, chunk, windows_of(model, self.name),
                                 heads=heads, groups=groups_of(model, True), keep=keep)
        evictions = decide_offline(policy, budget, T, chunk, rows, input_ids.device)  # [B or B·Hkv, T]
        if heads:
            evictions = evictions.unfold(heads)
        return self.kept_logprobs(model, input_ids, evictions, None, "original", keep=keep), evictions

    def queries(self, context_len: int, device: torch.device | str) -> torch.Tensor:
        """Every position 0..T-1: each token was processed under its own kept set."""
        return torch.arange(context_len, device=device)

    def cost(self, context_len: int, budget: int) -> int:
        """The whole context: every token is processed again under its kept set."""
        return context_len

    def kept_logprobs(self, model, input_ids: torch.Tensor, kept: Kept | Evictions, ref: ReferencePass | None,
                      positions: str, query_chunk: int = evict_attention.DEFAULT_QUERY_CHUNK,
                      keep: int = 1) -> torch.Tensor:
        """One forward over ``input_ids`` [B, T], row q reading the keys kept for it.

        Returns [B, V] float64 log-probabilities after the last token (``keep`` = 1), or [B, keep, V]
        after each of the last ``keep`` tokens (the block protocol,
        :mod:`truncsens.engine.block.policies`: row q is the streaming run of the prefix x[0..q]).

        Given :class:`~truncsens.policies.streaming.Evictions` (``evict``/``offset`` [B, T] or
        [B, Hkv, T]), attention runs from the eviction steps (:mod:`truncsens.engine.evict_attention`:
        query chunks of ``query_chunk`` rows with SDPA on CPU, FlexAttention on CUDA), each layer's
        window applied inside; no T x T mask is built, memory grows linearly in T. Models that apply
        their windows themselves (GPT-Neo) get the dense mask of ``evictions.kept()`` instead.
        Given a :class:`Kept` ([B, T, T] per-query kept sets, or [B, Hkv, T, T] per key/value head), a
        dense [B, 1, T, T] additive mask ([B, H, T, T] per head; or a dict of them per layer type) is built.

        Raises:
            ValueError: a kept set that is not causal, or a query that keeps no key.
        """
        B, T = input_ids.shape
        windows = windows_of(model, self.name)
        pos = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
        if isinstance(kept, Evictions):
            if evict_attention.supported(model, windows):
                kwargs = evict_attention.evict_kwargs(kept.evict, kept.offset, windows, query_chunk)
                with evict_attention.evict_attention(model):
                    out = model(input_ids=input_ids, position_ids=pos, use_cache=False, logits_to_keep=keep, **kwargs)
                return _kept_rows(out.logits, keep)
            kept = kept.kept()
        check_causal(kept.keep)
        mask = kept_attention_mask(windows, kept.keep, kept.offset, pos, pos, model_dtype(model),
                                   groups_of(model, kept.per_head))
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep)
        return _kept_rows(out.logits, keep)


def _kept_rows(logits: torch.Tensor, keep: int) -> torch.Tensor:
    """[B, V] log-softmax of the last row of ``logits`` [B, L, V] (``keep`` = 1), else [B, keep, V]."""
    lp = rows_logprobs(logits, keep)  # [B, keep, V]
    return lp[:, 0] if keep == 1 else lp


class PrefillEvict(Semantics):
    """Full-context keys and values, evicted before the target's query reads them (kvpress convention).

    With ``--positions reindexed`` the kept keys are re-rotated to positions 0..k-2 and the query
    decoded at k - 1 (RoPE models; :mod:`truncsens.engine.rerotation`, kvpress's KeyRerotationPress)."""

    name = "prefill_evict"
    keeps_cache = True
    positions = ("original", "reindexed")
    provides = frozenset({LOGIT_OFFSETS, ATTENTION_SCORES, KEY_NORM_SCORES, OBSERVATION_WINDOW, PER_QUERY_DRAWS,
                          PREFILL_LAYERS})

    def cost(self, context_len: int, budget: int) -> int:
        """One token: the target's query is decoded against the prefilled cache."""
        return 1

    def reference(self, model, input_ids: torch.Tensor, policies: Sequence[Policy],
                  granularity: str = "token", queries: int = 1) -> ReferencePass:
        """The reference pass, keeping the full-context cache of the first T - 1 tokens (statistics per
        key/value head under head granularity; and, for policies that need :data:`PREFILL_LAYERS`, each
        attention layer's prefill inputs: :class:`~truncsens.engine.prefill_layers.PrefillReference`)."""
        wants_layers = any(PREFILL_LAYERS in p.requirements() for p in policies)
        with record_prefill(model) if wants_layers else contextlib.nullcontext() as layers:
            ref = super().reference(model, input_ids, policies, granularity, queries)
        return ref if layers is None else PrefillReference.of(ref, layers)

    def scores(self, policy: Policy, ref: ReferencePass, queries: torch.Tensor):
        """As :meth:`Semantics.scores`; for :data:`PREFILL_LAYERS` policies the pair
        (:class:`~truncsens.engine.prefill_layers.PrefillLayers`, prefill cache)."""
        if PREFILL_LAYERS in policy.requirements():
            return ref.layers, ref.cache
        return super().scores(policy, ref, queries)

    def kept_logprobs(self, model, input_ids: torch.Tensor, kept: Kept, ref: ReferencePass | None,
                      positions: str) -> torch.Tensor:
        """Decode token T - 1 against ``ref.cache`` (every key of every layer, see
        :func:`~truncsens.engine.reference_pass.reference_pass`) with a [B, 1, 1, T] mask of the kept
        keys within each layer's window (a dict of them per layer type when windows differ; [B, H, 1, T]
        for per-head kept sets of ``--granularity head``, query head h·G + i reading KV head h's keys);
        the cache is truncated back to T - 1 tokens afterwards, so one prefill serves every pass.
        Per-layer, per-head kept sets (:class:`~truncsens.engine.rerotation.HeadKept`, kvpress presses)
        and ``reindexed`` positions decode against a cache gathered from ``ref.cache`` instead
        (:func:`~truncsens.engine.rerotation.decode_gathered`; ``ref.cache`` is left unchanged).

        Raises:
            SemanticsError: gathered decoding on a model with sliding-window layers; ``reindexed``
                positions with ``--granularity head``.
            truncsens.engine.rerotation.RotaryError: ``reindexed`` on a model without a fixed RoPE.
        """
        B, T = input_ids.shape
        windows = windows_of(model, self.name)
        if positions == "reindexed" or isinstance(kept, HeadKept):
            if windows.windowed:
                raise SemanticsError(f"per-head kept sets and --positions reindexed under {self.name} need a model "
                                     f"without sliding-window layers; this one has {windows.describe()}")
            if kept.per_head and not isinstance(kept, HeadKept):
                raise SemanticsError("--positions reindexed with --granularity head is not supported under "
                                     f"{self.name}; use --positions original or --granularity token")
            return decode_gathered(model, input_ids, kept, ref.cache, positions == "reindexed")
        keep_last, offset_last = kept.keep[..., -1:, :], kept.offset[..., -1:, :]  # [B, (Hkv,) 1, T] each
        return decode_kept(model, input_ids, ref.cache, keep_last, offset_last, groups_of(model, kept.per_head))[:, 0]


@torch.no_grad()
def decode_kept(model, ids: torch.Tensor, cache, keep: torch.Tensor, offset: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The prefill-evict decode: the last Q tokens of ``ids`` [B, L] (positions L - Q .. L - 1) read
    ``cache`` (the full-context cache of the first L - 1 tokens) in one forward, query j reading only
    the keys of ``keep[..., j, :]`` with the logit offsets ``offset[..., j, :]``. One target's decode is
    Q = 1 (:meth:`PrefillEvict.kept_logprobs`); a block's is Q = B
    (:mod:`truncsens.engine.block.policies`), its queries never reading each other's new keys
    unless ``keep`` says so.

    Args:
        keep, offset: [B, (Hkv,) Q, L - 1 + Q] bool / float: the cache keys, then the Q new keys.
        groups: query heads per key/value head (per-head ``keep``).

    Returns:
        [B, Q, V] float64 log-softmax. The cache is truncated back to L - 1 tokens.
    """
    B, L = ids.shape
    Q = keep.shape[-2]
    q_pos = torch.arange(L - Q, L, device=ids.device).expand(B, Q)  # [B, Q]
    k_pos = torch.cat([torch.arange(L - 1, device=ids.device).expand(B, L - 1), q_pos], 1)  # [B, L - 1 + Q]
    mask = kept_attention_mask(windows_of(model, "prefill_evict"), keep, offset, q_pos, k_pos, model_dtype(model), groups)
    try:
        out = model(input_ids=ids[:, L - Q :], position_ids=q_pos, attention_mask=mask, use_cache=True,
                    logits_to_keep=Q, **{kvcache.cache_keyword(model): cache})
    finally:
        kvcache.truncate(cache, L - 1)
    return rows_logprobs(out.logits, Q)  # [B, Q, V]


SEMANTICS: dict[str, Semantics] = {s.name: s for s in (Reencode(), Streaming(), PrefillEvict())}
if tuple(SEMANTICS) != SEMANTICS_NAMES:  # pragma: no cover - a new semantics must be named in the results schema too
    raise ImportError(f"semantics registry {tuple(SEMANTICS)} differs from the results schema {SEMANTICS_NAMES}")


def semantics_for(name: str) -> Semantics:
    """The semantics registered under ``name``.

    Raises:
        SemanticsError: unknown name (the message lists the known ones).
    """
    if name not in SEMANTICS:
        raise SemanticsError(f"unknown semantics {name!r}; choose one of {', '.join(SEMANTICS)}")
    return SEMANTICS[name]
