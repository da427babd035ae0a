"""Where a model spec comes from: a small registry of model sources.

Each source says whether it ``matches`` a spec, ``load``\\ s it as a
:class:`~truncsens.models.loaded.LoadedModel`, and whether it ``has_own_corpus`` (samples its own token
documents, :meth:`ModelSource.documents`). :func:`model_source` tries them in the order of
:data:`SOURCES`:

- :class:`ReferenceSource` ("reference"): the small Llama bundled in ``truncsens/models/reference/weights``;
- :class:`SyntheticSource` ("synthetic"): ``synthetic:ALPHA[:L]`` or ``synthetic-geometric:RATE[:L]``,
  the process of :mod:`truncsens.models.synthetic` with a known decay law, and the only source with its own
  corpus;
- :class:`GgufSource` ("gguf"): a path ending in ``.gguf``, or the name of a known model whose GGUF
  file a package installs (``smollm2-135m``; :mod:`truncsens.models.gguf`);
- :class:`LocalFolderSource` ("local"): an existing path, or anything that looks like one
  (``./x``, ``/x``, ``~/x``, ``a/b/c``);
- :class:`HubSource` ("hub"): everything else, read as a Hugging Face hub id such as
  ``Qwen/Qwen2.5-0.5B`` (needs the hub, or a cached copy).

Callers ask ``model_source(spec).has_own_corpus`` instead of testing prefixes of the spec. A model
object already loaded with transformers (no spec) becomes a :class:`LoadedModel` through
:func:`in_memory_model`.
"""

from __future__ import annotations

from pathlib import Path

from truncsens.models.gguf import NAMED_GGUF, load_gguf, named_gguf_path
from truncsens.models.huggingface import check_hub_or_cache, check_logits_to_keep, check_tokenizer, load_hf_checkpoint
from truncsens.models.identity import state_sha256
from truncsens.models.loaded import (
    DTYPES, IN_MEMORY, LoadedModel, ModelLoadError, max_context_of, resolve_device, resolve_dtype,
)
from truncsens.models.synthetic import load_synthetic, synthetic_documents
from truncsens.targets import TokenDoc

REFERENCE_DIR = Path(__file__).parent / "reference" / "weights"


class ModelSource:
    """One kind of model spec. Subclasses set :attr:`kind` and implement :meth:`matches` and :meth:`_load`.

    Attributes:
        kind: "reference", "synthetic", "local" or "hub" (recorded in ``LoadedModel.source``).
        has_own_corpus: True when the source samples its own token documents (:meth:`documents`).
    """

    kind: str = ""
    has_own_corpus: bool = False

    def matches(self, spec: str) -> bool:
        """Whether ``spec`` names a model of this source."""
        raise NotImplementedError

    def load(self, spec: str, device: str = "cpu", dtype: str = "float32", revision: str | None = None) -> LoadedModel:
        """The model of ``spec`` in eval mode on ``device`` in precision ``dtype``.

        Raises:
            ValueError: bad device or dtype name (or a malformed synthetic spec).
            ModelLoadError: the model cannot be found or read; the message says what to do.
        """
        torch_dtype = resolve_dtype(dtype)
        return self._load(spec, resolve_device(device), dtype, torch_dtype, revision)

    def _load(self, spec, device, dtype, torch_dtype, revision) -> LoadedModel:
        raise NotImplementedError

    def documents(self, spec: str, n_docs: int, length: int, seed: int = 0) -> list[TokenDoc]:
        """``n_docs`` token documents of ``length`` tokens sampled by the source itself.

        Raises:
            ValueError: the source has no corpus of its own (``has_own_corpus`` is False).
        """
        raise ValueError(f"model {spec!r} ({self.kind} source) has no corpus of its own; pass a text corpus")


class ReferenceSource(ModelSource):
    """The bundled reference model (spec "reference")."""

    kind = "reference"

    def matches(self, spec: str) -> bool:
        return spec == "reference"

    def _load(self, spec, device, dtype, torch_dtype, revision) -> LoadedModel:
        if not (REFERENCE_DIR / "config.json").is_file():
            raise ModelLoadError(f"the reference model is missing from {REFERENCE_DIR}; reinstall truncsens or run `truncsens train-reference`")
        return load_hf_checkpoint(str(REFERENCE_DIR), "reference", device, torch_dtype, dtype, revision, self.kind)


