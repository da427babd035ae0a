"""Attention from eviction steps, without a T x T mask (streaming semantics; docs/method.md, "Three semantics").

A streaming decision is one eviction step per key (:class:`truncsens.policies.streaming.Evictions`):
key j is read by the queries q with ``j <= q < evict[b, j]``, with the additive logit offset
``offset[b, j]`` (the Hájek correction ``log(1/π_j)``, arXiv 2607.21475; 0 for surely kept keys).
That is O(T) to describe, and the attention of every query over its kept keys is

    softmax_j( scaling · <q, k_j> + offset_j )  over j with  j <= q < evict_j  (and q - j < W),

the same formula as the dense 4D additive mask of :mod:`truncsens.engine.masks` (scaled dot-product
attention, arXiv 1706.03762), computed here without ever building that mask:

- ``chunked`` (CPU, and the fallback everywhere): queries in chunks of ``Cq`` rows; for a chunk
  ``s..e-1`` only the keys still cached at s (``evict_j > s`` and ``j < e``; with a budget k that
  is at most k - 1 + e - s keys, their union over the batch and heads) are gathered and
  :func:`torch.nn.functional.scaled_dot_product_attention` runs with a ``[B, 1|H, Cq, n]`` mask
  built for that chunk only. Memory O(Cq · (k + Cq)) per layer, time O(T · (k + Cq)).
- ``flex`` (CUDA, torch with :mod:`torch.nn.attention.flex_attention`; :mod:`truncsens.engine.evict_flex`): a block-sparse mask from
  ``mask_mod(b, h, q, j) = j <= q < evict[b, j]`` (and ``q - j < W``) and
  ``score_mod = score + offset[b, j]`` (compiled with :func:`torch.compile`); uncompiled it also
  runs on CPU, which the tests use to check it against the dense mask.

The function is registered with transformers' ``AttentionInterface`` under :data:`NAME` (checked on
transformers 4.54 and 5.x). transformers passes extra keyword arguments of ``model(...)`` down to the
attention function, so the eviction tensors travel with one forward call (:func:`evict_kwargs`),
and :func:`evict_attention` switches the model's attention implementation for one block and restores
it after. An implementation name that no mask function is registered for makes transformers skip
mask creation (``attention_mask`` is None), so no T x T mask is built by the model either. Two
kinds of model cannot take the steps this way, and the caller falls back to the model's own attention
with a dense mask for both: decoder layers that call their attention module without passing the
call's keyword arguments on (StableLM, Falcon: the first such layer raises :class:`EvictStepsMissing`),
and attention layers that bypass the interface (fewer calls than layers, :func:`attention_calls`).

Sliding-window layers (:mod:`truncsens.engine.attention_windows`): the window ``q - j < W`` of each
layer (looked up by the attention module's ``layer_idx``) is applied inside the chunk mask and the
flex mask. Models that apply their windows themselves on cache indices (GPT-Neo, ``applies_own``)
are not supported here (:func:`supported` is False; the caller keeps the dense mask for them).

Evictions may be per sequence (``evict`` [B, T]) or per key/value head (``[B, Hkv, T]``, query heads
of a group sharing their key/value head's row, expanded with ``repeat_interleave`` over the
``H / Hkv`` groups).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from truncsens.engine.evict_flex import flex_available, flex_evict_attention
from truncsens.engine.evict_steps import EvictAttentionError, head_rows, check_evictions
from truncsens.engine.masks import masked_value

__all__ = ["NAME", "EvictAttentionError", "EvictStepsMissing", "attention_calls", "check_evictions", "chunk_plan",
           "chunked_attention", "evict_attention", "evict_attention_forward", "evict_kwargs", "flex_available",
           "flex_evict_attention", "logits_attention", "register", "supported"]

NAME = "truncsens_evict"
EVICT, OFFSET, WINDOWS, CHUNK, BACKEND, PLANS = ("truncsens_evict", "truncsens_offset", "truncsens_windows",
                                                 "truncsens_query_chunk", "truncsens_backend", "truncsens_plans")
BACKENDS = ("auto", "chunked", "flex")
# keyword arguments of transformers' attention interface that change the attention weights and that
# attention from eviction steps cannot apply: the run refuses rather than ignore them
REFUSED_FEATURES = {"position_bias": "an additive position bias (position_bias)",
                    "alibi": "ALiBi position biases (alibi)"}
DEFAULT_QUERY_CHUNK = 256


class EvictStepsMissing(EvictAttentionError):
    """An attention layer ran :func:`evict_attention_forward` without the eviction steps of the forward
    call: its decoder layer calls the attention module without passing the call's keyword arguments
    on (StableLM, Falcon in transformers 5.x). The caller can run the model's own attention with a
    dense mask instead (:meth:`truncsens.engine.semantics.streaming.Streaming.kept_logprobs`)."""


def chunk_plan(evict: torch.Tensor, offset: torch.Tensor, n_queries: int, groups: int, window: int | None,
               query_chunk: int, dtype: torch.dtype) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Which keys each chunk of query rows reads, and its additive mask: the part of
    :func:`chunked_attention` that depends only on the eviction steps and the window, so one plan serves
    every layer of a forward call (:func:`evict_attention_forward` keeps it in the call's kwargs).

    Args:
        evict: [B, Tk] or [B, Hkv, Tk] int64; offset: the same shape, float.
        n_queries: Tq (queries at positions Tk - Tq .. Tk - 1); groups: query heads per key/value head.
        window: W or None; query_chunk: Cq >= 1; dtype: the mask's dtype (the query's).

    Returns:
        per chunk (s, e, index [B, n] int64 keys read, in order, mask [B, 1|H, e - s, n]).

    Raises:
        EvictAttentionError: a query row that keeps no key (softmax undefined).
    """
    B, Tk = evict.shape[0], evict.shape[-1]
    device = evict.device
    j_all = torch.arange(Tk, device=device)
    alive_any = evict if evict.dim() == 2 else evict.amax(1)  # [B, Tk] latest step any head reads each key
    evict_h, offset_h = head_rows(evict, groups), head_rows(offset, groups)  # [B, 1|H, Tk] each
    plan = []
    for s in range(Tk - n_queries, Tk, query_chunk):
        e = min(s + query_chunk, Tk)
        live = (alive_any > s) & (j_all < e)  # [B, Tk] keys some query of s..e-1 may read
        n = max(int(live.sum(1).max()), 1)
        index = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, :n]  # [B, n] live keys first, in order
        cols = index.unsqueeze(1).expand(B, evict_h.shape[1], n)  # [B, 1|H, n]
        ev, off = evict_h.gather(2, cols), offset_h.gather(2, cols)  # [B, 1|H, n] each
        q_pos = torch.arange(s, e, device=device).view(1, 1, e - s, 1)  # [1, 1, c, 1]
        j = index.unsqueeze(1).unsqueeze(1)  # [B, 1, 1, n]
        keep = (j <= q_pos) & (q_pos < ev.unsqueeze(2))  # [B, 1|H, c, n]
        if window is not None:
            keep = keep & (q_pos - j < window)
        if not bool(keep.any(-1).all()):
            raise EvictAttentionError("a query keeps no key at all; every query must keep at least its own token")
        mask = torch.where(keep, off.unsqueeze(2).to(dtype), torch.tensor(masked_value(dtype), dtype=dtype, device=device))
        plan.append((s, e, index, mask))  # mask [B, 1|H, c, n]
    return plan


