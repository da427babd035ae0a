"""What every model source returns and validates: :class:`LoadedModel`, devices, dtypes, limits.

This module imports no model source, so :mod:`truncsens.models.synthetic` and the Hugging Face loader
(:mod:`truncsens.models.huggingface`) can both build a :class:`LoadedModel` without importing each other or
:mod:`truncsens.models`. The public import path stays :mod:`truncsens.models`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SOURCE_KINDS = ("reference", "synthetic", "gguf", "local", "hub", "memory")


IN_MEMORY = " (passed in memory)"  # ends the name of a model object handed to truncsens rather than loaded by it


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the problem and the fix."""


@dataclass
class LoadedModel:
    """A model ready for measurement.

    Attributes:
        model: a causal LM whose ``forward(input_ids [B, T], attention_mask [B, T],
            position_ids [B, T], logits_to_keep=int)`` returns an object with ``.logits``
            [B, T', V] (T' = logits_to_keep).
        tokenizer: turns text into token ids (``None`` for sources that work on token ids).
        name: the spec as given (recorded as the ``model`` attr); for a model object passed in memory,
            its ``config._name_or_path`` (or class name) and :data:`IN_MEMORY` (:func:`truncsens.models.in_memory_model`).
        revision: commit hash or "" (the ``model_revision`` attr).
        tokenizer_name: what the ``tokenizer`` attr records.
        max_context: the model's position limit in tokens (0: its config states none).
        device, dtype: where and in which precision it runs.
        source: the kind of model source that loaded it, one of :data:`SOURCE_KINDS`
            ("reference", "synthetic", "gguf", "local", "hub", "memory": a model object passed in); "hub" when built
            by hand.
        content_sha256: the weights' identity by content (the ``model_sha256`` attr,
            :mod:`truncsens.models.identity`): a local folder's files or an in-memory model's state;
            "" for hub models (their commit, ``revision``, identifies them) and synthetic sources; a GGUF
            file's own SHA-256.
        attrs: further results attrs the source records (a GGUF file: ``model_file``, ``model_quantization``).
    """

    model: Any
    tokenizer: Any
    name: str
    revision: str
    tokenizer_name: str
    max_context: int
    device: str
    dtype: str
    source: str = "hub"
    content_sha256: str = ""
    attrs: dict = field(default_factory=dict)


def resolve_dtype(dtype: str) -> torch.dtype:
    """torch dtype for a name of :data:`DTYPES`.

    Raises:
        ValueError: unknown name.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str) -> str:
    """Check that a device string is usable ("cpu", "cuda", "cuda:1", "mps", "auto").

    Raises:
        ValueError: the device is unknown or not available on this machine.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU here; use --device cpu")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} asked for, but MPS is not available; use --device cpu")
    return device


def max_context_of(config: Any) -> int:
    """The position limit of a HF config (``max_position_embeddings``, ``n_positions``, ...), or 0 when
    the config states none (ALiBi models such as BLOOM): a run of such a model then needs an explicit
    ``--reference-context`` (:func:`truncsens.engine.measure.resolve_reference_context` says so)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0
