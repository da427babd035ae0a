"""Plumbing for transformers key/value caches: create, read, select, truncate.

Works with transformers 4.54 (the declared minimum) to 5.x: ``cache.layers[l].keys`` of shape
[B, H_kv, T, d] (4.54 on; ``key_cache`` lists before), ``DynamicCache(config=...)`` where the
constructor takes it; the forward keyword is ``cache`` in 5.x and ``past_key_values`` before.
Keys are stored after the rotary embedding, so a selected key keeps its original position. Values
may have another width (and head count) than keys: every helper here handles each by its own shape.
"""

from __future__ import annotations

import inspect

import torch


def cache_keyword(model) -> str:
    """The forward keyword that takes a cache: "cache" (transformers 5.x) or "past_key_values"."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model):
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def new_preallocated_cache(model, n_layers: int, capacity: int):
    """An empty cache of ``n_layers`` full-attention layers whose keys and values are written into
    buffers of ``capacity`` positions allocated at the first token, so a token-by-token run copies
    each new key once instead of the whole cache at every step (``DynamicCache`` concatenates:
    O(T) per step, O(T²) over a run). Each layer's ``keys`` and ``values`` are views [B, H, n, d] of
    the first n positions written, as ``DynamicCache`` returns them; the values are the same.

    Falls back to :func:`new_cache` on a transformers whose caches have no ``layers`` (4.x before
    the cache layers), where the run is slower but equal.

    Raises:
        ValueError: a write past ``capacity`` positions.
    """
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # older transformers
        return new_cache(model)

    class PreallocatedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.device = key_states.device
                B = key_states.shape[0]
                self._keys = key_states.new_empty(B, key_states.shape[1], capacity, key_states.shape[3])
                self._values = value_states.new_empty(B, value_states.shape[1], capacity, value_states.shape[3])
                self._length = 0
                self.is_initialized = True
            start, c = self._length, key_states.shape[-2]
            if start + c > capacity:
                raise ValueError(f"the cache holds {capacity} positions; writing {c} at {start} would pass it")
            self._keys[:, :, start : start + c] = key_states
            self._values[:, :, start : start + c] = value_states
            self._length = start + c
            self.keys = self._keys[:, :, : self._length]  # [B, H_k, n, d_k] a view
            self.values = self._values[:, :, : self._length]  # [B, H_v, n, d_v] a view
            return self.keys, self.values

    cache = DynamicCache()
    if not hasattr(cache, "layers"):
        return new_cache(model)
    cache.layers = [PreallocatedLayer() for _ in range(n_layers)]
    return cache


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of one layer, each [B, H_kv, T, d]."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers 4.x


def n_layers(cache) -> int:
    """Number of layers held by the cache."""
    return len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)


def cache_from(model, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A new cache holding the given per-layer keys and values ([B, H_kv, T, d] each)."""
    cache = new_cache(model)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache


def truncate(cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer, in place."""
    for layer in range(n_layers(cache)):
        k, v = layer_kv(cache, layer)
        if hasattr(cache, "layers"):
            cache.layers[layer].keys = k[..., :length, :]
            cache.layers[layer].values = v[..., :length, :]
        else:  # transformers 4.x
            cache.key_cache[layer] = k[..., :length, :]
            cache.value_cache[layer] = v[..., :length, :]


def select(model, cache, index: torch.Tensor):
    """A new cache with positions ``index`` ([k] int64, on the cache device) of every layer (cache surgery)."""
    keys, values = [], []
    for layer in range(n_layers(cache)):
        k, v = layer_kv(cache, layer)  # [B, H_kv, T, d]
        keys.append(k.index_select(2, index))  # [B, H_kv, k, d]
        values.append(v.index_select(2, index))
    return cache_from(model, keys, values)


def new_full_cache(model):
    """An empty ``DynamicCache`` whose every layer keeps every key (no sliding-window layers, which
    would keep only the last W - 1 keys): the cache a kept set is selected from. ``model`` is
    accepted for symmetry with :func:`new_cache`; the model still applies its windows through its masks."""
    from transformers import DynamicCache

    return DynamicCache()


def gather_slots(cache, index: torch.Tensor) -> None:
    """Keep, per sequence, the cache slots ``index`` [B, L] (int64, in the order given) of every layer, in place.

    Rows may select different slots (each sequence of a batch evicts its own keys). Keys [B, H_k, T, d_k]
    become [B, H_k, L, d_k] and values [B, H_v, T, d_v] become [B, H_v, L, d_v], each gathered by its
    own shape: multi-head latent attention (DeepSeek-V2/V3) caches a compressed latent as "keys" and
    the rotary key part as "values", of different widths (transformers 4.x caches its expanded keys and
    values, of different head dimensions).
    """

    def take(t: torch.Tensor) -> torch.Tensor:
        B, H, _, d = t.shape
        return t.gather(2, index.view(B, 1, -1, 1).expand(B, H, index.shape[1], d))  # [B, H, L, d]

    for layer in range(n_layers(cache)):
        k, v = layer_kv(cache, layer)  # [B, H_k, T, d_k], [B, H_v, T, d_v]
        if hasattr(cache, "layers"):
            cache.layers[layer].keys, cache.layers[layer].values = take(k), take(v)
        else:  # transformers 4.x
            cache.key_cache[layer], cache.value_cache[layer] = take(k), take(v)


def set_layer_kv(cache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace layer ``layer``'s keys [B, H_k, L, d_k] and values [B, H_v, L, d_v] of ``cache`` (any L)."""
    if hasattr(cache, "layers"):
        cache.layers[layer].keys, cache.layers[layer].values = keys, values
    else:  # transformers 4.x
        cache.key_cache[layer], cache.value_cache[layer] = keys, values
