"""Load a Hugging Face checkpoint (folder or hub id) as a :class:`~truncsens.models.loaded.LoadedModel`.

Version compatibility (see the README's "Tested versions"): the precision keyword of
``from_pretrained`` is ``dtype`` from transformers 4.56 on and ``torch_dtype`` before;
:func:`dtype_keyword` picks the one the installed version takes. The engine asks every forward pass
for ``logits_to_keep=1``; a model class whose ``forward`` does not take it (GPT-2 before
transformers 4.53, for instance) would silently compute logits at every position ([B, T, V]), so
:func:`check_logits_to_keep` refuses it with the fix. Tokenizers saved by transformers 5.x load
under 4.x through :func:`load_tokenizer`.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from safetensors import SafetensorError

from truncsens.models.identity import checkpoint_sha256
from truncsens.models.loaded import LoadedModel, ModelLoadError, max_context_of

DTYPE_KEYWORD_SINCE = (4, 56)  # transformers version that renamed from_pretrained(torch_dtype=) to dtype=


def dtype_keyword(version: str | None = None) -> str:
    """The ``from_pretrained`` keyword for the precision: "dtype" (transformers >= 4.56) or "torch_dtype".

    Args:
        version: a transformers version string; None = the installed one.
    """
    if version is None:
        import transformers

        version = transformers.__version__
    return "dtype" if Version(version).release[:2] >= DTYPE_KEYWORD_SINCE else "torch_dtype"  # 4.56.0.dev0 counts as 4.56


def check_logits_to_keep(model: Any, name: str) -> None:
    """Refuse a model whose ``forward`` takes no ``logits_to_keep`` argument.

    Raises:
        ModelLoadError: the installed transformers' class for this model would ignore it and
            compute [B, T, V] logits at every position; the message names the fix.
    """
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return
    import transformers

    raise ModelLoadError(
        f"model {name!r} ({type(model).__name__}) takes no logits_to_keep argument in transformers "
        f"{transformers.__version__}, so every forward pass would compute logits at all positions; "
        "upgrade transformers (pip install -U transformers) or use another model")


def load_hf_checkpoint(path: str, name: str, device: str, torch_dtype: torch.dtype, dtype: str,
                       revision: str | None, source: str, content_sha256: bool = True) -> LoadedModel:
    """Config, causal LM and tokenizer from a checkpoint folder or hub id, in eval mode on ``device``.

    Args:
        path: folder or hub id handed to ``from_pretrained``.
        name: the spec as given (``LoadedModel.name``); "reference" records tokenizer "reference".
        torch_dtype, dtype: the precision as a torch dtype and as its name.
        source: the kind recorded in ``LoadedModel.source``.
        content_sha256: hash a local folder's files (False: the caller identifies the model itself).

    Raises:
        ModelLoadError: unreadable config, unreachable hub, not a causal LM, damaged weights file, or
            no ``logits_to_keep``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one that matters

    try:
        config = AutoConfig.from_pretrained(path, revision=revision)
    except OSError as exc:
        raise ModelLoadError(explain_hub_error(name, exc)) from exc
    except ValueError as exc:
        raise ModelLoadError(f"cannot read the config of {name}: {exc}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, config=config, **{dtype_keyword(): torch_dtype})
        tokenizer = load_tokenizer(path, revision)
    except OSError as exc:
        raise ModelLoadError(explain_hub_error(name, exc)) from exc
    except ValueError as exc:
        raise ModelLoadError(f"{name} is not a causal language model that transformers can load: {exc}") from exc
    except SafetensorError as exc:  # a damaged or truncated weights file
        raise ModelLoadError(f"cannot read the weights of {name}: the .safetensors file is damaged ({exc}); "
                             "download or save the checkpoint again") from exc
    check_logits_to_keep(model, name)
    model.to(device).eval()
    commit = getattr(config, "_commit_hash", None) or ""
    local = Path(path).is_dir()
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, revision=commit,
        tokenizer_name=getattr(tokenizer, "name_or_path", name) if name != "reference" else "reference",
        max_context=max_context_of(config), device=device, dtype=dtype, source=source,
        content_sha256=checkpoint_sha256(path) if local and content_sha256 else "",
    )


def load_tokenizer(path: str, revision: str | None):
    """``AutoTokenizer.from_pretrained(path)``, also for tokenizers saved by transformers 5.x under 4.x.

    transformers 5.x records ``"tokenizer_class": "TokenizersBackend"`` (the bundled reference
    model does), a class 4.x does not know; the ``tokenizer.json`` beside it is the same format, so
    it is read with ``PreTrainedTokenizerFast`` instead.

    Raises:
        OSError, ValueError: as ``from_pretrained`` (no tokenizer, unknown class).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except ValueError as exc:
        if "TokenizersBackend" not in str(exc):
            raise
        return PreTrainedTokenizerFast.from_pretrained(path, revision=revision)


def hub_reachable(timeout: float = 3.0) -> bool:
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


def check_hub_or_cache(spec: str, revision: str | None) -> None:
    """Fail fast, with a clear message, when a hub id is neither cached nor reachable.

    Raises:
        ModelLoadError: no cached copy, and the hub is offline (``HF_HUB_OFFLINE``) or unreachable.
    """
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(spec, revision=revision, local_files_only=True)
        return  # a cached copy exists
    except (OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not hub_reachable():
        raise ModelLoadError(
            f"no local folder {spec!r}, and cannot reach the Hugging Face hub to fetch it (no network or HF_HUB_OFFLINE=1) "
            "with no cached copy; download it where the hub is reachable and pass the local folder with --model PATH")


def explain_hub_error(name: str, exc: Exception) -> str:
    """One line saying why ``from_pretrained`` failed for ``name`` and what to do."""
    text = str(exc)
    low = text.lower()
    if "offline" in low or "connect" in low or "resolve" in low or "network" in low or "timed out" in low or "couldn't" in low:
        return (f"cannot reach the Hugging Face hub to fetch {name!r} (no network or HF_HUB_OFFLINE=1), and no cached copy "
                "was found; download it where the hub is reachable and pass the local folder with --model PATH")
    if "not a valid model identifier" in low or "repository not found" in low or "404" in low or "does not appear" in low:
        return f"unknown model {name!r}: no such local folder and no such hub repository; check the spelling or pass a local path"
    return f"cannot load model {name!r}: {text.splitlines()[0] if text else type(exc).__name__}"