def logits_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out for what SDPA cannot do: ``softmax(cap(scaling · q kᵀ) + mask)`` v, where
    ``cap(s) = softcap · tanh(s / softcap)`` (attention-logit soft-capping, Gemma 2: arXiv 2408.00118;
    transformers' ``Gemma2`` eager attention) and, with ``sinks``, one more logit per head that joins the
    softmax and is then dropped (learned attention sinks, GPT-OSS: transformers' ``GptOss`` eager
    attention, ``s_aux``).

    Args:
        query: [B, H, c, D]; key: [B, H, n, D]; value: [B, H, n, Dv]; mask: [B, 1|H, c, n] additive.
        scaling: the logit scale; softcap: the cap or None; sinks: [H] sink logits or None.

    Returns:
        [B, H, c, Dv] in the query's dtype (softmax in float32, or float64 for a float64 query).
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # [B, H, c, n]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is not None:
        B, H, c, _ = scores.shape
        scores = torch.cat([scores, sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, c, 1)], dim=-1)  # [B, H, c, n + 1]
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]  # [B, H, c, n]: the sink's share is dropped
    return torch.matmul(probs, value)  # [B, H, c, Dv]


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, evict: torch.Tensor,
                      offset: torch.Tensor, scaling: float | None, window: int | None = None,
                      query_chunk: int = DEFAULT_QUERY_CHUNK, plans: dict | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every query over the keys it keeps, by chunks of query rows.

    Args:
        query: [B, H, Tq, D], the queries at positions Tk - Tq .. Tk - 1.
        key: [B, Hkv, Tk, D] (Hkv divides H), keys at positions 0 .. Tk - 1; value: [B, Hkv, Tk, Dv]
            (Dv may differ from D: multi-head latent attention, DeepSeek-V2/V3).
        evict: [B, Tk] or [B, Hkv, Tk] int64 eviction steps; offset: the same shape, float logit offsets.
        scaling: the logit scale (None: 1/sqrt(D)); window: W (``q - j < W``) or None.
        query_chunk: Cq >= 1 query rows per step (any value; the last chunk may be shorter).
        plans: a dict that lives for one forward call: the :func:`chunk_plan` built for one layer is kept
            there (keyed by window, Tq and dtype) and reused by the other layers.
        softcap, sinks: attention-logit soft-capping and learned sink logits [H] (:func:`logits_attention`,
            which replaces SDPA when either is given).

    Returns:
        [B, H, Tq, Dv] attention output, in the query's dtype.

    Raises:
        EvictAttentionError: bad shapes or chunk, or a query row that keeps no key (softmax undefined).
    """
    B, H, Tq, D = query.shape
    Hkv, Tk, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if H % Hkv or Tq > Tk:
        raise EvictAttentionError(f"{H} query heads over {Hkv} key/value heads, {Tq} queries over {Tk} keys")
    if query_chunk < 1:
        raise EvictAttentionError(f"the query chunk must be at least 1 row, got {query_chunk}")
    check_evictions(evict, offset, Tk, Hkv)
    groups = H // Hkv
    first = Tk - Tq  # position of query row 0
    key_ = (window, Tq, query.dtype)
    plan = plans.get(key_) if plans is not None else None
    if plan is None:
        plan = chunk_plan(evict, offset, Tq, groups, window, query_chunk, query.dtype)
        if plans is not None:
            plans[key_] = plan
    out = []
    for s, e, index, mask in plan:
        n = index.shape[1]
        at = index.view(B, 1, n, 1)  # [B, 1, n, 1]
        k = key.gather(2, at.expand(B, Hkv, n, D)).repeat_interleave(groups, dim=1)  # [B, H, n, D]
        v = value.gather(2, at.expand(B, Hkv, n, Dv)).repeat_interleave(groups, dim=1)  # [B, H, n, Dv]
        q = query[:, :, s - first: e - first]  # [B, H, c, D]
        if softcap is None and sinks is None:
            out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                                                        scale=scaling))  # [B, H, c, Dv]
        else:
            out.append(logits_attention(q, k, v, mask, scaling if scaling is not None else D ** -0.5, softcap, sinks))
    return torch.cat(out, dim=2)  # [B, H, Tq, Dv]


def evict_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature): attention from the eviction
    steps passed to the forward call (:func:`evict_kwargs`).

    What the model's own attention function would do with the keyword arguments transformers passes
    is done here too: ``softcap`` (attention-logit soft-capping) and ``s_aux`` (learned sink logits)
    are applied (:func:`logits_attention`); an argument this function cannot apply
    (:data:`REFUSED_FEATURES`) raises instead of being ignored. Each call is counted in the forward
    call's plans (``calls``), so the caller can tell a model that never called it (one that does not
    use transformers' attention interface) from one that did.

    Args:
        module: the attention module (its ``layer_idx`` selects the layer's window).
        query: [B, H, Tq, D]; key: [B, Hkv, Tk, D]; value: [B, Hkv, Tk, Dv].
        attention_mask: must be None (a mask would be a second, conflicting description of the kept keys).
        scaling: logit scale; dropout: must be 0.

    Returns:
        (output [B, Tq, H, Dv], None): transformers' layout, no attention weights.

    Raises:
        EvictStepsMissing: no eviction steps in the call (the model did not pass them on).
        EvictAttentionError: a mask given, dropout > 0, a windowed layer without ``layer_idx``, or an
            attention feature it cannot apply.
    """
    if EVICT not in kwargs:
        raise EvictStepsMissing(f"attention implementation {NAME!r} needs the eviction steps of the forward call "
                                "(truncsens.engine.evict_attention.evict_kwargs); this model did not pass them on")
    if attention_mask is not None:
        raise EvictAttentionError(f"attention implementation {NAME!r} reads its kept keys from eviction steps; "
                                  "an attention mask cannot be combined with them")
    if dropout and module.training:
        raise EvictAttentionError(f"attention implementation {NAME!r} supports no dropout (got {dropout})")
    for arg, feature in REFUSED_FEATURES.items():
        if kwargs.get(arg) is not None:
            raise EvictAttentionError(f"{feature} is not applied by attention from eviction steps; "
                                      "semantics reencode and prefill_evict run the model's own attention")
    windows = kwargs.get(WINDOWS)
    window = None
    per_layer = isinstance(kwargs[EVICT], dict)  # {layer: steps}: every layer its own evictions
    layer = getattr(module, "layer_idx", None)
    if (windows is not None and windows.windowed) or per_layer:
        n_layers = len(windows.windows) if windows is not None else len(kwargs[EVICT])
        if layer is None or not 0 <= layer < n_layers:
            raise EvictAttentionError(f"per-layer windows or evictions, and an attention module without a layer "
                                      f"index ({layer!r})")
        window = windows.windows[layer] if windows is not None and windows.windowed else None
    plans = kwargs.get(PLANS)
    if plans is not None:
        plans["calls"] = plans.get("calls", 0) + 1
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    evict, offset = kwargs[EVICT], kwargs[OFFSET]
    if per_layer:
        evict, offset = evict[layer], offset[layer]
        plans = None if plans is None else plans.setdefault(("layer", layer), {})  # a plan per layer's steps
    evict, offset = evict.to(query.device), offset.to(query.device)
    backend = kwargs.get(BACKEND, "auto")
    if backend == "flex" and sinks is not None:
        raise EvictAttentionError("learned attention sinks (s_aux) are not supported by the flex backend; use chunked")
    if backend == "flex" or (backend == "auto" and sinks is None and query.is_cuda and flex_available()):
        out = flex_evict_attention(query, key, value, evict, offset, scaling, window, plans=plans, softcap=softcap)
    else:
        out = chunked_attention(query, key, value, evict, offset, scaling, window, kwargs.get(CHUNK, DEFAULT_QUERY_CHUNK),
                                plans, softcap=softcap, sinks=sinks)  # the call's plans: layers of one window share theirs
    return out.transpose(1, 2).contiguous(), None  # [B, Tq, H, Dv]


