"""Load a causal language model and its tokenizer.

``spec`` is one of:

- ``"reference"``: the small Llama bundled in ``truncsens/reference/weights``;
- ``"synthetic:ALPHA"`` (or ``"synthetic-geometric:RATE"``): the synthetic source of
  :mod:`truncsens.synthetic`, whose decay exponent is known;
- a local folder holding a Hugging Face checkpoint (``config.json`` + weights + tokenizer);
- a Hugging Face hub id such as ``Qwen/Qwen2.5-0.5B`` (needs the hub, or a cached copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REFERENCE_DIR = Path(__file__).parent / "reference" / "weights"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


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
        name: the spec as given (recorded as the ``model`` attr).
        revision: commit hash or "" (the ``model_revision`` attr).
        tokenizer_name: what the ``tokenizer`` attr records.
        max_context: the model's position limit in tokens.
        device, dtype: where and in which precision it runs.
    """

    model: Any
    tokenizer: Any
    name: str
    revision: str
    tokenizer_name: str
    max_context: int
    device: str
    dtype: str


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
    """The position limit of a HF config (``max_position_embeddings``, ``n_positions``, ...).

    Raises:
        ModelLoadError: the config states no limit.
    """
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelLoadError("the model config states no context limit; pass --reference-context explicitly")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec


def load_model(spec: str = "reference", device: str = "cpu", dtype: str = "float32", revision: str | None = None) -> LoadedModel:
    """Load a model and tokenizer by spec (see module docstring), in eval mode on ``device``.

    Raises:
        ModelLoadError: unknown id, missing path, unreachable hub, or a checkpoint that is not a
            causal LM; the message says what to do.
        ValueError: bad device or dtype name.
    """
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    if spec.startswith("synthetic"):
        from truncsens.synthetic import load_synthetic

        return load_synthetic(spec, device=device, dtype=dtype)
    if spec == "reference":
        if not (REFERENCE_DIR / "config.json").is_file():
            raise ModelLoadError(f"the reference model is missing from {REFERENCE_DIR}; reinstall truncsens or run `truncsens train-reference`")
        path, name = str(REFERENCE_DIR), "reference"
    else:
        local = Path(spec).expanduser()
        if local.exists():
            if not (local / "config.json").is_file():
                raise ModelLoadError(f"{spec} exists but holds no config.json: it is not a Hugging Face checkpoint folder")
            path = str(local)
        elif _looks_like_path(spec):
            raise ModelLoadError(f"model path {spec} does not exist; pass an existing checkpoint folder or a hub id like Qwen/Qwen2.5-0.5B")
        else:
            path = spec
            _check_hub_or_cache(spec, revision)
        name = spec
    return _load_hf(path, name, device, torch_dtype, dtype, revision)


def _load_hf(path: str, name: str, device: str, torch_dtype: torch.dtype, dtype: str, revision: str | None) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one that matters

    try:
        config = AutoConfig.from_pretrained(path, revision=revision)
    except OSError as exc:
        raise ModelLoadError(_explain_hub_error(name, exc)) from exc
    except ValueError as exc:
        raise ModelLoadError(f"cannot read the config of {name}: {exc}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=torch_dtype, config=config)
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    except OSError as exc:
        raise ModelLoadError(_explain_hub_error(name, exc)) from exc
    except ValueError as exc:
        raise ModelLoadError(f"{name} is not a causal language model that transformers can load: {exc}") from exc
    model.to(device).eval()
    commit = getattr(config, "_commit_hash", None) or ""
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, revision=commit,
        tokenizer_name=getattr(tokenizer, "name_or_path", name) if name != "reference" else "reference",
        max_context=max_context_of(config), device=device, dtype=dtype,
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the configured hub endpoint opens within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _check_hub_or_cache(spec: str, revision: str | None) -> None:
    """Fail fast, with a clear message, when a hub id is neither cached nor reachable."""
    import os

    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(spec, revision=revision, local_files_only=True)
        return  # a cached copy exists
    except (OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not _hub_reachable():
        raise ModelLoadError(
            f"no local folder {spec!r}, and cannot reach the Hugging Face hub to fetch it (no network or HF_HUB_OFFLINE=1) "
            "with no cached copy; download it where the hub is reachable and pass the local folder with --model PATH")


def _explain_hub_error(name: str, exc: Exception) -> str:
    text = str(exc)
    low = text.lower()
    if "offline" in low or "connect" in low or "resolve" in low or "network" in low or "timed out" in low or "couldn't" in low:
        return (f"cannot reach the Hugging Face hub to fetch {name!r} (no network or HF_HUB_OFFLINE=1), and no cached copy "
                "was found; download it where the hub is reachable and pass the local folder with --model PATH")
    if "not a valid model identifier" in low or "repository not found" in low or "404" in low or "does not appear" in low:
        return f"unknown model {name!r}: no such local folder and no such hub repository; check the spelling or pass a local path"
    return f"cannot load model {name!r}: {text.splitlines()[0] if text else type(exc).__name__}"
