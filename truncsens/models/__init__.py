"""Load a causal language model and its tokenizer.

``spec`` is one of (the sources of :mod:`truncsens.models.sources`, tried in this order):

- ``"reference"``: the small Llama bundled in ``truncsens/models/reference/weights``;
- ``"synthetic:ALPHA"`` (or ``"synthetic-geometric:RATE"``): the synthetic source of
  :mod:`truncsens.models.synthetic`, whose decay exponent is known and which samples its own corpus;
- a GGUF file (``model.gguf``) or a model known by name whose GGUF file a package installs
  (``smollm2-135m``), through transformers' GGUF support (:mod:`truncsens.models.gguf`);
- a local folder holding a Hugging Face checkpoint (``config.json`` + weights + tokenizer);
- a Hugging Face hub id such as ``Qwen/Qwen2.5-0.5B`` (needs the hub, or a cached copy).

``model_source(spec)`` says which source a spec belongs to (``.kind``, ``.has_own_corpus``,
``.documents(...)``); ``load_model(spec)`` loads it. A model object already loaded with transformers
and its tokenizer become a :class:`LoadedModel` with ``in_memory_model(model, tokenizer)``.

May import: corpora and the math modules; never the engine, results or anything above.
"""

from __future__ import annotations

from truncsens.models.huggingface import explain_hub_error as _explain_hub_error
from truncsens.models.loaded import (
    DTYPES, IN_MEMORY, SOURCE_KINDS, LoadedModel, ModelLoadError, max_context_of, resolve_device, resolve_dtype,
)
from truncsens.models.sources import (
    REFERENCE_DIR, SOURCES, GgufSource, HubSource, LocalFolderSource, ModelSource, ReferenceSource, SyntheticSource,
    in_memory_model, model_source,
)

__all__ = [
    "DTYPES", "IN_MEMORY", "REFERENCE_DIR", "SOURCES", "SOURCE_KINDS", "GgufSource", "HubSource", "LoadedModel",
    "LocalFolderSource",
    "ModelLoadError", "ModelSource", "ReferenceSource", "SyntheticSource", "in_memory_model", "load_model",
    "max_context_of", "model_source", "resolve_device", "resolve_dtype", "_explain_hub_error",
]


def load_model(spec: str = "reference", device: str = "cpu", dtype: str = "float32", revision: str | None = None) -> LoadedModel:
    """Load a model and tokenizer by spec (see module docstring), in eval mode on ``device``.

    Returns:
        a :class:`LoadedModel` whose ``source`` is the kind of the matching source.

    Raises:
        ModelLoadError: unknown id, missing path, unreachable hub, or a checkpoint that is not a
            causal LM; the message says what to do.
        ValueError: bad device or dtype name, or a malformed synthetic spec.
    """
    return model_source(spec).load(spec, device=device, dtype=dtype, revision=revision)
