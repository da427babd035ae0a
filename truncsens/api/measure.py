"""``truncsens.measure``: the truncation sensitivity of a model on documents, as an xarray Dataset.

The model is a spec (``"reference"``, ``"synthetic:0.5"``, a Hugging Face id, a local checkpoint
folder) or a causal LM object already loaded with transformers, with its tokenizer
(:func:`truncsens.models.in_memory_model`). The documents are a corpus (``corpus=`` / ``domain=``, as
``--corpus`` / ``--domain``) or Python strings (``texts=[...]``, :func:`truncsens.corpora.texts_corpus`).
Keyword names are those of ``truncsens measure``'s options in snake_case; two take Python values
rather than text: ``policies`` (``--policy``: names, or one comma-separated string) and
``policy_args`` (``--policy-arg key=value``: a dict).

The run is the engine's one driver (:func:`truncsens.engine.measure.run_measure`), which writes a
results file: with ``out=`` that file is kept (exactly what the command writes); without, the run
goes to a temporary folder and the Dataset loaded back from it is returned, so the in-memory
Dataset equals the file's. ``truncsens measure`` calls :func:`measure_config` and
:func:`run_measurement` (its default output path is :class:`~truncsens.engine.config.MeasureConfig`'s).
"""

from __future__ import annotations

import inspect
import numbers
import tempfile
from pathlib import Path
from typing import Any, Sequence

import xarray as xr

from truncsens import DEFAULT_DEVICE, results
from truncsens.corpora import texts_corpus
from truncsens.engine.config import MeasureConfig
from truncsens.engine.measure import MeasureSummary, run_measure
from truncsens.engine.options import MeasureOptions, config_fields
from truncsens.models import LoadedModel, in_memory_model
from truncsens.models.caller_state import keeps_caller_state


def _names(values: str | Sequence[str] | None) -> list[str] | None:
    """Policy names from a list, or from one comma-separated string ("sink_recent,h2o")."""
    if values is None:
        return None
    if isinstance(values, str):
        return [v.strip() for v in values.split(",") if v.strip()]
    return list(values)


def _ints(values: int | Sequence[int] | None) -> list[int] | None:
    """Windows or budgets as a list of ints (one int: a list of one)."""
    if values is None:
        return None
    return [int(values)] if isinstance(values, numbers.Integral) else [int(v) for v in values]


def measure_config(model: str = "reference", *, texts: Sequence[str] | None = None, corpus: str | None = None,
                   domain: str = "code", split: str = "auto", text_field: str = "text",
                   reference_context: int | None = None, windows: Sequence[int] | None = None,
                   sinks: int | None = None, bos: str = "auto", positions: str = "original", targets_per_doc: int = 8,
                   max_docs: int | None = None, seed: int = 0, device: str = DEFAULT_DEVICE, dtype: str = "float32",
                   batch_tokens: int | None = None, docs_per_shard: int = 8, out: str | Path | None = None,
                   resume: bool = False, overwrite: bool = False, progress: bool = True,
                   policies: str | Sequence[str] | None = None, budgets: Sequence[int] | None = None,
                   semantics: str | None = None, score: str = "attention", per_query: bool = False,
                   policy_args: dict | None = None, observation_window: int | None = None,
                   pooling_kernel: int | None = None, summary_slots: int | None = None, chunk: int = 1, protocol: str = "exact",
                   block_fraction: float = 0.125, block_size: int = 64, granularity: str = "token", draws: int = 1,
                   policy_seed: int | None = None, per_layer: bool = False, command: str = "") -> MeasureConfig:
    """The validated configuration of one run (:class:`~truncsens.engine.config.MeasureConfig`, whose
    docstring says what every option means), from ``truncsens measure``'s options in snake_case.

    ``out=None`` is the library's default path, ``results/<model>-<corpus or domain>[-policies].nc``
    (``<model>-texts`` for ``texts``). ``texts`` replaces ``corpus``: the documents in the order given.

    Raises:
        ValueError: both ``texts`` and ``corpus``.
        truncsens.corpora.CorpusError: ``texts`` empty or not strings.
        truncsens.engine.config.MeasureError, truncsens.policies.PolicyError,
            truncsens.engine.semantics.SemanticsError: as :class:`~truncsens.engine.config.MeasureConfig`.
    """
    options = {k: v for k, v in locals().items() if k != "texts"}  # the run options, by API keyword
    if texts is not None and corpus is not None:
        raise ValueError("give texts or corpus, not both")
    options.update(corpus=texts_corpus(texts) if texts is not None else corpus, windows=_ints(windows),
                   policies=_names(policies), budgets=_ints(budgets), out=None if out is None else str(out))
    return MeasureConfig(**config_fields(MeasureOptions, options))


def run_measurement(cfg: MeasureConfig, loaded: LoadedModel | None = None) -> MeasureSummary:
    """Run ``cfg`` and write its results file ``cfg.out`` (:func:`truncsens.engine.measure.run_measure`).

    Args:
        cfg: from :func:`measure_config`.
        loaded: the model already loaded (None: ``cfg.model`` is loaded).

    Returns:
        what the run did (``n_targets`` is -1 on ranks other than 0 of a multi-process run).

    Raises:
        as :func:`truncsens.engine.measure.run_measure`.
    """
    return run_measure(cfg, loaded)


