"""Each layer's own attention window: read from a transformers model the way the model itself decides.

Sliding-window attention (Longformer's local attention, arXiv 2004.05150; Mistral, arXiv 2310.06825)
lets query q of a windowed layer read key j only if ``q - j < W`` (transformers
``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``; GPT-Neo's local
layers keep the same ``W`` keys). A kept set under a retention policy is then, in that layer, the
policy's kept keys within the layer's window. How transformers 5.x decides which layer has which
window (checked on 5.24):

- ``config.layer_types`` (Qwen2/Qwen3 from ``use_sliding_window`` and ``max_window_layers``,
  Gemma2/Gemma3/Cohere2/GPT-OSS/OLMo3/Ministral from their patterns): ``"sliding_attention"``
  layers have ``config.sliding_window``, ``"full_attention"`` layers none; the model builds one
  mask per layer type (``causal_mask_mapping``) and uses a dict ``attention_mask`` given to
  ``forward`` as that mapping, unchanged.
- no ``layer_types`` (Mistral, Mixtral, Phi-3, Starcoder2): every layer has ``config.sliding_window``
  when it is set; a 4D ``attention_mask`` replaces the model's own window (so the window must be in it).
- GPT-Neo (``config.attention_layers``): ``"local"`` layers have ``config.window_size``, applied
  inside the attention module on cache indices whatever mask is passed.

Heterogeneous configs (``config.per_layer_config``) give each layer its own ``sliding_window``.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = "full_attention"
SLIDING = "sliding_attention"


class WindowError(ValueError):
    """A model's attention pattern cannot be run as asked; the message names the model's window."""


@dataclass(frozen=True)
class LayerWindows:
    """Per-layer attention windows of a model.

    Attributes:
        windows: per layer, the window W in tokens (query q reads key j only if ``q - j < W``),
            or None for full causal attention.
        layer_types: per layer, the name the model keys its masks by (``"full_attention"``,
            ``"sliding_attention"``, or another type such as ``"chunked_attention"``).
        keyed: the model's forward takes a dict ``{layer type: 4D mask}`` as ``attention_mask``
            (looked up only when its layers have different windows; False otherwise).
        applies_own: the attention modules apply the window themselves, on cache indices, whatever
            mask is passed (GPT-Neo); a 4D mask then only needs the kept keys.
    """

    windows: tuple[int | None, ...]
    layer_types: tuple[str, ...]
    keyed: bool = False
    applies_own: bool = False

    def __post_init__(self) -> None:
        if len(self.windows) != len(self.layer_types):
            raise ValueError(f"{len(self.windows)} windows for {len(self.layer_types)} layer types")
        for w in self.windows:
            if w is not None and w < 1:
                raise ValueError(f"an attention window must be at least 1 token, got {w}")

    @property
    def windowed(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.windows)

    @property
    def unsupported(self) -> tuple[str, ...]:
        """Layer types that are neither full nor sliding-window attention (chunked, linear, ...)."""
        return tuple(sorted({t for t in self.layer_types if t not in (FULL, SLIDING)}))

    def describe(self) -> str:
        """A phrase naming the windows, e.g. ``"sliding-window layers of 4 tokens (1 of 2 layers)"``."""
        sizes = sorted({w for w in self.windows if w is not None})
        if not sizes:
            return "no sliding-window layers"
        n = sum(w is not None for w in self.windows)
        return (f"sliding-window layers of {' / '.join(str(s) for s in sizes)} tokens "
                f"({n} of {len(self.windows)} layers)")

    def type_windows(self) -> dict[str, int | None]:
        """Layer type -> its window (None: full attention).

        Raises:
            WindowError: two layers of one type have different windows (a mask per type cannot hold both).
        """
        out: dict[str, int | None] = {}
        for t, w in zip(self.layer_types, self.windows):
            if t in out and out[t] != w:
                raise WindowError(f"layers of type {t!r} have different windows ({out[t]} and {w}); "
                                  "one mask per layer type cannot express them")
            out[t] = w
        return out

    def check_supported(self, model_name: str, semantics: str) -> None:
        """Raise :class:`WindowError` unless masks of kept keys within each layer's window can be
        given to this model (one 4D mask when every layer has the same window, or the model
        applies its windows itself; else a dict keyed by layer type).

        Raises:
            WindowError: a layer type that is neither full nor sliding-window attention, or layers
                with different windows and a model that takes a single mask.
        """
        if self.unsupported:
            raise WindowError(
                f"model {model_name} has {', '.join(self.unsupported)} layers ({self.describe()}); "
                f"semantics {semantics} supports full and sliding-window attention only")
        if self.applies_own or len(set(self.windows)) <= 1:
            return
        if not self.keyed:
            raise WindowError(
                f"model {model_name} has {self.describe()}, and its forward takes one attention mask for all "
                f"layers; semantics {semantics} is not supported for it")
        self.type_windows()


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def _n_layers(config) -> int:
    for name in ("num_hidden_layers", "num_layers", "n_layer"):
        n = getattr(config, name, None)
        if isinstance(n, int):
            return n
    raise WindowError(f"the model config ({type(config).__name__}) names no number of layers")


def _per_layer(config, n: int) -> list:
    try:
        layers = list(config.per_layer_config)  # heterogeneous configs (transformers >= 5)
    except (AttributeError, TypeError):
        return [config] * n
    return layers if len(layers) == n else [config] * n


def _accepts_mask_dict(model) -> bool:
    """Whether the decoder's forward uses a dict ``attention_mask`` as its per-layer-type mask mapping."""
    import inspect

    base = getattr(model, "base_model", model)
    for module in (base, getattr(base, "language_model", None)):
        if module is None:
            continue
        try:
            source = inspect.getsource(type(module).forward)
        except (AttributeError, OSError, TypeError):
            continue
        if "attention_mask, dict)" in source:
            return True
    return False


