"""What every attention layer saw during the prefill of the reference pass (for cache-compression presses).

A score-based cache compressor (NVIDIA kvpress's ``ScorerPress``) scores the keys of one layer from
the layer's attention module, its input hidden states, its keys and values and the forward's keyword
arguments (``score(module, hidden_states, keys, values, attentions, kwargs)``). Under
``prefill_evict`` the keys and values are those of the reference pass's cache; this module records
the rest with forward hooks on the attention modules during the prefill of the first T - 1 tokens
(the first call of each module inside :func:`record_prefill`; the decode step is not recorded).

Memory: one [B, T - 1, D] hidden-state tensor per layer, held as long as the reference pass is.
Attention weights are not recorded (``attentions`` is None, as under kvpress with SDPA attention).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Iterator

import torch

from truncsens.engine.reference_pass import ReferencePass


@dataclass
class PrefillLayers:
    """Inputs of each attention layer during the prefill, in layer order (L layers).

    Attributes:
        model: the model the layers belong to.
        modules: the L attention modules (``model.model.layers[l].self_attn``).
        hidden_states: L tensors [B, T - 1, D], each layer's input hidden states.
        kwargs: L dicts, the keyword arguments of each layer's forward (``position_embeddings``,
            ``attention_mask``, ...), with ``past_key_values`` and ``cache_position`` added where the
            installed transformers names them otherwise (``cache``) or passes none, so presses
            written for either convention find them.
    """

    model: object = None
    modules: list = field(default_factory=list)
    hidden_states: list[torch.Tensor] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)


@dataclass
class PrefillReference(ReferencePass):
    """A :class:`~truncsens.engine.reference_pass.ReferencePass` with the recorded :class:`PrefillLayers`."""

    layers: PrefillLayers | None = None

    @classmethod
    def of(cls, ref: ReferencePass, layers: PrefillLayers) -> "PrefillReference":
        """``ref`` (shared tensors, not copies) with ``layers`` attached."""
        return cls(**{f.name: getattr(ref, f.name) for f in fields(ReferencePass)}, layers=layers)


def attention_layers(model) -> list:
    """The attention modules of a decoder (``model.model.layers[l].self_attn``), in layer order.

    Raises:
        ValueError: the model has no ``model.layers[*].self_attn`` (the layout kvpress hooks).
    """
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"{type(model).__name__} has no model.layers[*].self_attn attention modules "
                         "(the decoder layout cache-compression presses hook); use a Llama-like model")
    return [layer.self_attn for layer in layers]


@contextlib.contextmanager
def record_prefill(model) -> Iterator[PrefillLayers]:
    """Record each attention layer's first forward inside the block (the prefill).

    Yields:
        :class:`PrefillLayers`, filled when the block's first forward has run.

    Raises:
        ValueError: see :func:`attention_layers`.
    """
    modules = attention_layers(model)
    out = PrefillLayers(model=model, modules=modules, hidden_states=[None] * len(modules), kwargs=[None] * len(modules))

    def hook(index: int):
        def record(module, args, kwargs, output) -> None:
            if out.kwargs[index] is not None:  # the decode step
                return
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, T-1, D]
            seen = dict(kwargs)
            seen.pop("hidden_states", None)
            if "past_key_values" not in seen and "cache" in seen:
                seen["past_key_values"] = seen["cache"]
            if seen.get("cache_position") is None:
                seen["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)  # [T-1]
            out.hidden_states[index], out.kwargs[index] = hidden.detach(), seen
        return record

    handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
