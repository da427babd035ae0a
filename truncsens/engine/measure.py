"""``truncsens measure``, the one run driver: corpus -> documents -> targets -> semantics x policy
passes -> metrics -> shard files -> results file.

A window sweep and a policy sweep are the same run (:mod:`truncsens.engine.sweep`): the driver
resolves the sweep, hands every shard of targets to the kernel (:mod:`truncsens.engine.kernel`), or
to the block protocol (:mod:`truncsens.engine.block.runs`), and writes what it returns with
:mod:`truncsens.results`; the lock, shards, resume and merge are the run skeleton's
(:func:`truncsens.engine.run.skeleton.run_sharded`).

Results: dims (target, window) for a window sweep, (layer, target, window) for a per-layer window
sweep (``--per-layer``: :mod:`truncsens.engine.per_layer_runs`); (target, budget), or (policy, target, budget)
when several policies run, for a policy sweep, whose attrs add ``policy`` (names in order),
``policy_params`` (JSON), ``budget_counts``, ``score_source`` (where scores came from) and, for
streaming, ``chunk`` (tokens between eviction decisions), ``granularity`` (``token``: one kept set per
target; ``head``: one per key/value head), ``policy_seed`` (seed of the policies'
draws), ``draws`` (R) and ``draw_seeds`` (how the draws are seeded); with R > 1 every data var gains
a ``draw`` dim after ``policy`` (deterministic policies: the same values in every draw). Its data
vars add ``kept_tokens`` (int32, keys the target's query kept, under head granularity the mean per
key/value head rounded to a token; random for ``poisson``) and, for streaming and prefill-evict,
``evicted_attention_mass`` (float32: the attention probability mass the full-context target query
puts on the keys its policy evicted, mean over layers and heads).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import truncsens
from truncsens.engine.attention_windows import WindowError, layer_windows
from truncsens.engine.block.plan import larger_blocks_note
from truncsens.engine.block.runs import block_work
from truncsens.engine.bos import resolve_bos, select_starting_with, with_bos_sinks
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.run.distributed import current_ranks, process_device
from truncsens.engine.run.progress import say
from truncsens.corpora.local import skipped_files_note
from truncsens.engine.documents import RunDocuments, check_documents_before_loading, prepare_documents
from truncsens.engine.kernel import draws_measured, measure_draws
from truncsens.engine.options import recorded_attrs
from truncsens.engine.per_layer_runs import per_layer_attrs, per_layer_work
from truncsens.engine.run.shard_results import shard_results
from truncsens.engine.run.shards import check_output
from truncsens.engine.run.skeleton import ShardedRun, ShardWork, run_sharded
from truncsens.engine.sweep import Sweep, check_sweep_before_loading, resolve_sweep
from truncsens.models import LoadedModel, load_model
from truncsens.policies import policy_params
from truncsens.targets import TargetSet


@dataclass
class MeasureSummary:
    """What a finished run did (``n_targets`` is -1 on ranks other than 0 of a multi-process run).

    ``sweep`` holds the windows or budgets; ``extra`` the policies and semantics of a policy sweep.
    """

    path: Path
    n_targets: int
    n_docs: int
    n_docs_checked: int
    n_docs_skipped: int
    sweep_dim: str
    sweep: list[int]
    reference_context: int
    shards_reused: int = 0
    extra: dict = field(default_factory=dict)


def check_before_loading(cfg: MeasureConfig) -> None:
    """Everything the options say wrong without a model, said before one loads: the corpus or domain
    (:func:`truncsens.engine.documents.check_documents_before_loading`), the windows and budgets
    (:func:`truncsens.engine.sweep.check_sweep_before_loading`).

    Raises:
        MeasureError, PolicyError, truncsens.corpora.CorpusError: as the run would, later.
    """
    check_documents_before_loading(cfg)
    check_sweep_before_loading(cfg)


def resolve_reference_context(cfg: MeasureConfig, loaded: LoadedModel) -> int:
    """N: ``cfg.reference_context`` or the model's maximum context.

    Raises:
        MeasureError: N beyond the model's position limit, or below 2.
    """
    if not cfg.reference_context and not loaded.max_context:
        raise MeasureError(f"the config of {loaded.name} states no context limit, so N cannot default to it; "
                           "pass reference_context=N (--reference-context N)")
    N = cfg.reference_context or loaded.max_context
    if loaded.max_context and N > loaded.max_context:
        raise MeasureError(
            f"reference context {N} is beyond the model's position limit of {loaded.max_context} tokens; "
            f"use reference_context={loaded.max_context} or less (--reference-context {loaded.max_context})")
    if N < 2:
        raise MeasureError(f"reference_context (--reference-context) must be at least 2 tokens, got {N}")
    return N


def vocabulary(loaded: LoadedModel) -> dict:
    """Which ids the divergences are taken over: every output logit of the model. A model whose
    vocabulary is padded beyond its tokenizer's ids keeps the padded rows (the model assigns them
    probability, so dropping them would change the distributions compared)."""
    config = getattr(loaded.model, "config", None)
    size = getattr(config, "vocab_size", None)
    tokenizer = len(loaded.tokenizer) if loaded.tokenizer is not None else None
    return {"model_output_ids": size, "tokenizer_ids": tokenizer, "divergences_over": "all model output ids"}


def _has_sliding_layers(model) -> bool:
    """Whether any layer of ``model`` has a sliding attention window (a config the engine cannot read: no)."""
    try:
        return layer_windows(model).windowed
    except WindowError:
        return False


def model_config(model) -> dict | None:
    """The full transformers config of ``model`` as a JSON-safe dict (``to_json_string(use_diff=False)``),
    or None for a model without one: the ``model_config`` attr of a model passed in memory."""
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    if to_json is None:
        return None
    try:
        return json.loads(to_json(use_diff=False))
    except (TypeError, ValueError):
        return None


def provenance(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int, docs: RunDocuments, sweep: Sweep) -> dict:
    """The results attrs (``created`` is filled in at merge time; see docs/results.md)."""
    attrs = {
        "truncsens_version": truncsens.__version__, "model": loaded.name, "model_revision": loaded.revision,
        "model_sha256": loaded.content_sha256,
        "tokenizer": loaded.tokenizer_name, "dtype": loaded.dtype, "device": loaded.device,
        "semantics": sweep.semantics.name, "positions": cfg.positions, "n_sink": cfg.n_sink,
        "reference_context": reference_context, "corpus": docs.corpus, "corpus_sha256": docs.sha256,
        "domain": docs.domain, "seed": cfg.seed, "created": "", "command": cfg.command, "split": cfg.split,
        "targets_per_doc": cfg.targets_per_doc or 0, "max_context": loaded.max_context,
        "n_docs_checked": len(docs.checked), "n_docs_skipped_short": docs.n_short,
        "files_skipped": docs.skipped, "tokenizer_adds": docs.tokenizer_adds, "vocabulary": vocabulary(loaded),
        "bos_rule": "one BOS at the start of each document when the tokenizer adds one by default, none elsewhere; "
                    "literal special-token text encoded as text (docs/method.md)",
    }
    attrs.update(loaded.attrs)  # what the model's source records of it (a GGUF file: model_file, model_quantization)
    attrs.update(recorded_attrs(cfg))  # the options declared with attr=True (truncsens.engine.options)
    distance = sweep.semantics.window_distances.get(cfg.positions) if _has_sliding_layers(loaded.model) else None
    if distance is not None:  # how each sliding-window layer's window was applied (docs/method.md)
        attrs["sliding_window_distance"] = distance
    if loaded.source == "memory":  # a model object: its config is on no disk, so the file keeps it (KV sizes)
        config = model_config(loaded.model)
        if config is not None:
            attrs["model_config"] = config
    if not sweep.is_window_sweep:
        attrs.update({
            "n_sink": cfg.n_sink if any(hasattr(p, "n_sink") for p in sweep.policies) else 0,
            "policy": ",".join(p.name for p in sweep.policies),
            "policy_params": json.dumps({p.name: policy_params(p) for p in sweep.policies}, sort_keys=True),
            "budget_counts": "kept keys of the target's query, its own token included",
            "score_source": sweep.semantics.score_source,
        })
        if sweep.semantics.streams:  # decisions every --chunk tokens
            attrs["chunk"] = cfg.chunk
        attrs["granularity"] = cfg.granularity
        attrs.update({
            "policy_seed": cfg.draw_seed, "draws": cfg.draws,
            "draw_seeds": "one seed per (policy seed, doc, position, policy, draw), common to every budget "
                          "(common random numbers: kept sets of random nested in the budget, and of poisson except under "
                          "streaming, whose online scores differ between budgets)",
        })
    return attrs


def run_measure(cfg: MeasureConfig, loaded: LoadedModel | None = None, stop_after_shards: int | None = None) -> MeasureSummary:
    """Run a measurement (window or policy sweep) and write the results file ``cfg.out``.

    Args:
        cfg: the configuration (validated at construction).
        loaded: an already loaded model (else ``cfg.model`` is loaded).
        stop_after_shards: raise :class:`~truncsens.engine.run.shards.MeasureInterrupted` after writing
            this many new shards (to test resuming).

    Raises:
        MeasureError: ``cfg.out`` exists (without overwrite), bad windows / reference context / corpus, a BOS rule
            the model or the sweep cannot take (:mod:`truncsens.engine.bos`),
            shards of another run.
        truncsens.engine.run.lock.OutputLockedError: another run is writing ``cfg.out``.
        truncsens.engine.run.distributed.LaunchError: the launch environment and the process group disagree.
        PolicyError: a budget a policy cannot take, poisson scores all zero.
        truncsens.engine.semantics.SemanticsError: a model that cannot run the semantics, or one of its
            policies (``snapkv`` on sliding-window layers).
        truncsens.models.ModelLoadError, truncsens.corpora.CorpusError: loading failed.
        truncsens.engine.batching.OutOfMemoryAtBatchSizeOne, NonFiniteLogitsError: the pass failed
            (shards already written are kept). Nothing is written before the checks pass.
    """
    check_output(cfg.out, cfg.overwrite, cfg.resume)  # before anything is loaded
    check_before_loading(cfg)
    ranks = current_ranks(cfg.device)
    speak = cfg.progress and ranks.is_main  # what it does before the first shard ends, on stderr
    if loaded is None:
        say("measure", f"loading model {cfg.model}", speak)
        loaded = load_model(cfg.model, process_device(cfg.device, ranks), cfg.dtype)
    N = resolve_reference_context(cfg, loaded)
    bos = resolve_bos(cfg.bos, loaded.tokenizer, loaded.name)
    cfg = with_bos_sinks(cfg, bos, cfg.build_policies())  # the BOS as first sink when every context begins with it
    sweep = resolve_sweep(cfg, N)
    sweep.semantics.check_model(loaded.model, loaded.name)
    for policy in sweep.policies:  # before the documents are read
        sweep.semantics.check_policy_model(policy, loaded.model)
    docs = prepare_documents(cfg, loaded, N, on_stage=lambda text: say("measure", text, speak))
    attrs = provenance(cfg, loaded, N, docs, sweep)
    attrs.update(bos.attrs())

    extra = {} if sweep.is_window_sweep else {"policies": [p.name for p in sweep.policies], "semantics": sweep.semantics.name}
    notes = [f"{note}, not measured"] if (note := skipped_files_note(docs.skipped)) else []  # said on stderr
    if cfg.per_layer:
        attrs.update(per_layer_attrs(loaded))
        work = per_layer_work(cfg, loaded, N, sweep, docs, attrs)
        extra.update(per_layer=int(attrs["n_layers"]), semantics=sweep.semantics.name)
    elif cfg.protocol == "block":
        work = block_work(cfg, loaded, N, sweep, docs, attrs)
        extra["protocol"] = "block"
        if sweep.is_window_sweep and cfg.targets_per_doc:
            note = larger_blocks_note(cfg.targets_per_doc, N, sweep.values, cfg.n_sink or 0, cfg.block_fraction,
                                      cfg.block_size)
            if note:
                notes.append(note)
    else:
        work = exact_work(cfg, loaded, N, sweep, docs, attrs)
    if bos.prepend is not None:  # every context begins with the BOS (targets of every shard, resumed ones too)
        work = dataclasses.replace(work, select=select_starting_with(work.select, bos.prepend))
    if notes:
        extra["notes"] = notes
    fingerprint = cfg.fingerprint(reference_context=N, corpus_sha256=docs.sha256, model_sha256=loaded.content_sha256,
                                  model_revision=loaded.revision, **{sweep.dim + "s": sweep.values},
                                  **({"bos_prepended": True} if bos.prepend is not None else {}))
    done = run_sharded(ShardedRun.of(cfg, docs.used, N, fingerprint, work), ranks, stop_after_shards)
    return MeasureSummary(
        path=done.path, n_targets=done.n_targets, n_docs=len(docs.used), n_docs_checked=len(docs.checked),
        n_docs_skipped=docs.n_short, sweep_dim=sweep.dim, sweep=sweep.values, reference_context=N,
        shards_reused=done.shards_reused, extra=extra)


def exact_work(cfg: MeasureConfig, loaded: LoadedModel, N: int, sweep: Sweep, docs: RunDocuments,
               attrs: dict) -> ShardWork:
    """The exact protocol's shards: the kernel, one pass per target and kept set; progress counts the
    reference pass (N tokens) and every kept pass (:meth:`~truncsens.engine.semantics.base.Semantics.cost`)."""
    batch_tokens = cfg.batch_tokens(loaded.device)

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        out = measure_draws(loaded.model, plan, sweep.policies, sweep.budgets, sweep.semantics, cfg.positions,
                            cfg.draw_seed, loaded.device, batch_tokens, on_tokens, chunk=cfg.chunk, draws=cfg.draws,
                            granularity=cfg.granularity)
        return shard_results(out, plan, sweep, attrs, docs.bos_id)

    passes = sum(draws_measured(sweep.policies, cfg.draws))  # kept passes per budget: R per randomized policy
    per_target = N + passes * sum(sweep.semantics.cost(N, k) for k in sweep.budgets)
    desc = "measure" if sweep.is_window_sweep else f"measure {sweep.semantics.name}"
    return ShardWork(compute_shard, per_target, desc)
