"""Load a Hugging Face checkpoint (folder or hub id) as a :class:`~truncsens.models.loaded.LoadedModel`.

Version compatibility (see the README's "Tested versions"): the precision keyword of
``from_pretrained`` is ``dtype`` from transformers 4.56 on and ``torch_dtype`` before;
:func:`dtype_keyword` picks the one the installed version takes. The engine asks every forward pass
for ``logits_to_keep=1``; a model class whose ``forward`` does not take it (GPT-2 before
transformers 4.53, for instance) would silently compute logits at every position ([B, T, V]), so
:func:`check_logits_to_keep` refuses it with the fix. Tokenizers saved by transformers 5.x load
under 4.x through :func:`load_tokenizer`. A checkpoint folder without tokenizer files loads, under
transformers 5.x, a tokenizer that holds only its special tokens, which turns every text into no
tokens at all; :func:`check_tokenizer` refuses it (and a tokenizer whose ordinary ids pass the
model's embedding) when the model is loaded, naming what is missing.
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

# the files a tokenizer is read from (Hugging Face tokenizers, byte-level BPE, WordPiece, SentencePiece)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")
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
        ModelLoadError: unreadable config, unreachable hub, not a causal LM, damaged weights file, no
            ``logits_to_keep``, or a tokenizer without a vocabulary for the model (:func:`check_tokenizer`).
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
        tokenizer = load_folder_tokenizer(path, revision, name)
    except OSError as exc:
        raise ModelLoadError(explain_hub_error(name, exc)) from exc
    except ValueError as exc:
        raise ModelLoadError(f"{name} is not a causal language model that transformers can load: {exc}") from exc
    except SafetensorError as exc:  # a damaged or truncated weights file
        raise ModelLoadError(f"cannot read the weights of {name}: the .safetensors file is damaged ({exc}); "
                             "download or save the checkpoint again") from exc
    check_logits_to_keep(model, name)
    check_tokenizer(model, tokenizer, name, path if Path(path).is_dir() else None)
    model.to(device).eval()
    commit = getattr(config, "_commit_hash", None) or ""
    local = Path(path).is_dir()
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, revision=commit,
        tokenizer_name=getattr(tokenizer, "name_or_path", name) if name != "reference" else "reference",
        max_context=max_context_of(config), device=device, dtype=dtype, source=source,
        content_sha256=checkpoint_sha256(path) if local and content_sha256 else "",
    )


def check_tokenizer(model: Any, tokenizer: Any, name: str, folder: str | None = None) -> None:
    """Refuse a tokenizer that cannot feed ``model``: one whose vocabulary holds no ordinary token
    (only special or added tokens: what transformers 5.x builds for a folder without tokenizer files,
    which turns every text into 0 tokens), or whose ordinary token ids reach past the model's input
    embedding (the tokenizer of another model). A tokenizer without ``get_vocab`` or a model without
    ``get_input_embeddings`` is not checked.

    Args:
        folder: the checkpoint folder the tokenizer was read from (the message lists its tokenizer
            files), or None (a hub id, or a tokenizer object passed in).

    Raises:
        ModelLoadError: naming the tokenizer's tokens, the model's embedding rows and what is missing.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        return
    vocab = get_vocab()  # token -> id
    get_added = getattr(tokenizer, "get_added_vocab", None)
    special = set(getattr(tokenizer, "all_special_tokens", None) or ()) | set(get_added() if callable(get_added) else ())
    ordinary = [i for token, i in vocab.items() if token not in special]
    try:
        rows = int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        rows = None
    embeds = f"the model embeds {rows} tokens" if rows is not None else "the model has a vocabulary"
    if not ordinary:
        shown = ", ".join(sorted(vocab)[:4]) or "none"
        if folder is not None:
            present = [f for f in TOKENIZER_FILES if (Path(folder) / f).is_file()]
            missing = (NO_TOKENIZER_FILES if not present else
                       f"the folder's tokenizer files ({', '.join(present)}) hold no vocabulary")
            fix = SAVE_TOKENIZER
        else:
            missing, fix = "the tokenizer holds no vocabulary", "pass the tokenizer the model was trained with"
        raise ModelLoadError(f"the tokenizer of model {name!r} has no tokens besides its {len(vocab)} special one"
                             f"{'' if len(vocab) == 1 else 's'} ({shown}) and would turn every text into 0 tokens, "
                             f"while {embeds}: {missing}; {fix}")
    if rows is not None and max(ordinary) >= rows:
        raise ModelLoadError(f"the tokenizer of model {name!r} has token ids up to {max(ordinary)}, past the {rows} rows of the "
                             "model's input embedding: it is not this model's tokenizer; use the one saved with the model")


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


NO_TOKENIZER_FILES = ("the folder has none of the files a tokenizer's vocabulary is read from (tokenizer.json, "
                      "vocab.json + merges.txt, vocab.txt, tokenizer.model)")
SAVE_TOKENIZER = "save the model's tokenizer beside the weights (tokenizer.save_pretrained(folder))"


def load_folder_tokenizer(path: str, revision: str | None, name: str):
    """:func:`load_tokenizer`, saying what is missing when a checkpoint folder has no tokenizer files
    and transformers cannot build one there (4.x raises, for a GPT-2 folder, an ImportError about
    protobuf; 5.x builds an empty tokenizer, which :func:`check_tokenizer` refuses).

    Raises:
        ModelLoadError: a local folder without tokenizer files whose tokenizer cannot be loaded.
        OSError, ValueError: as :func:`load_tokenizer` otherwise.
    """
    try:
        return load_tokenizer(path, revision)
    except (OSError, ValueError, ImportError, TypeError) as exc:
        folder = Path(path)
        if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise ModelLoadError(f"cannot load a tokenizer for model {name!r}: {NO_TOKENIZER_FILES}; {SAVE_TOKENIZER}") from exc
        if isinstance(exc, (OSError, ValueError)):
            raise
        raise ModelLoadError(f"cannot load the tokenizer of model {name!r}: {exc}") from exc


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