def layer_windows(model) -> LayerWindows:
    """The attention window of every layer of ``model``, as the model itself applies it.

    Args:
        model: a transformers causal LM (anything without a ``config`` counts as one full layer).

    Returns:
        :class:`LayerWindows`.

    Raises:
        WindowError: the config names no number of layers, or ``layer_types`` has the wrong length.
    """
    config = getattr(model, "config", None)
    if config is None:
        return LayerWindows((None,), (FULL,))
    windows = config_windows(config)
    if windows.keyed and not _accepts_mask_dict(model):
        windows = LayerWindows(windows.windows, windows.layer_types, applies_own=windows.applies_own)
    return windows


def config_windows(config) -> LayerWindows:
    """The attention window of every layer from a model config alone (a transformers config, or any
    object with its attributes). Rules, as transformers applies them: GPT-Neo's ``attention_layers``
    ("local" layers of ``window_size``); ``layer_types`` ("sliding_attention" / "full_attention" /
    other kinds); without it, Qwen2's ``use_sliding_window`` from layer ``max_window_layers`` on, or a
    ``sliding_window`` on every layer (Mistral v0.1). ``keyed`` is set when layers differ (whether
    the model's forward takes a dict of masks is checked by :func:`layer_windows`).

    Raises:
        WindowError: no number of layers, or ``layer_types`` of the wrong length.
    """
    config = _text_config(config)
    attention_layers = getattr(config, "attention_layers", None)
    if getattr(config, "model_type", "") == "gpt_neo" and attention_layers:
        window = getattr(config, "window_size", None)
        windows = tuple(window if t == "local" else None for t in attention_layers)
        return LayerWindows(windows, tuple(SLIDING if t == "local" else FULL for t in attention_layers), applies_own=True)
    n = _n_layers(config)
    layers = _per_layer(config, n)
    types = getattr(config, "layer_types", None)
    if types is None and getattr(config, "max_window_layers", None) is not None and getattr(config, "use_sliding_window", None):
        first = int(config.max_window_layers)  # Qwen2 without layer_types: layers from max_window_layers slide
        types = [SLIDING if i >= first else FULL for i in range(n)]
    if types is None:
        if getattr(config, "use_sliding_window", True) is False:
            types = [FULL] * n
        else:
            types = [SLIDING if getattr(c, "sliding_window", None) is not None
                     else "chunked_attention" if getattr(c, "attention_chunk_size", None) is not None else FULL
                     for c in layers]
    types = tuple(types)
    if len(types) != n:
        raise WindowError(f"the model config lists {len(types)} layer types for {n} layers")
    windows = tuple(int(c.sliding_window) if t == SLIDING and getattr(c, "sliding_window", None) is not None else None
                    for t, c in zip(types, layers))
    types = tuple(FULL if t == SLIDING and w is None else t for t, w in zip(types, windows))
    # a dict of masks is only needed (and its support only looked up) when layers differ
    return LayerWindows(windows, types, keyed=len(set(windows)) > 1)


