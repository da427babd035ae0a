"""``streaming``: one cache that evicts as it goes (docs/method.md, "Semantics").

Every token was processed when the cache held only the keys its policy had kept so far; an evicted
key never comes back, and the policy decides only from what this evicted run computed (online
scores). Decisions are one eviction step per key (:mod:`truncsens.policies.streaming`), taken every
``chunk`` tokens, and run by :mod:`truncsens.engine.streaming_pass`: one parallel forward when the
policy reads no scores, attention computed from the eviction steps and ``log(1/π)`` Hájek offsets
without a T x T mask (:mod:`truncsens.engine.evict_attention`, memory linear in T), else chunk by chunk.

Under the block protocol (:mod:`truncsens.engine.block.policies`) one stream serves a block of
targets: the log-probabilities after each of its last B tokens (``keep`` = B).
"""

from __future__ import annotations

from typing import Sequence

import torch

from truncsens.engine import evict_attention
from truncsens.engine.attention_windows import kept_attention_mask
from truncsens.engine.forward import model_dtype, rows_logprobs
from truncsens.engine.granularity import groups_of, heads_of
from truncsens.engine.masks import check_causal
from truncsens.engine.merge_pass import stream_merging
from truncsens.engine.reference_pass import ReferencePass, reference_pass
from truncsens.engine.semantics.base import Semantics, SemanticsError, windows_of
from truncsens.engine.streaming_pass import decide_offline, stream_online
from truncsens.policies.base import ATTENTION_SCORES, KEY_NORM_SCORES, LOGIT_OFFSETS, MERGED_SLOTS, Kept, Policy, head_seeds
from truncsens.policies.streaming import Evictions


