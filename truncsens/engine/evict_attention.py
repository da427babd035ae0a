"""Attention from eviction steps, without a T x T mask (streaming semantics, docs/method.md "Memory").

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
- ``flex`` (CUDA, torch with :mod:`torch.nn.attention.flex_attention`): a block-sparse mask from
  ``mask_mod(b, h, q, j) = j <= q < evict[b, j]`` (and ``q - j < W``) and
  ``score_mod = score + offset[b, j]`` (compiled with :func:`torch.compile`); uncompiled it also
  runs on CPU, which the tests use to check it against the dense mask.

The function is registered with transformers' ``AttentionInterface`` under :data:`NAME` (checked on
transformers 4.54 and 5.x). transformers passes extra keyword arguments of ``model(...)`` down to the
attention function, so the eviction tensors travel with one forward call (:func:`evict_kwargs`),
and :func:`evict_attention` switches the model's attention implementation for one block and restores
it after. An implementation name that no mask function is registered for makes transformers skip
mask creation (``attention_mask`` is None), so no T x T mask is built by the model either.

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
import functools
from typing import Iterator

import torch

NAME = "truncsens_evict"
EVICT, OFFSET, WINDOWS, CHUNK, BACKEND, PLANS = ("truncsens_evict", "truncsens_offset", "truncsens_windows",
                                                 "truncsens_query_chunk", "truncsens_backend", "truncsens_plans")
BACKENDS = ("auto", "chunked", "flex")
DEFAULT_QUERY_CHUNK = 256


class EvictAttentionError(ValueError):
    """Attention from eviction steps cannot run as asked (shapes, dropout, a model it cannot reach)."""


def flex_available() -> bool:
    """Whether the installed torch has FlexAttention (:mod:`torch.nn.attention.flex_attention`)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    except ModuleNotFoundError:  # no torch.nn.attention at all
        return False


def check_evictions(evict: torch.Tensor, offset: torch.Tensor, n_keys: int, n_kv_heads: int) -> None:
    """Raise :class:`EvictAttentionError` unless ``evict`` (int) and ``offset`` (float) are both [B, T] or
    both [B, Hkv, T] with T = ``n_keys`` and Hkv = ``n_kv_heads``."""
    if evict.shape != offset.shape:
        raise EvictAttentionError(f"evict {tuple(evict.shape)} and offset {tuple(offset.shape)} differ in shape")
    if evict.dim() not in (2, 3) or evict.shape[-1] != n_keys or (evict.dim() == 3 and evict.shape[1] != n_kv_heads):
        raise EvictAttentionError(f"evict must be [B, {n_keys}] or [B, {n_kv_heads}, {n_keys}] (B, key/value heads, "
                                  f"keys), got {tuple(evict.shape)}")
    if evict.dtype.is_floating_point or evict.dtype == torch.bool:
        raise EvictAttentionError(f"evict must hold integer eviction steps, got {evict.dtype}")


