"""A window per layer, the measurement behind ``truncsens plan``: under prefill-evict, the
decode step of the target's query in which layer l reads only its sinks and its last w_l keys
(every layer its own w_l, or the full cache); under streaming, one parallel pass in which every
token was processed that way (:func:`stream_layer_windows`).

Each attention module gets its own additive mask through a forward pre-hook that replaces the
``attention_mask`` keyword of that module's call (transformers' decoder layers pass it by keyword),
so the model's own attention function runs (soft-capping and learned sinks included) and a layer
with a sliding window of its own keeps it: the kept keys of layer l are

    keep_l(j) = (j < S or T − 1 − j < w_l) and (T − 1 − j < W_l when layer l slides over W_l),

for the query at position T − 1 over keys 0..T − 1 (its own key included: ``T − 1 − j = 0``). The
keys and values are those of the full-context prefill (prefill-evict semantics, docs/method.md
section 3). Every hooked module must be called with an ``attention_mask`` keyword exactly once;
otherwise the run stops (:class:`LayerMaskError`) instead of measuring an unmasked layer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from truncsens.engine import evict_attention
from truncsens.engine.attention_windows import layer_windows
from truncsens.engine.forward import last_logprobs
from truncsens.engine.layer_masks import LayerMaskError, attention_modules, decode_with_layer_masks, per_layer_masks  # (imported from here too)
from truncsens.engine.masks import masked_value


def window_masks(model, T: int, windows: Sequence[int | None], n_sink: int, batch: int,
                 dtype: torch.dtype, device, queries: int = 1) -> dict[int, torch.Tensor]:
    """Layer -> [B, 1, Q, T] additive mask of the last Q queries (positions T − Q .. T − 1) over keys
    0..T − 1 (module docstring, with q in place of T − 1, and j <= q); ``windows[l]`` None keeps
    every key of layer l (within its own sliding window, if any). Q = 1: the prefill-evict decode;
    Q = T: streaming, every token processed under its own window.

    Raises:
        LayerMaskError: ``windows`` of another length than the model's layers, a window below 1.
    """
    own = layer_windows(model).windows
    if len(windows) != len(own):
        raise LayerMaskError(f"{len(windows)} windows for a model of {len(own)} layers")
    q = torch.arange(T - queries, T, device=device).view(queries, 1)  # [Q, 1]
    j = torch.arange(T, device=device).view(1, T)  # [1, T]
    distance = q - j  # [Q, T] distance of each key from each query (negative: a later key)
    out = {}
    for layer, (w, W) in enumerate(zip(windows, own)):
        if w is not None and w < 1:
            raise LayerMaskError(f"the window of layer {layer} must be at least 1 token, got {w}")
        keep = distance >= 0  # [Q, T] causal
        if w is not None:
            keep = keep & ((j < n_sink) | (distance < w))
        if W is not None:
            keep = keep & (distance < W)
        mask = torch.where(keep, torch.zeros((), dtype=dtype, device=device),
                           torch.tensor(masked_value(dtype), dtype=dtype, device=device))  # [Q, T]
        out[layer] = mask.view(1, 1, queries, T).expand(batch, 1, queries, T)  # [B, 1, Q, T]
    return out


def window_evictions(T: int, windows: Sequence[int | None], n_sink: int, batch: int, device) -> dict[int, torch.Tensor]:
    """Layer -> [B, T] int64 eviction step of each key under streaming with that layer's window: a
    sink (j < S) or a key of a layer without window is never evicted (T), key j of a layer with
    window w is read by the queries ``j <= q < j + w`` (:class:`~truncsens.policies.streaming.Evictions`'
    convention; the layer's own sliding window is applied by the attention function).

    Raises:
        LayerMaskError: a window below 1.
    """
    j = torch.arange(T, device=device)  # [T]
    out = {}
    for layer, w in enumerate(windows):
        if w is not None and w < 1:
            raise LayerMaskError(f"the window of layer {layer} must be at least 1 token, got {w}")
        steps = torch.full((T,), T, dtype=torch.long, device=device) if w is None else \
            torch.where(j < n_sink, torch.full_like(j, T), (j + w).clamp(max=T))  # [T]
        out[layer] = steps.expand(batch, T)  # [B, T]
    return out


@torch.no_grad()
def stream_layer_windows(model, input_ids: torch.Tensor, windows: Sequence[int | None], n_sink: int) -> torch.Tensor:
    """Streaming with a window per layer: one parallel pass over ``input_ids`` [B, T] in which every
    token was processed with the cache of its own step, layer l holding its sinks and last
    ``windows[l]`` keys (a streaming cache that evicts by position never re-admits a key, so one
    eviction step per key and layer describes it exactly: :func:`window_evictions`).

    Attention runs from those steps (:mod:`truncsens.engine.evict_attention`, query chunks; no T × T
    mask, memory linear in T). Models that cannot take eviction steps (see
    :meth:`~truncsens.engine.semantics.streaming.Streaming.kept_logprobs`) get one [B, 1, T, T]
    mask per layer (:func:`window_masks`, :func:`per_layer_masks`) instead.

    Returns:
        [B, V] float64 log-probabilities after the last token.

    Raises:
        LayerMaskError: as :func:`window_masks` and :func:`per_layer_masks`.
    """
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
    model_windows = layer_windows(model)
    if len(windows) != len(model_windows.windows):
        raise LayerMaskError(f"{len(windows)} windows for a model of {len(model_windows.windows)} layers")
    if evict_attention.supported(model, model_windows):
        evict = window_evictions(T, windows, n_sink, B, input_ids.device)
        offset = {layer: torch.zeros(B, T, device=input_ids.device) for layer in evict}  # [B, T] each
        kwargs = evict_attention.evict_kwargs(evict, offset, model_windows)
        try:
            with evict_attention.evict_attention(model):
                out = model(input_ids=input_ids, position_ids=pos, use_cache=False, logits_to_keep=1, **kwargs)
        except evict_attention.EvictStepsMissing:  # a decoder layer did not pass the steps on
            out = None
        if out is not None and evict_attention.attention_calls(kwargs) == len(evict):
            return last_logprobs(out.logits[:, -1, :])
    dtype = next(model.parameters()).dtype
    masks = window_masks(model, T, windows, n_sink, B, dtype, input_ids.device, queries=T)
    plain = torch.zeros(B, 1, T, T, dtype=dtype, device=input_ids.device)  # replaced in every layer
    with per_layer_masks(model, masks) as calls:
        out = model(input_ids=input_ids, position_ids=pos, attention_mask=plain, use_cache=False, logits_to_keep=1)
    skipped = sorted(layer for layer, n in calls.items() if n != 1)
    if skipped:
        raise LayerMaskError(f"layers {skipped} were not called exactly once with their mask")
    return last_logprobs(out.logits[:, -1, :])


@torch.no_grad()
def decode_layer_windows(model, input_ids: torch.Tensor, cache, windows: Sequence[int | None], n_sink: int) -> torch.Tensor:
    """Log-probabilities after ``input_ids`` [B, T] when layer l reads its sinks and last ``windows[l]``
    keys of ``cache`` (the full-context cache of the first T − 1 tokens, truncated back afterwards so
    one prefill serves every call).

    Returns:
        [B, V] float64.

    Raises:
        LayerMaskError: as :func:`window_masks` and :func:`per_layer_masks`, or a layer the forward
            did not call.
    """
    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    masks = window_masks(model, T, windows, n_sink, B, dtype, input_ids.device)
    return decode_with_layer_masks(model, input_ids, cache, masks)  # [B, V]


def measure_layer_windows(model, targets, configurations: Sequence[Sequence[int | None]], n_sink: int, device,
                          max_batch_tokens: int, on_tokens=None, semantics="prefill_evict") -> tuple[dict, int]:
    """Every metric of every target under each per-layer window configuration.

    Args:
        targets: :class:`~truncsens.targets.TargetSet` (n targets, contexts [n, N]).
        configurations: C sequences of per-layer windows (None: the full cache), each of the model's
            length L; one prefill per batch serves all of them.
        n_sink: S, the first keys every windowed layer keeps.
        on_tokens: called with the forward tokens of each batch (progress).
        semantics: a :class:`~truncsens.engine.semantics.Semantics` with ``per_layer`` (or its name): one
            that keeps the prefill's cache decodes each configuration on it (:func:`decode_layer_windows`,
            ``prefill_evict``), another streams the whole context per configuration
            (:func:`stream_layer_windows`, ``streaming``).

    Returns:
        (metric name -> [C, n] array in its record's dtype, values clamped for rounding).

    Raises:
        LayerMaskError: as :func:`decode_layer_windows`, or a semantics without per-layer sweeps.
        truncsens.engine.semantics.SemanticsError: an unknown semantics name.
    """
    from truncsens.engine.batching import run_in_batches
    from truncsens.engine.kernel import metric_arrays, store_metrics
    from truncsens.engine.reference_pass import reference_pass
    from truncsens.engine.semantics import semantics_for

    semantics = semantics_for(semantics) if isinstance(semantics, str) else semantics
    if not semantics.per_layer:
        able = " or ".join(semantics.names_where(lambda s: s.per_layer))
        raise LayerMaskError(f"per-layer windows run under {able}, not {semantics.name!r}")
    n, N = targets.context.shape
    configurations = [list(c) for c in configurations]
    metrics = metric_arrays((len(configurations), n))
    clamped = [0]
    context, token_id = targets.context.to(device), targets.token_id.to(device)

    def step(sl: slice) -> None:
        ids = context[sl]  # [b, N]
        ref = reference_pass(model, ids, keep_cache=semantics.keeps_cache)
        for c, windows in enumerate(configurations):
            if semantics.keeps_cache:
                lp = decode_layer_windows(model, ids, ref.cache, windows, n_sink)  # [b, V]
            else:
                lp = stream_layer_windows(model, ids, windows, n_sink)  # [b, V]
            clamped[0] += store_metrics(metrics, (c, sl), ref.logprobs, lp, token_id[sl])
        if on_tokens:
            per_config = ids.shape[0] * semantics.cost(ids.shape[1], 0)  # forward tokens of one configuration
            on_tokens(ids.numel() + per_config * len(configurations))

    run_in_batches(step, n, N, max_batch_tokens)
    return metrics, clamped[0]


def layer_sweep_configurations(n_layers: int, windows: Sequence[int]) -> list[list[int | None]]:
    """The configurations of a per-layer sweep, layer-major: layer l at window w, every other layer
    with its full cache (index ``l · len(windows) + j`` for window ``windows[j]``)."""
    out = []
    for layer in range(n_layers):
        for w in windows:
            cfg: list[int | None] = [None] * n_layers
            cfg[layer] = int(w)
            out.append(cfg)
    return out
