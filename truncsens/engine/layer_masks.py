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
