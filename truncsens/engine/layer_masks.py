"""One additive attention mask per layer: a forward pre-hook on each layer's attention module replaces
the ``attention_mask`` keyword of that module's call (transformers' decoder layers pass it by keyword),
so the model's own attention function runs with that layer's mask. Used by the per-layer windows
(:mod:`truncsens.engine.layer_windows_pass`) and by the decode of per-layer, per-head kept sets on a
cache that cannot be gathered per head (:func:`truncsens.engine.rerotation.decode_head_masks`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class LayerMaskError(ValueError):
    """Per-layer masks cannot reach this model's attention modules; the message says why."""


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """Layer index -> the attention module of that layer (modules with an int ``layer_idx`` and a
    ``*Attention`` class name; the outermost one per layer index).

    Raises:
        LayerMaskError: no such modules.
    """
    found: dict[int, torch.nn.Module] = {}
    for _, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and type(module).__name__.endswith("Attention") and layer not in found:
            found[layer] = module
    if not found:
        raise LayerMaskError(f"{type(model).__name__} has no attention modules with a layer index (layer_idx): "
                             "per-layer windows cannot be applied")
    return found


@contextlib.contextmanager
def per_layer_masks(model, masks: dict[int, torch.Tensor]) -> Iterator[dict[int, int]]:
    """Inside the block, layer l's attention reads ``masks[l]`` (additive, [B, 1 | H, Tq, Tk]) instead
    of the mask the model built; yields the count of hooked calls per layer.

    Raises:
        LayerMaskError: a layer index without an attention module, or (on the call) a module called
            without an ``attention_mask`` keyword.
    """
    modules = attention_modules(model)
    missing = sorted(set(masks) - set(modules))
    if missing:
        raise LayerMaskError(f"no attention module for layers {missing} (the model has {len(modules)})")
    calls = {layer: 0 for layer in masks}
    handles = []
    for layer, mask in masks.items():
        def hook(module, args, kwargs, layer=layer, mask=mask):
            if "attention_mask" not in kwargs:
                raise LayerMaskError(f"{type(module).__name__} (layer {layer}) is called without an attention_mask "
                                     "keyword: per-layer windows cannot be applied to this model")
            calls[layer] += 1
            return args, {**kwargs, "attention_mask": mask}
        handles.append(modules[layer].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def decode_with_layer_masks(model, input_ids: torch.Tensor, cache, masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """Log-probabilities of the last token of ``input_ids`` [B, T] decoded over ``cache`` (the
    full-context cache of the first T − 1 tokens, truncated back afterwards so that one prefill
    serves every call), layer l reading its keys through ``masks[l]`` (:func:`per_layer_masks`).

    Returns:
        [B, V] float64.

    Raises:
        LayerMaskError: a layer the forward did not call exactly once with its mask.
    """
    from truncsens.engine import kvcache
    from truncsens.engine.forward import last_logprobs

    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    q_pos = torch.full((B, 1), T - 1, dtype=torch.long, device=input_ids.device)
    plain = torch.zeros(B, 1, 1, T, dtype=dtype, device=input_ids.device)  # replaced in every layer
    try:
        with per_layer_masks(model, masks) as calls:
            out = model(input_ids=input_ids[:, T - 1 :], position_ids=q_pos, attention_mask=plain, use_cache=True,
                        logits_to_keep=1, **{kvcache.cache_keyword(model): cache})
    finally:
        kvcache.truncate(cache, T - 1)
    skipped = sorted(layer for layer, n in calls.items() if n != 1)
    if skipped:
        raise LayerMaskError(f"layers {skipped} were not called exactly once with their mask")
    return last_logprobs(out.logits[:, -1, :])  # [B, V]