class Streaming(Semantics):
    """One cache evicting as it goes, decisions from online scores (module docstring)."""

    name = "streaming"
    provides = frozenset({LOGIT_OFFSETS, ATTENTION_SCORES, KEY_NORM_SCORES, MERGED_SLOTS})
    streams = True
    reference_apart = True  # the streams read nothing of the reference pass: batched by what a stream holds
    policy_blocks = True
    per_layer = True
    score_source = "online: attention and key norms computed by the evicted streaming run itself"
    block_passes = "one stream per block and budget, shared by its targets (and, for random policies, its draws)"

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
        if policy.merges:  # a merging cache (truncsens.engine.merge_pass): no eviction steps
            self.check_merging(policy, positions, granularity)
            return self.merged_logprobs(model, input_ids, policy, budget, ref, chunk)
        lp, evictions = self.stream(model, input_ids, policy, budget, seeds, chunk, granularity)
        return lp, evictions.last()

    def merged_logprobs(self, model, input_ids: torch.Tensor, policy: Policy, budget: int, ref: ReferencePass | None,
                        chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A merging policy as one cache of k − 1 slots merging as it goes, in chunks of ``chunk`` tokens
        (:func:`~truncsens.engine.merge_pass.stream_merging`)."""
        return stream_merging(model, input_ids, policy, budget, chunk)

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

    def stream_cost(self, context_len: int, budget: int, chunk: int, policy: Policy, model=None,
                    granularity: str = "token") -> int:
        """Cache slots per layer one stream holds at once, what its batch is sized by: a policy with
        online scores (``h2o``, ``tova``, ``key_norm``, ``poisson``) runs chunk by chunk on a cache
        compacted to the keys it keeps (:func:`~truncsens.engine.streaming_pass.stream_online`), and a
        merging cache holds k − 1 slots: min(N, k + chunk) (under head granularity min(N, Hkv · k + chunk),
        the union of the heads' kept sets). A policy without scores (``sink_recent``, ``random``,
        ``suffix``) runs one parallel forward over the N tokens, as does every policy on a model that
        applies its windows on cache indices (GPT-Neo keeps every slot): N.

        Args:
            context_len: N tokens; budget: k; chunk: tokens per decision (``--chunk``);
            model: the model (None: a model without windows on cache indices, token granularity).
        """
        if not (policy.needs_scores or policy.merges):
            return context_len
        if model is not None and not policy.merges and windows_of(model, self.name).applies_own:
            return context_len
        heads = heads_of(model, granularity) if model is not None else None
        return min(context_len, budget * (heads or 1) + chunk)

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
        their windows themselves (GPT-Neo), models whose decoder layers do not pass the forward call's
        keyword arguments on to attention (StableLM, Falcon: :class:`~truncsens.engine.evict_attention.EvictStepsMissing`)
        and models whose attention layers bypass transformers' attention interface (fewer calls than
        layers) get the dense mask of ``evictions.kept()`` instead (:func:`dense_kept_logprobs`).
        Given a :class:`Kept` ([B, T, T] per-query kept sets, or [B, Hkv, T, T] per key/value head), the
        dense mask is used too.

        Raises:
            ValueError: a kept set that is not causal, or a query that keeps no key.
        """
        B, T = input_ids.shape
        windows = windows_of(model, self.name)
        pos = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
        if isinstance(kept, Evictions):
            if evict_attention.supported(model, windows):
                kwargs = evict_attention.evict_kwargs(kept.evict, kept.offset, windows, query_chunk)
                try:
                    with evict_attention.evict_attention(model):
                        out = model(input_ids=input_ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                                    **kwargs)
                except evict_attention.EvictStepsMissing:  # a decoder layer did not pass the steps on
                    out = None
                if out is not None and evict_attention.attention_calls(kwargs) == len(windows.windows):
                    return _kept_rows(out.logits, keep)
                # some attention layer did not call the attention interface (it ran its own full causal
                # attention) or got no eviction steps: that output is discarded and the dense mask,
                # which every layer reads, is used
            per_head = kept.evict.dim() == 3
            check_dense_size(model, kept.evict.shape[0] * (kept.evict.shape[1] if per_head else 1), T, per_head)
            kept = kept.kept()
        return dense_kept_logprobs(model, input_ids, kept, windows, keep)


DENSE_MAX_BYTES = 8 << 30  # the dense fallback refuses masks and kept sets above 8 GiB


def check_dense_size(model, rows: int, T: int, per_head: bool = False, limit: int | None = None) -> None:
    """Refuse the dense fallback when its T × T tensors would exceed ``limit`` bytes: ``rows`` kept
    sets (B, or B · Hkv per head) of T × T bools and float32 offsets, and their additive mask in the
    model's dtype (one per query head under head granularity, counted as G = H / Hkv masks per row);
    ``limit`` None: :data:`DENSE_MAX_BYTES`.

    Raises:
        SemanticsError: above the limit (the message gives the size and the cause).
    """
    limit = DENSE_MAX_BYTES if limit is None else limit
    groups = groups_of(model, per_head)
    width = torch.finfo(model_dtype(model)).bits // 8
    need = rows * T * T * (1 + 4 + width * groups)
    if need > limit:
        raise SemanticsError(
            f"streaming at T = {T}: this model's attention cannot take eviction steps (it does not run "
            "transformers' attention interface with the forward call's keyword arguments), and the dense "
            f"fallback's T x T kept sets and mask would take {need / 2**30:.1f} GiB (limit {limit / 2**30:.0f} GiB); "
            "use a shorter --reference-context, or --semantics prefill_evict or reencode")


def dense_kept_logprobs(model, input_ids: torch.Tensor, kept: Kept, windows, keep: int = 1) -> torch.Tensor:
    """One forward over ``input_ids`` [B, T] with the model's own attention and a dense additive mask
    of the kept sets: builds a [B, 1, T, T] mask ([B, H, T, T] per key/value head; one per layer type
    for windowed models), memory O(T²) per mask (:func:`~truncsens.engine.attention_windows.kept_attention_mask`).

    Args:
        kept: :class:`Kept`, kept sets [B, T, T] (or [B, Hkv, T, T]) bool and offsets of the same shape;
        windows: the model's :class:`~truncsens.engine.attention_windows.LayerWindows`;
        keep: how many of the last positions get their log-probabilities returned.

    Returns:
        [B, V] float64 log-probabilities after the last token (``keep`` = 1), else [B, keep, V].

    Raises:
        ValueError: a kept set that is not causal, or a query that keeps no key.
    """
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
    check_dense_size(model, B * (kept.keep.shape[1] if kept.per_head else 1), T, kept.per_head)
    check_causal(kept.keep)
    mask = kept_attention_mask(windows, kept.keep, kept.offset, pos, pos, model_dtype(model),
                               groups_of(model, kept.per_head))
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep)
    return _kept_rows(out.logits, keep)


def _kept_rows(logits: torch.Tensor, keep: int) -> torch.Tensor:
    """[B, V] log-softmax of the last row of ``logits`` [B, L, V] (``keep`` = 1), else [B, keep, V]."""
    lp = rows_logprobs(logits, keep)  # [B, keep, V]
    return lp[:, 0] if keep == 1 else lp
