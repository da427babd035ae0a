"""``prefill_evict``: keys and values computed with the full context, then evicted before the
target's query reads them (the kvpress convention; docs/method.md, "Semantics"): the last token is
decoded against the full-context cache of the first T - 1 tokens with the evicted keys masked out
(:func:`decode_kept`, also the block protocol's decode of B queries, :mod:`truncsens.engine.block.policies`).

Policies that need :data:`~truncsens.policies.kvpress_adapter.PREFILL_LAYERS` (kvpress presses) get
each attention layer's prefill inputs and the keys and values of the prefill cache
(:meth:`PrefillEvict.scores`), and those that need
:data:`~truncsens.policies.base.LAYER_OBSERVATION_WINDOW` (``snapkv``) the mean attention row of an
observation window per layer and key/value head, read from the reference pass's own attention calls
(:meth:`~truncsens.engine.semantics.base.Semantics.scores`); their per-layer, per-head kept sets
decode against a gathered cache (:mod:`truncsens.engine.rerotation`).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from truncsens.engine import kvcache
from truncsens.engine.attention_windows import kept_attention_mask
from truncsens.engine.forward import model_dtype, rows_logprobs
from truncsens.engine.granularity import groups_of
from truncsens.engine.merge_pass import prefill_merging
from truncsens.engine.prefill_layers import PrefillReference, record_prefill
from truncsens.engine.reference_pass import ReferencePass
from truncsens.engine.rerotation import decode_gathered
from truncsens.engine.semantics.base import Semantics, SemanticsError, windows_of
from truncsens.policies.base import (
    ATTENTION_SCORES, KEY_NORM_SCORES, LAYER_OBSERVATION_WINDOW, LOGIT_OFFSETS, MERGED_SLOTS, OBSERVATION_WINDOW,
    PER_QUERY_DRAWS, Kept, Policy,
)
from truncsens.policies.kept import HeadKept
from truncsens.policies.kvpress_adapter import PREFILL_LAYERS


class PrefillEvict(Semantics):
    """Full-context keys and values, evicted before the target's query reads them (kvpress convention).

    With ``--positions reindexed`` the kept keys are re-rotated to positions 0..k-2 and the query
    decoded at k - 1 (RoPE models; :mod:`truncsens.engine.rerotation`, kvpress's KeyRerotationPress)."""

    name = "prefill_evict"
    keeps_cache = True
    per_layer = True
    positions = ("original", "reindexed")
    provides = frozenset({LOGIT_OFFSETS, ATTENTION_SCORES, KEY_NORM_SCORES, OBSERVATION_WINDOW, LAYER_OBSERVATION_WINDOW,
                          PER_QUERY_DRAWS, PREFILL_LAYERS, MERGED_SLOTS})
    policy_blocks = True
    score_source = "the full-context prefill (reference pass)"
    block_passes = "one prefill per block, one decode of its targets per budget"

    def check_policy_model(self, policy: Policy, model) -> None:
        """Refuse a policy with kept sets per layer and key/value head (``layer_heads``: ``snapkv``,
        kvpress presses) on a model with sliding-window layers: those sets decode against a cache
        gathered per head, where a layer's window cannot be applied.

        Raises:
            SemanticsError: naming the policy, the model's windows and the policy's
                :attr:`~truncsens.policies.base.Policy.shared_variant` (which runs there), if any.
        """
        super().check_policy_model(policy, model)
        if not policy.layer_heads or not hasattr(model, "set_attn_implementation"):
            return
        windows = windows_of(model, self.name)
        if windows.windowed:
            raise SemanticsError(layer_heads_refusal(policy.name, policy.shared_variant, self.name, windows.describe()))

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
        """As :meth:`Semantics.scores`; for :data:`PREFILL_LAYERS` policies the pair (layers, kv): the
        :class:`~truncsens.engine.prefill_layers.PrefillLayers` of ``ref`` and, for each of its L layers,
        (keys, values) [B, H_kv, T - 1, d] of the prefill cache (what
        :meth:`~truncsens.policies.kvpress_adapter.KVPressPolicy.head_index` reads; the policy never
        touches the cache itself)."""
        if PREFILL_LAYERS in policy.requirements():
            return ref.layers, [kvcache.layer_kv(ref.cache, layer) for layer in range(len(ref.layers.modules))]
        return super().scores(policy, ref, queries)

    def merged_logprobs(self, model, input_ids: torch.Tensor, policy: Policy, budget: int, ref: ReferencePass | None,
                        chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A merging policy: a copy of ``ref.cache`` merged down to k − 1 slots, then the target's query
        decoded against it (:func:`~truncsens.engine.merge_pass.prefill_merging`)."""
        return prefill_merging(model, input_ids, ref.cache, policy, budget)

    def kept_logprobs(self, model, input_ids: torch.Tensor, kept: Kept, ref: ReferencePass | None,
                      positions: str) -> torch.Tensor:
        """Decode token T - 1 against ``ref.cache`` (every key of every layer, see
        :func:`~truncsens.engine.reference_pass.reference_pass`) with a [B, 1, 1, T] mask of the kept
        keys within each layer's window (a dict of them per layer type when windows differ; [B, H, 1, T]
        for per-head kept sets of ``--granularity head``, query head h·G + i reading KV head h's keys);
        the cache is truncated back to T - 1 tokens afterwards, so one prefill serves every pass.
        Per-layer, per-head kept sets (:class:`~truncsens.policies.kept.HeadKept`, kvpress presses)
        and ``reindexed`` positions decode against a cache gathered from ``ref.cache`` instead
        (:func:`~truncsens.engine.rerotation.decode_gathered`; ``ref.cache`` is left unchanged), or,
        where the cache holds fewer heads than the sets (multi-head latent attention, DeepSeek-V2/V3),
        against ``ref.cache`` with one per-head mask per layer (:func:`~truncsens.engine.rerotation.decode_head_masks`).

        Raises:
            SemanticsError: gathered decoding on a model with sliding-window layers (for per-layer, per-head
                sets: :func:`layer_heads_refusal`); ``reindexed``
                positions with ``--granularity head``.
            truncsens.engine.rerotation.RotaryError: ``reindexed`` on a model without a fixed RoPE.
        """
        B, T = input_ids.shape
        windows = windows_of(model, self.name)
        if positions == "reindexed" or isinstance(kept, HeadKept):
            if windows.windowed and isinstance(kept, HeadKept):
                raise SemanticsError(layer_heads_refusal("a policy with kept sets per layer and head", None, self.name,
                                                         windows.describe()))
            if windows.windowed:
                raise SemanticsError(f"per-head kept sets and positions='reindexed' (--positions reindexed) under {self.name} need a model "
                                     f"without sliding-window layers; this one has {windows.describe()}")
            if kept.per_head and not isinstance(kept, HeadKept):
                raise SemanticsError("positions='reindexed' (--positions reindexed) with granularity='head' (--granularity head) is not supported under "
                                     f"{self.name}; use --positions original or --granularity token")
            return decode_gathered(model, input_ids, kept, ref.cache, positions == "reindexed")
        keep_last, offset_last = kept.keep[..., -1:, :], kept.offset[..., -1:, :]  # [B, (Hkv,) 1, T] each
        return decode_kept(model, input_ids, ref.cache, keep_last, offset_last, groups_of(model, kept.per_head))[:, 0]


def layer_heads_refusal(policy: str, shared: str | None, semantics: str, windows: str) -> str:
    """The refusal of kept sets per layer and key/value head on a model with sliding-window layers
    (``windows``: :meth:`~truncsens.engine.attention_windows.LayerWindows.describe`), naming ``shared``,
    the policy that keeps one set for every layer and head by the same rule, when there is one."""
    name = policy if " " in policy else f"policy {policy}"  # a name, or a phrase where the policy is not known
    fix = (f"use --policy {shared} (the same rule, one kept set for every layer and head), which runs there"
           if shared else "use a policy with one kept set for every layer and head")
    return (f"{name} keeps a kept set per layer and key/value head, which {semantics} cannot combine with "
            f"sliding-window layers; this model has {windows}: {fix}")


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
    windows = windows_of(model, PrefillEvict.name)
    mask = kept_attention_mask(windows, keep, offset, q_pos, k_pos, model_dtype(model), groups)
    try:
        out = model(input_ids=ids[:, L - Q :], position_ids=q_pos, attention_mask=mask, use_cache=True,
                    logits_to_keep=Q, **{kvcache.cache_keyword(model): cache})
    finally:
        kvcache.truncate(cache, L - 1)
    return rows_logprobs(out.logits, Q)  # [B, Q, V]