class SyntheticSource(ModelSource):
    """The synthetic process of :mod:`truncsens.models.synthetic` (``synthetic:ALPHA``, ``synthetic-geometric:RATE``).

    Matches a spec whose first ``:``-field starts with "synthetic" and that holds no "/" (so a hub
    id such as ``synthetic-org/model`` is not taken for it); malformed ones then fail in
    :func:`truncsens.models.synthetic.parse_spec` with the accepted forms.
    """

    kind = "synthetic"
    has_own_corpus = True

    def matches(self, spec: str) -> bool:
        return spec.split(":")[0].startswith("synthetic") and "/" not in spec and "\\" not in spec

    def _load(self, spec, device, dtype, torch_dtype, revision) -> LoadedModel:
        return load_synthetic(spec, device=device, dtype=dtype)

    def documents(self, spec: str, n_docs: int, length: int, seed: int = 0) -> list[TokenDoc]:
        """Sequences sampled from the process of ``spec`` (:func:`truncsens.models.synthetic.synthetic_documents`).

        Returns:
            ``n_docs`` :class:`~truncsens.targets.TokenDoc`, ids ``"synthetic-{i:05d}"``, each [length] int64.

        Raises:
            ValueError: bad spec, ``n_docs < 1`` or ``length < 1``.
        """
        return [TokenDoc(doc_id, ids) for doc_id, ids in synthetic_documents(spec, n_docs, length, seed)]


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` is written as a path (``./x``, ``/x``, ``~/x``, ``a/b/c``, backslashes), not a hub id."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec


class GgufSource(ModelSource):
    """One GGUF file (a spec ending in ``.gguf``, any case) or a model of
    :data:`~truncsens.models.gguf.NAMED_GGUF` by name (``smollm2-135m``), loaded through transformers'
    GGUF support and kept converted in the user's cache (:func:`truncsens.models.gguf.load_gguf`)."""

    kind = "gguf"

    def matches(self, spec: str) -> bool:
        return spec.lower().endswith(".gguf") or spec in NAMED_GGUF

    def _load(self, spec, device, dtype, torch_dtype, revision) -> LoadedModel:
        path = named_gguf_path(spec) if spec in NAMED_GGUF else Path(spec).expanduser()
        return load_gguf(path, spec, device, torch_dtype, dtype, revision)


class LocalFolderSource(ModelSource):
    """A Hugging Face checkpoint folder (``config.json`` + weights + tokenizer) on this machine."""

    kind = "local"

    def matches(self, spec: str) -> bool:
        return Path(spec).expanduser().exists() or looks_like_path(spec)

    def _load(self, spec, device, dtype, torch_dtype, revision) -> LoadedModel:
        local = Path(spec).expanduser()
        if not local.exists():
            raise ModelLoadError(f"model path {spec} does not exist; pass an existing checkpoint folder or a hub id like Qwen/Qwen2.5-0.5B")
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"{spec} exists but holds no config.json: it is not a Hugging Face checkpoint folder")
        return load_hf_checkpoint(str(local), spec, device, torch_dtype, dtype, revision, self.kind)


class HubSource(ModelSource):
    """A Hugging Face hub id (the fallback: matches every spec)."""

    kind = "hub"

    def matches(self, spec: str) -> bool:
        return True

    def _load(self, spec, device, dtype, torch_dtype, revision) -> LoadedModel:
        check_hub_or_cache(spec, revision)
        return load_hf_checkpoint(spec, spec, device, torch_dtype, dtype, revision, self.kind)


SOURCES: tuple[ModelSource, ...] = (ReferenceSource(), SyntheticSource(), GgufSource(), LocalFolderSource(), HubSource())


def model_source(spec: str) -> ModelSource:
    """The first source of :data:`SOURCES` that matches ``spec`` (the hub source when none other does)."""
    return next(source for source in SOURCES if source.matches(spec))


def check_materialized(model, name: str) -> None:
    """Refuse a model whose parameters or buffers are on the ``meta`` device: they have shapes but no
    values, so the model can neither be hashed (:func:`~truncsens.models.identity.state_sha256`) nor run.

    Raises:
        ModelLoadError: naming how many tensors are on ``meta`` and the first of them.
    """
    state = model.state_dict(keep_vars=True)
    on_meta = [n for n, t in state.items() if getattr(t, "is_meta", False)]
    if on_meta:
        total = len(state)
        raise ModelLoadError(
            f"model {name!r} has {len(on_meta)} of its {total} weight tensors on the 'meta' device (first: {on_meta[0]}), "
            "which holds shapes but no values: it was built without weights (init_empty_weights, "
            "torch.device('meta')) or offloaded by a device_map; load it with its weights "
            "(AutoModelForCausalLM.from_pretrained(path) without a meta or offloading device_map) or pass the "
            "checkpoint folder as the model spec")


def in_memory_model(model, tokenizer, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """A :class:`LoadedModel` of a causal LM object already loaded (``AutoModelForCausalLM.from_pretrained``)
    and its tokenizer, measured where it is and in the precision it has: it is put in eval mode
    (dropout off) but neither moved nor cast (the API functions give the caller's mode back on the way
    out: :func:`~truncsens.models.caller_state.caller_state`).

    Recorded as ``model`` = ``config._name_or_path`` (the class name when empty) followed by
    :data:`~truncsens.models.loaded.IN_MEMORY`, ``model_revision`` = ``config._commit_hash`` or "",
    ``tokenizer`` = the tokenizer's ``name_or_path`` (its class name when empty); source "memory".

    Args:
        model: a transformers causal LM (``forward`` takes ``logits_to_keep``), or a :class:`LoadedModel`
            (returned as it is).
        tokenizer: its tokenizer (required: texts are tokenized with it).
        device: None or "auto" (where the model is), or a device the model is already on.
        dtype: None (the model's), or the name of the dtype the model already has (:data:`DTYPES`).

    Raises:
        ValueError: no tokenizer; a device or dtype other than the model's (the message says how to move it).
        ModelLoadError: an object without a transformers ``config``, with weights on the ``meta``
            device (:func:`check_materialized`), a ``forward`` without ``logits_to_keep``, or a
            tokenizer without a vocabulary for the model (:func:`~truncsens.models.huggingface.check_tokenizer`).
    """
    import torch

    if isinstance(model, LoadedModel):
        return model
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "forward", None)):
        raise ModelLoadError(f"a {type(model).__name__} is not a transformers causal LM (it has no config); pass a model "
                             "from AutoModelForCausalLM.from_pretrained, or a model spec such as 'reference' or a folder")
    if tokenizer is None:
        raise ValueError(f"a model object ({type(model).__name__}) needs its tokenizer: truncsens.measure(model, tokenizer, ...)")
    name = (getattr(config, "_name_or_path", "") or type(model).__name__) + IN_MEMORY
    check_materialized(model, name)
    check_logits_to_keep(model, name)
    check_tokenizer(model, tokenizer, name)
    first = next(iter(model.parameters()), None)
    where = first.device if first is not None else torch.device("cpu")
    if device not in (None, "auto"):
        asked = torch.device(device)
        if asked.type != where.type or (asked.index is not None and asked.index != (where.index or 0)):
            raise ValueError(f"the model is on {where}, not {device}: move it first (model.to({device!r})) or leave device unset")
    held = first.dtype if first is not None else torch.float32
    held_name = next((n for n, t in DTYPES.items() if t == held), str(held).removeprefix("torch."))
    if dtype is not None and dtype != held_name:
        raise ValueError(f"the model holds {held_name} weights, not {dtype}: cast it first (model.to(torch.{dtype})) or "
                         "leave dtype unset")
    tokenizer_name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, revision=getattr(config, "_commit_hash", None) or "",
                       tokenizer_name=tokenizer_name, max_context=max_context_of(config), device=str(where),
                       dtype=held_name, source="memory", content_sha256=state_sha256(model))