def _heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, T] -> [B, 1, T]; [B, Hkv, T] -> [B, Hkv·groups, T] (query heads of a group share a row)."""
    return t.unsqueeze(1) if t.dim() == 2 else t.repeat_interleave(groups, dim=1)


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
    evict_h, offset_h = _heads(evict, groups), _heads(offset, groups)  # [B, 1|H, Tk] each
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
        mask = torch.where(keep, off.unsqueeze(2).to(dtype), torch.tensor(float("-inf"), dtype=dtype, device=device))
        plan.append((s, e, index, mask))  # mask [B, 1|H, c, n]
    return plan


def chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, evict: torch.Tensor,
                      offset: torch.Tensor, scaling: float | None, window: int | None = None,
                      query_chunk: int = DEFAULT_QUERY_CHUNK, plans: dict | None = None) -> torch.Tensor:
    """Attention of every query over the keys it keeps, by chunks of query rows.

    Args:
        query: [B, H, Tq, D], the queries at positions Tk - Tq .. Tk - 1.
        key, value: [B, Hkv, Tk, D] (Hkv divides H), keys at positions 0 .. Tk - 1.
        evict: [B, Tk] or [B, Hkv, Tk] int64 eviction steps; offset: the same shape, float logit offsets.
        scaling: the logit scale (None: 1/sqrt(D)); window: W (``q - j < W``) or None.
        query_chunk: Cq >= 1 query rows per step (any value; the last chunk may be shorter).
        plans: a dict that lives for one forward call: the :func:`chunk_plan` built for one layer is kept
            there (keyed by window, Tq and dtype) and reused by the other layers.

    Returns:
        [B, H, Tq, D] attention output, in the query's dtype.

    Raises:
        EvictAttentionError: bad shapes or chunk, or a query row that keeps no key (softmax undefined).
    """
    B, H, Tq, D = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
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
        take = index.view(B, 1, n, 1).expand(B, Hkv, n, D)  # [B, Hkv, n, D]
        k = key.gather(2, take).repeat_interleave(groups, dim=1)  # [B, H, n, D]
        v = value.gather(2, take).repeat_interleave(groups, dim=1)  # [B, H, n, D]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s - first: e - first], k, v, attn_mask=mask, dropout_p=0.0, scale=scaling))  # [B, H, c, D]
    return torch.cat(out, dim=2)  # [B, H, Tq, D]


@functools.lru_cache(maxsize=2)
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def flex_evict_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, evict: torch.Tensor,
                         offset: torch.Tensor, scaling: float | None, window: int | None = None,
                         compiled: bool | None = None, plans: dict | None = None) -> torch.Tensor:
    """The same attention as :func:`chunked_attention` with FlexAttention (arXiv 2412.05496): a block
    mask from ``mask_mod`` and the offsets in ``score_mod``.

    Args:
        query, key, value, evict, offset, scaling, window: as in :func:`chunked_attention`.
        compiled: run ``torch.compile(flex_attention)`` (default: on CUDA only; uncompiled flex
            materializes the scores and is for checking only).
        plans: a dict that lives for one forward call (as in :func:`chunked_attention`): the block
            mask built for one layer is kept there (keyed by window, Tq and heads) and reused by the
            other layers, which read the same eviction steps.

    Returns:
        [B, H, Tq, D].

    Raises:
        EvictAttentionError: bad shapes, or torch without FlexAttention.
    """
    if not flex_available():
        raise EvictAttentionError(f"torch {torch.__version__} has no torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, Tq, D = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
    check_evictions(evict, offset, Tk, Hkv)
    groups = H // Hkv
    first = Tk - Tq
    per_head = evict.dim() == 3
    off = offset.to(torch.float32)

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + first
        step = evict[b, h // groups, kv_idx] if per_head else evict[b, kv_idx]
        keep = (kv_idx <= q) & (q < step)
        return keep & (q - kv_idx < window) if window is not None else keep

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (off[b, h // groups, kv_idx] if per_head else off[b, kv_idx])

    compiled = query.is_cuda if compiled is None else compiled
    key_ = ("flex", window, Tq, H if per_head else None)
    block_mask = plans.get(key_) if plans is not None else None
    if block_mask is None:
        # compiled, the block mask is built block by block; uncompiled it evaluates mask_mod on all Tq x Tk pairs
        block_mask = create_block_mask(mask_mod, B, H if per_head else None, Tq, Tk, device=query.device,
                                       _compile=compiled)
        if plans is not None:
            plans[key_] = block_mask
    return _flex(compiled)(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
                           enable_gqa=groups > 1)


def evict_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature): attention from the eviction
    steps passed to the forward call (:func:`evict_kwargs`).

    Args:
        module: the attention module (its ``layer_idx`` selects the layer's window).
        query: [B, H, Tq, D]; key, value: [B, Hkv, Tk, D].
        attention_mask: must be None (a mask would be a second, conflicting description of the kept keys).
        scaling: logit scale; dropout: must be 0.

    Returns:
        (output [B, Tq, H, D], None): transformers' layout, no attention weights.

    Raises:
        EvictAttentionError: no eviction steps in the call, a mask given, dropout > 0, or a windowed
            layer without ``layer_idx``.
    """
    if EVICT not in kwargs:
        raise EvictAttentionError(f"attention implementation {NAME!r} needs the eviction steps of the forward call "
                                  "(truncsens.engine.evict_attention.evict_kwargs); this model did not pass them on")
    if attention_mask is not None:
        raise EvictAttentionError(f"attention implementation {NAME!r} reads its kept keys from eviction steps; "
                                  "an attention mask cannot be combined with them")
    if dropout and module.training:
        raise EvictAttentionError(f"attention implementation {NAME!r} supports no dropout (got {dropout})")
    windows = kwargs.get(WINDOWS)
    window = None
    if windows is not None and windows.windowed:
        layer = getattr(module, "layer_idx", None)
        if layer is None or not 0 <= layer < len(windows.windows):
            raise EvictAttentionError(f"a windowed model whose attention module has no layer index ({layer!r})")
        window = windows.windows[layer]
    evict, offset = kwargs[EVICT].to(query.device), kwargs[OFFSET].to(query.device)
    backend = kwargs.get(BACKEND, "auto")
    if backend == "flex" or (backend == "auto" and query.is_cuda and flex_available()):
        out = flex_evict_attention(query, key, value, evict, offset, scaling, window, plans=kwargs.get(PLANS))
    else:
        out = chunked_attention(query, key, value, evict, offset, scaling, window, kwargs.get(CHUNK, DEFAULT_QUERY_CHUNK),
                                kwargs.get(PLANS))  # the call's plans: layers of one window share theirs
    return out.transpose(1, 2).contiguous(), None  # [B, Tq, H, D]


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
        evict: [B, T] or [B, Hkv, T] int64; offset: the same shape, float.
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