@keeps_caller_state
def measure(model: Any = "reference", tokenizer: Any = None, *, texts: Sequence[str] | None = None,
            corpus: str | None = None, domain: str = "code", split: str = "auto", text_field: str = "text",
            reference_context: int | None = None, windows: Sequence[int] | None = None, sinks: int | None = None,
            bos: str = "auto", positions: str = "original", targets_per_doc: int = 8, max_docs: int | None = None,
            seed: int = 0, device: str = DEFAULT_DEVICE, dtype: str | None = None, batch_tokens: int | None = None,
            docs_per_shard: int = 8, out: str | Path | None = None, resume: bool = False, overwrite: bool = False,
            progress: bool = True, policies: str | Sequence[str] | None = None, budgets: Sequence[int] | None = None,
            semantics: str | None = None, score: str = "attention", per_query: bool = False,
            policy_args: dict | None = None, observation_window: int | None = None, pooling_kernel: int | None = None,
            summary_slots: int | None = None, chunk: int = 1, protocol: str = "exact", block_fraction: float = 0.125,
            block_size: int = 64, granularity: str = "token", draws: int = 1, policy_seed: int | None = None,
            per_layer: bool = False, command: str | None = None) -> xr.Dataset | None:
    """Measure D(w) (a window sweep), D_l(w) (``per_layer=True``: each layer alone windowed) or D(k)
    (``policies=``: a budget sweep) and return the results.

    Args:
        model: a spec ("reference", "synthetic:ALPHA", a hub id, a checkpoint folder, a ``.gguf`` file,
            "smollm2-135m"), or a transformers causal LM object (then ``tokenizer`` is required; it runs
            where it is, in its own dtype, in eval mode; the ``model`` attr is its ``config._name_or_path`` or
            class name + " (passed in memory)"). The object is given back as it came, errors included: its
            modules' train / eval mode, its attention implementation and its hooks
            (:func:`~truncsens.models.caller_state.caller_state`).
        tokenizer: the tokenizer of a model object (a spec loads its own).
        texts: documents as strings (ids ``text-00000``, ...; attrs ``corpus`` and ``domain`` "texts"),
            instead of ``corpus`` / ``domain``.
        device: "auto": CUDA when present for a spec, where the model is for a model object.
        dtype: None: float32 for a spec, the model's own for a model object.
        out: keep the results file here (what ``truncsens measure --out`` writes); None: nothing is
            written (the run uses a temporary folder).
        command: the ``command`` attr (None: this call, e.g. ``truncsens.measure('reference', texts=<3 texts>)``).
        the others: ``truncsens measure``'s options (``truncsens measure --help``, :func:`measure_config`).

    Returns:
        the results Dataset (dims target x window, layer x target x window, or [policy x] target x budget; schema
        :mod:`truncsens.results.schema`); None on ranks other than 0 of a multi-process run.

    Raises:
        ValueError: a tokenizer with a spec, a model object without one, a device or dtype other than
            a model object's, ``resume`` without ``out``, both ``texts`` and ``corpus``.
        truncsens.models.ModelLoadError: a model object with weights on the ``meta`` device (no values).
        as :func:`measure_config` and :func:`truncsens.engine.measure.run_measure`.
    """
    options = {k: v for k, v in locals().items() if k not in ("model", "tokenizer", "command")}  # measure_config's keywords
    if command is None:
        command = python_call("truncsens.measure", measure, model, tokenizer, options)
    model, options["device"], options["dtype"], loaded = model_argument(model, tokenizer, device, dtype)
    if out is not None:
        summary = run_measurement(measure_config(model, command=command, **options), loaded)
        return results.load(summary.path) if summary.n_targets >= 0 else None
    if resume:
        raise ValueError("resume continues an interrupted results file: give out=PATH")
    with tempfile.TemporaryDirectory(prefix="truncsens-measure-") as folder:
        options["out"] = Path(folder) / "results.nc"
        summary = run_measurement(measure_config(model, command=command, **options), loaded)
        return results.load(summary.path) if summary.n_targets >= 0 else None


def model_argument(model: Any, tokenizer: Any, device: str | None, dtype: str | None
                   ) -> tuple[str, str | None, str, LoadedModel | None]:
    """An API function's ``model`` argument as ``(model, device, dtype, loaded)``: a spec (a string, or a
    checkpoint folder as a Path) stays a string with ``device`` as given and ``dtype`` defaulting to
    float32, and ``loaded`` None (the driver loads it); a transformers model object with its
    ``tokenizer`` becomes a :class:`~truncsens.models.LoadedModel`, named, placed and typed as it is.

    Raises:
        ValueError: a tokenizer with a spec; as :func:`truncsens.models.in_memory_model` for an object.
    """
    if isinstance(model, (str, Path)):
        if tokenizer is not None:
            raise ValueError(f"tokenizer is for a model object; the model spec {str(model)!r} loads its own")
        return str(model), device, dtype or "float32", None
    loaded = in_memory_model(model, tokenizer, device, dtype)
    return loaded.name, loaded.device, loaded.dtype, loaded


def python_call(name: str, function, model: Any, tokenizer: Any, options: dict) -> str:
    """The ``command`` attr of an API run: ``name(model[, tokenizer], key=value, ...)`` with the
    options that differ from ``function``'s defaults; a model object and tokenizer by class name,
    texts by their number (``texts=<3 texts>``)."""
    defaults = {k: p.default for k, p in inspect.signature(function).parameters.items()}
    parts = [repr(str(model)) if isinstance(model, (str, Path)) else type(model).__name__]
    if tokenizer is not None:
        parts.append(type(tokenizer).__name__)
    for key, value in options.items():
        if key in defaults and _same(value, defaults[key]):
            continue
        shown = (f"<{len(value)} text{'' if len(value) == 1 else 's'}>" if key == "texts"
                 else repr(str(value) if isinstance(value, Path) else value))
        parts.append(f"{key}={shown}")
    return f"{name}({', '.join(parts)})"


def _same(value: Any, default: Any) -> bool:
    """Whether an option is at its default (an array compared elementwise is not)."""
    try:
        return bool(value == default)
    except (TypeError, ValueError):
        return False
