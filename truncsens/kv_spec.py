"""KV-cache sizes of a model, read from its config (a local folder, the bundled reference model, or a
Hugging Face hub id whose config is already in the local cache; never fetched).

Bytes of one cached token: 2 (K and V) * layers * kv_heads * head_dim * bytes_per_element
(:func:`truncsens.windows.kv_bytes_per_sequence`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from truncsens.windows import kv_bytes_per_sequence

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class KVSpec:
    """What one cached token costs: ``layers * kv_heads * head_dim`` elements of K and of V."""

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int
    source: str

    def bytes_for(self, window: int, sinks: int = 0) -> int:
        """:func:`kv_bytes_per_sequence` for this model."""
        return kv_bytes_per_sequence(self.layers, self.kv_heads, self.head_dim, self.bytes_per_element, window, sinks)


def kv_spec_for_model(model: str, dtype: str) -> tuple[KVSpec | None, str]:
    """KV sizes from the model's config when it is known locally: "reference", a checkpoint
    folder, or a hub id whose config is in the local Hugging Face cache (never fetched).

    Returns:
        (spec or None, a note saying where the sizes come from or why they are unknown).
    """
    from transformers import AutoConfig

    from truncsens.models import REFERENCE_DIR

    unknown = f"KV memory not shown: the config of model {model!r} is not available locally"
    if model == "reference":
        path = REFERENCE_DIR
    elif model and Path(model).expanduser().is_dir():
        path = Path(model).expanduser()
    elif model and not model.startswith("synthetic"):  # a hub id: its cached config, if any
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


def _kv_spec(cfg, dtype: str, source: str) -> tuple[KVSpec | None, str]:
    """:class:`KVSpec` from a transformers config (layers, kv heads, head dim) and a dtype name."""
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads and getattr(cfg, "hidden_size", None) else None)
    nbytes = BYTES_PER_ELEMENT.get(str(dtype))
    if not (layers and kv_heads and head_dim and nbytes):
        return None, f"KV memory not shown: {source} lacks layer/head sizes, or dtype {dtype!r} is unknown"
    return KVSpec(int(layers), int(kv_heads), int(head_dim), int(nbytes), source), (
        f"KV bytes = 2 x {layers} layers x {kv_heads} kv heads x {head_dim} head dim x {nbytes} bytes ({dtype}) x (w + sinks)")