def attention_calls(kwargs: dict) -> int:
    """How many attention layers ran :func:`evict_attention_forward` in the forward call that took
    ``kwargs`` (from :func:`evict_kwargs`)."""
    return int(kwargs[PLANS].get("calls", 0))


def supported(model, windows) -> bool:
    """Whether ``model`` can run :func:`evict_attention_forward`: a transformers model that can switch
    its attention implementation (transformers' ``_can_set_attn_implementation`` when it has one), and
    windows it does not apply itself on cache indices."""
    if not hasattr(model, "set_attn_implementation") or windows.applies_own:
        return False
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    try:
        return bool(can_set()) if callable(can_set) else True
    except Exception:  # noqa: BLE001 - transformers' source heuristic failed: keep the dense path
        return False


def evict_kwargs(evict: torch.Tensor, offset: torch.Tensor, windows=None, query_chunk: int = DEFAULT_QUERY_CHUNK,
                 backend: str = "auto") -> dict:
    """Keyword arguments of one ``model(...)`` call that carry the eviction steps to the attention function.

    Args:
        evict: [B, T] or [B, Hkv, T] int64; offset: the same shape, float; or, for every layer its own
            steps, dicts layer index -> such tensors (:func:`truncsens.engine.layer_windows_pass.stream_layer_windows`).
        windows: the model's :class:`~truncsens.engine.attention_windows.LayerWindows`, or None (full attention).
        query_chunk: Cq query rows per step of the chunked backend.
        backend: ``auto`` (flex on CUDA when available, else chunked), ``chunked`` or ``flex``.

    Raises:
        EvictAttentionError: an unknown backend or a query chunk < 1.
    """
    if backend not in BACKENDS:
        raise EvictAttentionError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if query_chunk < 1:
        raise EvictAttentionError(f"the query chunk must be at least 1 row, got {query_chunk}")
    return {EVICT: evict, OFFSET: offset, WINDOWS: windows, CHUNK: query_chunk, BACKEND: backend, PLANS: {}}


def register() -> None:
    """Register :func:`evict_attention_forward` as transformers attention implementation :data:`NAME`
    (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, evict_attention_forward)


@contextlib.contextmanager
def evict_attention(model) -> Iterator[None]:
    """Run ``model`` with attention implementation :data:`NAME` inside the block, restoring its own after.

    Raises:
        EvictAttentionError: the model cannot switch its attention implementation.
    """
    if not hasattr(model, "set_attn_implementation"):
        raise EvictAttentionError("attention from eviction steps needs a transformers model "
                                  "(set_attn_implementation)")
    register()
    current = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(current)
        raise EvictAttentionError(f"{type(model).__name__} cannot switch its attention implementation to {NAME!r}")
    try:
        yield
    finally:
        model.set_attn_implementation(current)
