"""KV-cache sizes of a model, read from its config (a local folder, the bundled reference model, or a
Hugging Face hub id whose config is already in the local cache; never fetched).

Bytes of a sequence: 2 (K and V) * kv_heads * head_dim * bytes_per_element * the tokens cached
summed over layers (:func:`truncsens.budget.windows.kv_bytes_per_sequence`), where a sliding-window layer
of window W caches at most W tokens. Per-layer windows come from the config with the engine's rules
(:func:`layer_windows_from_config`, :func:`truncsens.engine.attention_windows.config_windows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from truncsens.budget.windows import kv_bytes_per_sequence

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class KVSpec:
    """What one cached token costs per layer (``kv_heads * head_dim`` elements of K and of V), and how
    many tokens each layer caches at most (``layer_windows``: None = full attention, or an int W).

    Raises:
        ValueError: ``layer_windows`` of another length than ``layers``.
    """

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int
    source: str
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_windows is not None and len(self.layer_windows) != self.layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.layers} layers")

    @property
    def sliding_layers(self) -> int:
        """Number of sliding-window layers."""
        return sum(W is not None for W in (self.layer_windows or ()))

    def bytes_for(self, window: int, sinks: int = 0) -> int:
        """:func:`kv_bytes_per_sequence` for this model, each layer counting its own window."""
        return kv_bytes_per_sequence(self.layers, self.kv_heads, self.head_dim, self.bytes_per_element, window, sinks,
                                     self.layer_windows)


def layer_windows_from_config(cfg: Any) -> tuple[int | None, ...]:
    """Per-layer attention windows of a transformers config object or a ``config.json`` dict: one
    entry per layer, None for full attention, else the window W. The rules are the engine's, which
    masks the same windows when it measures (:func:`truncsens.engine.attention_windows.config_windows`).

    Raises:
        ValueError: no number of layers, ``layer_types`` of another length, or a sliding layer
            without a positive ``sliding_window``.
    """
    from types import SimpleNamespace

    from truncsens.engine.attention_windows import SLIDING, config_windows

    config = SimpleNamespace(**cfg) if isinstance(cfg, dict) else cfg
    found = config_windows(config)  # raises WindowError, a ValueError
    for kind, W in zip(found.layer_types, found.windows):
        if kind == SLIDING and W is None or (W is not None and W < 1):
            raise ValueError(f"the config has sliding-window layers but sliding_window = {getattr(config, 'sliding_window', None)!r}")
    return tuple(found.windows)


def kv_spec_for_model(model: str, dtype: str) -> tuple[KVSpec | None, str]:
    """KV sizes from the model's config when it is known locally: "reference", a checkpoint
    folder, or a hub id whose config is in the local Hugging Face cache (never fetched).

    Returns:
        (spec or None, a note saying where the sizes come from or why they are unknown).
    """
    from transformers import AutoConfig

    from truncsens.models import REFERENCE_DIR, model_source

    unknown = f"KV memory not shown: the config of model {model!r} is not available locally"
    if model and model_source(model).kind == "synthetic":
        return None, f"KV memory not shown: {model!r} is a synthetic source, not a transformer with a KV cache"
    if model == "reference":
        path = REFERENCE_DIR
    elif model and Path(model).expanduser().is_dir():
        path = Path(model).expanduser()
    elif model and model_source(model).kind == "hub":  # a hub id: its cached config, if any
        try:
            cfg = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError):
            return None, unknown
        return _kv_spec(cfg, dtype, f"{model} (cached config)")
    else:
        return None, unknown
    if not (path / "config.json").is_file():
        return None, f"KV memory not shown: no config.json in {path}"
    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        return None, f"KV memory not shown: cannot read {path / 'config.json'} ({exc})"
    return _kv_spec(cfg, dtype, str(path / "config.json"))


def kv_spec_from_config(config: dict, dtype: str, source: str) -> tuple[KVSpec | None, str]:
    """KV sizes from a config dict (``config.json``'s content; a results file's ``model_config`` attr),
    rebuilt as its transformers config class when ``model_type`` is known (sub-configs, per-layer
    settings), else read as plain attributes.

    Returns:
        (spec or None, a note saying where the sizes come from or why they are unknown).
    """
    from types import SimpleNamespace

    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        cfg = AutoConfig.for_model(str(config.get("model_type", "")), **fields)
    except (KeyError, ValueError, TypeError):  # an unknown model type (remote code)
        cfg = SimpleNamespace(**config)
    return _kv_spec(cfg, dtype, source)


def _kv_spec(cfg, dtype: str, source: str) -> tuple[KVSpec | None, str]:
    """:class:`KVSpec` from a transformers config (layers, kv heads, head dim) and a dtype name."""
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads and getattr(cfg, "hidden_size", None) else None)
    nbytes = BYTES_PER_ELEMENT.get(str(dtype))
    if not (layers and kv_heads and head_dim and nbytes):
        return None, f"KV memory not shown: {source} lacks layer/head sizes, or dtype {dtype!r} is unknown"
    try:
        windows = layer_windows_from_config(cfg)
    except ValueError as exc:
        return None, f"KV memory not shown: {source}: {exc}"
    spec = KVSpec(int(layers), int(kv_heads), int(head_dim), int(nbytes), source,
                  windows if any(W is not None for W in windows) else None)
    if spec.layer_windows is None:
        return spec, (f"KV bytes = 2 x {layers} layers x {kv_heads} kv heads x {head_dim} head dim x {nbytes} bytes ({dtype}) "
                      "x (w + sinks)")
    sizes = sorted({W for W in windows if W is not None})
    return spec, (f"KV bytes = 2 x {kv_heads} kv heads x {head_dim} head dim x {nbytes} bytes ({dtype}) x sum over {layers} "
                  f"layers of the tokens each caches: w + sinks in {layers - spec.sliding_layers} full-attention layers, "
                  f"min(w + sinks, W) in {spec.sliding_layers} sliding-window layers (W = {', '.join(map(str, sizes))})")