def attention_windows(model) -> list[int | None]:
    """Per layer, the attention window in tokens (None: full attention); see :func:`layer_windows`."""
    return list(layer_windows(model).windows)


def kept_attention_mask(windows: LayerWindows, keep, offset, q_pos, k_pos, dtype, groups: int = 1):
    """The ``attention_mask`` argument that makes every layer read the kept keys within its own window.

    Args:
        windows: the model's :class:`LayerWindows` (checked with :meth:`LayerWindows.check_supported`).
        keep: [B, Tq, Tk] bool kept keys, or [B, Hkv, Tq, Tk] per key/value head (head granularity);
            offset: the same shape, float offsets, or None.
        q_pos: [B, Tq], k_pos: [B, Tk] int64 positions of queries and keys.
        dtype: the model's compute dtype.
        groups: with per-head ``keep``, query heads per key/value head (G = H / Hkv): query head
            ``h·G + i`` reads key/value head h's kept keys (transformers' ``repeat_kv`` order).

    Returns:
        one [B, 1, Tq, Tk] additive mask when every layer has the same window (or the model
        applies its windows itself), else a dict layer type -> [B, 1, Tq, Tk] mask. With per-head
        ``keep`` the heads dimension is H = Hkv·G instead of 1 ([B, H, Tq, Tk]: transformers'
        eager and sdpa attention add a 4D mask with a heads dimension to each head's scores).

    Raises:
        WindowError: layers with different windows and a model that takes a single mask.
        ValueError: a query row keeps no key.
    """
    if keep.dim() == 4:
        B, Hkv, Tq, Tk = keep.shape
        folded = kept_attention_mask(  # [B·Hkv, 1, Tq, Tk] (or a dict of them)
            windows, keep.reshape(B * Hkv, Tq, Tk), None if offset is None else offset.reshape(B * Hkv, Tq, Tk),
            q_pos.repeat_interleave(Hkv, 0), k_pos.repeat_interleave(Hkv, 0), dtype)

        def per_query_head(m):
            return m.view(B, Hkv, Tq, Tk).repeat_interleave(groups, dim=1)  # [B, Hkv·G, Tq, Tk]

        return {t: per_query_head(m) for t, m in folded.items()} if isinstance(folded, dict) else per_query_head(folded)
    from truncsens.engine.masks import additive_mask, layer_masks

    if windows.applies_own or not windows.windowed:
        return additive_mask(keep, offset, dtype)
    if len(set(windows.windows)) == 1:
        return layer_masks(keep, offset, q_pos, k_pos, {SLIDING: windows.windows[0]}, dtype)[SLIDING]
    if not windows.keyed:
        raise WindowError(f"the model has {windows.describe()} and takes a single attention mask")
    return layer_masks(keep, offset, q_pos, k_pos, windows.type_windows(), dtype)


def own_window_differs(windows: LayerWindows, positions) -> bool:
    """Whether a model that applies its windows on sequence indices (``applies_own``) would see, in a
    sequence with ``positions`` [B, k] (increasing), a different set of keys than the windows on
    positions: some pair i >= j with ``(i - j < W) != (p_i - p_j < W)``."""
    import torch

    sizes = {w for w in windows.windows if w is not None}
    if not sizes:
        return False
    k = positions.shape[-1]
    index = torch.arange(k, device=positions.device)
    causal = index.unsqueeze(1) >= index.unsqueeze(0)  # [k, k]
    by_index = index.unsqueeze(1) - index.unsqueeze(0)  # [k, k]
    by_position = positions.unsqueeze(-1) - positions.unsqueeze(-2)  # [B, k, k]
    return any(bool((((by_index < w) != (by_position < w)) & causal).any()) for w in sizes)
