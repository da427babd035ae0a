"""Attention statistics read from the model's own attention calls, without eager attention.

Inside :func:`intercept_attention` every attention layer that calls transformers' attention
interface (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``, the
transformers 4.48+ / 5.x convention) reaches a wrapper instead: the wrapper returns exactly what the
model's own implementation returns (SDPA, flash, flex, or its eager function), so outputs and
logits are unchanged, and hands the same queries, keys, mask, scaling, sliding window and softcap to
a :class:`~truncsens.engine.attention_rows.RowAccumulator`, which computes only the softmax rows the
policies' scores need, in blocks (memory O(block · T), no T × T tensor of ours).

The wrapper replaces the interface's entry for the model's implementation name for the duration of
the block (``AttentionInterface``'s class-wide mapping, or the shared ``ALL_ATTENTION_FUNCTIONS``
instance's local override where one was set, as importing NVIDIA kvpress sets one for every name;
for ``eager``, which the interface does not list, an entry calling the model module's own
``eager_attention_forward``) and restores it after.

A model whose attention cannot be intercepted this way (no transformers attention interface, an
attention-sink logit ``s_aux``, a flex ``BlockMask``) raises :class:`NotInterceptable`: the reference
pass then falls back to eager attention and forward hooks
(:class:`~truncsens.engine.reference_pass.AttentionCollector`), which builds [B, (Hkv,) T, T].
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

from truncsens.engine.attention_rows import AttentionNeeds, RowAccumulator


class NotInterceptable(RuntimeError):
    """The model's attention calls cannot be read by the wrapper (module docstring): use the eager fallback."""


def _interface():
    """transformers' ``AttentionInterface`` class, or None (an old transformers without it)."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # pragma: no cover - transformers < 4.48
        return None
    return AttentionInterface


def _mapping_of(interface, impl: str) -> dict:
    """The mapping the models' lookup ``ALL_ATTENTION_FUNCTIONS[impl]`` reads ``impl`` from: the shared
    instance's local overrides when they hold it (set by ``ALL_ATTENTION_FUNCTIONS[name] = fn``, as
    NVIDIA kvpress does on import to wrap every function), else the class-wide mapping."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # pragma: no cover - transformers < 4.48
        return interface._global_mapping
    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", None)
    return local if isinstance(local, dict) and impl in local else interface._global_mapping


def _eager_of(module):
    """The ``eager_attention_forward`` of the modeling file of ``module``.

    Raises:
        NotInterceptable: that file defines none.
    """
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise NotInterceptable(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
    return fn


@contextlib.contextmanager
def intercept_attention(model, needs: AttentionNeeds, width: int, kv_heads: int | None = None,
                        block_elements: int | None = None) -> Iterator[RowAccumulator]:
    """Inside the block, ``model``'s attention calls also feed the yielded accumulator (module docstring).

    Args:
        model: transformers model; needs: rows and accumulated rows to collect (query positions);
        width: T, the longest key length of the calls; kv_heads: None or Hkv (per-head statistics);
        block_elements: softmax elements per block (None: the accumulator's default for the device,
            :class:`~truncsens.engine.attention_rows.RowAccumulator`).

    Yields:
        :class:`~truncsens.engine.attention_rows.RowAccumulator`; its ``result()`` after the forwards.

    Raises:
        NotInterceptable: no attention interface in the installed transformers, or the model's
            configuration names no implementation; raised from inside a forward for an attention
            call the accumulator cannot reproduce (``s_aux`` sinks, a non-tensor mask of more than 2 dimensions).
    """
    interface = _interface()
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if interface is None or not isinstance(impl, str):
        raise NotInterceptable("the model names no attention implementation of transformers' attention interface")
    acc = RowAccumulator(needs, width, kv_heads, block_elements)
    mapping = _mapping_of(interface, impl)
    had = impl in mapping
    original = mapping.get(impl)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.get("s_aux") is not None:
            raise NotInterceptable(f"{type(module).__name__}: attention-sink logits (s_aux)")
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise NotInterceptable(f"{type(module).__name__}: a {type(attention_mask).__name__} attention mask")
        inner = original if had else _eager_of(module)
        out = inner(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        acc.add(module, query, key, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling,
                kwargs.get("sliding_window"), kwargs.get("softcap"))
        return out

    mapping[impl] = attention
    try:
        yield acc
    finally:
        if had:
            mapping[impl] = original
        else:
            del mapping[impl]
