"""``truncsens measure``, the one run driver: corpus -> documents -> targets -> semantics x policy
passes -> metrics -> shard files -> results file.

A window sweep and a policy sweep are the same run (:mod:`truncsens.engine.sweep`): the driver
resolves the sweep, hands every shard of targets to the kernel (:mod:`truncsens.engine.kernel`) and
writes what it returns with :mod:`truncsens.results`.

Results: dims (target, window) for a window sweep; (target, budget), or (policy, target, budget)
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

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import truncsens
from truncsens import results
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.run.distributed import current_ranks, process_device
from truncsens.engine.documents import RunDocuments, prepare_documents
from truncsens.engine.kernel import KernelOutput, draws_measured, measure_draws
from truncsens.engine.run.shards import check_output, run_shards
from truncsens.engine.sweep import Sweep, resolve_sweep
from truncsens.models import LoadedModel, load_model
from truncsens.policies import policy_params
from truncsens.targets import TargetSet


SCORE_SOURCES = {  # where policies that read scores take them from, per semantics
    "streaming": "online: attention and key norms computed by the evicted streaming run itself",
    "prefill_evict": "the full-context prefill (reference pass)",
    "reencode": "none (policies that read scores are refused)",
}


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


def resolve_reference_context(cfg: MeasureConfig, loaded: LoadedModel) -> int:
    """N: ``cfg.reference_context`` or the model's maximum context.

    Raises:
        MeasureError: N beyond the model's position limit, or below 2.
    """
    N = cfg.reference_context or loaded.max_context
    if N > loaded.max_context:
        raise MeasureError(
            f"reference context {N} is beyond the model's position limit of {loaded.max_context} tokens; "
            f"use --reference-context {loaded.max_context} or less")
    if N < 2:
        raise MeasureError(f"reference context must be at least 2 tokens, got {N}")
    return N


def vocabulary(loaded: LoadedModel) -> dict:
    """Which ids the divergences are taken over: every output logit of the model. A model whose
    vocabulary is padded beyond its tokenizer's ids keeps the padded rows (the model assigns them
    probability, so dropping them would change the distributions compared)."""
    config = getattr(loaded.model, "config", None)
    size = getattr(config, "vocab_size", None)
    tokenizer = len(loaded.tokenizer) if loaded.tokenizer is not None else None
    return {"model_output_ids": size, "tokenizer_ids": tokenizer, "divergences_over": "all model output ids"}


def provenance(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int, docs: RunDocuments, sweep: Sweep) -> dict:
    """The results attrs (``created`` is filled in at merge time; see docs/results.md)."""
    attrs = {
        "truncsens_version": truncsens.__version__, "model": loaded.name, "model_revision": loaded.revision,
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
    if not sweep.is_window_sweep:
        attrs.update({
            "n_sink": cfg.n_sink if any(hasattr(p, "n_sink") for p in sweep.policies) else 0,
            "policy": ",".join(p.name for p in sweep.policies),
            "policy_params": json.dumps({p.name: policy_params(p) for p in sweep.policies}, sort_keys=True),
            "budget_counts": "kept keys of the target's query, its own token included",
            "score_source": SCORE_SOURCES[sweep.semantics.name],
        })
        if sweep.semantics.name == "streaming":
            attrs["chunk"] = cfg.chunk
        attrs["granularity"] = cfg.granularity
        attrs.update({
            "policy_seed": cfg.draw_seed, "draws": cfg.draws,
            "draw_seeds": "one seed per (policy seed, doc, position, policy, draw), common to every budget "
                          "(common random numbers: kept sets of random nested in the budget, and of poisson except under "
                          "streaming, whose online scores differ between budgets)",
        })
    return attrs


def shard_results(out: KernelOutput, plan: TargetSet, sweep: Sweep, attrs: dict, bos_id: int | None = None):
    """The results Dataset of one shard from ``out`` of :func:`~truncsens.engine.kernel.measure_draws`
    (arrays [P, R, n, K]; see the module docstring for the layout: the ``policy`` dim only for P > 1,
    the ``draw`` dim only for R > 1); the per-target coord ``bos_first`` (int8) says whether the
    reference context began with the tokenizer's BOS."""
    single = len(sweep.policies) == 1
    names = [p.name for p in sweep.policies]
    R = out.kept_tokens.shape[1]

    def layout(values: np.ndarray) -> np.ndarray:  # [P, R, n, K] -> ([P,] [R,] n, K)
        values = values if R > 1 else values[:, 0]
        return values[0] if single else values

    ds = results.make_results({m: layout(v) for m, v in out.metrics.items()}, sweep.dim, sweep.values,
                              plan.doc, plan.position, plan.token_id.numpy(), {**attrs, "n_clamped": out.n_clamped},
                              policies=None if single else names, draws=R if R > 1 else None)
    first = plan.context[:, 0].numpy() if len(plan) else np.zeros(0, np.int64)  # [n]
    bos_first = (first == bos_id) if bos_id is not None else np.zeros(len(plan), bool)
    ds = ds.assign_coords(bos_first=("target", bos_first.astype(np.int8)))
    if sweep.is_window_sweep:
        return ds
    dims = ds["kl"].dims
    extras = {"kept_tokens": out.kept_tokens}
    if out.evicted_attention_mass is not None:
        extras["evicted_attention_mass"] = out.evicted_attention_mass
    for name, values in extras.items():
        ds[name] = (dims, layout(values))
    ds["kept_tokens"].attrs["units"] = "tokens"
    if "evicted_attention_mass" in ds:
        ds["evicted_attention_mass"].attrs["description"] = (
            "attention probability mass of the full-context target query on the evicted keys, mean over layers and heads")
    return ds


def run_measure(cfg: MeasureConfig, loaded: LoadedModel | None = None, stop_after_shards: int | None = None) -> MeasureSummary:
    """Run a measurement (window or policy sweep) and write the results file ``cfg.out``.

    Args:
        cfg: the configuration (validated at construction).
        loaded: an already loaded model (else ``cfg.model`` is loaded).
        stop_after_shards: raise :class:`~truncsens.engine.run.shards.MeasureInterrupted` after writing
            this many new shards (to test resuming).

    Raises:
        MeasureError: ``cfg.out`` exists (without overwrite), bad windows / reference context / corpus,
            shards of another run.
        truncsens.engine.run.lock.OutputLockedError: another run is writing ``cfg.out``.
        truncsens.engine.run.distributed.LaunchError: the launch environment and the process group disagree.
        PolicyError: a budget a policy cannot take, poisson scores all zero.
        truncsens.engine.semantics.SemanticsError: a model that cannot run the semantics.
        truncsens.models.ModelLoadError, truncsens.corpora.CorpusError: loading failed.
        truncsens.engine.batching.OutOfMemoryAtBatchSizeOne, NonFiniteLogitsError: the pass failed
            (shards already written are kept). Nothing is written before the checks pass.
    """
    check_output(cfg.out, cfg.overwrite, cfg.resume)  # before anything is loaded
    ranks = current_ranks(cfg.device)
    loaded = loaded or load_model(cfg.model, process_device(cfg.device, ranks), cfg.dtype)
    N = resolve_reference_context(cfg, loaded)
    sweep = resolve_sweep(cfg, N)
    sweep.semantics.check_model(loaded.model, loaded.name)
    docs = prepare_documents(cfg, loaded, N)
    attrs = provenance(cfg, loaded, N, docs, sweep)

    extra = {} if sweep.is_window_sweep else {"policies": [p.name for p in sweep.policies], "semantics": sweep.semantics.name}
    if cfg.protocol == "block":
        from truncsens.engine.block.runs import run_block_shards

        path, reused, n_targets = run_block_shards(cfg, loaded, N, sweep, docs, attrs, ranks, stop_after_shards)
        extra["protocol"] = "block"
    else:
        path, reused, n_targets = _run_exact_shards(cfg, loaded, N, sweep, docs, attrs, ranks, stop_after_shards)
    return MeasureSummary(
        path=path, n_targets=n_targets, n_docs=len(docs.used), n_docs_checked=len(docs.checked),
        n_docs_skipped=docs.n_short, sweep_dim=sweep.dim, sweep=sweep.values, reference_context=N,
        shards_reused=reused, extra=extra)


def _run_exact_shards(cfg: MeasureConfig, loaded: LoadedModel, N: int, sweep: Sweep, docs: RunDocuments, attrs: dict,
                      ranks, stop_after_shards: int | None) -> tuple:
    """The exact protocol's shards (the kernel, one pass per target), written to ``cfg.out``:
    (path, shards reused, number of targets)."""
    batch_tokens = cfg.batch_tokens(loaded.device)

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        out = measure_draws(loaded.model, plan, sweep.policies, sweep.budgets, sweep.semantics, cfg.positions,
                            cfg.draw_seed, loaded.device, batch_tokens, on_tokens, chunk=cfg.chunk, draws=cfg.draws,
                            granularity=cfg.granularity)
        return shard_results(out, plan, sweep, attrs, docs.bos_id)

    passes = sum(draws_measured(sweep.policies, cfg.draws))  # kept passes per budget: R per randomized policy
    per_target = N + passes * sum(sweep.semantics.cost(N, k) for k in sweep.budgets)
    desc = "measure" if sweep.is_window_sweep else f"measure {sweep.semantics.name}"
    fingerprint = cfg.fingerprint(reference_context=N, corpus_sha256=docs.sha256, **{sweep.dim + "s": sweep.values})
    return run_shards(
        cfg.out, docs.used, N, cfg.targets_per_doc, cfg.seed, cfg.docs_per_shard, fingerprint, cfg.resume,
        compute_shard, per_target, desc, cfg.progress, stop_after_shards, ranks, cfg.overwrite)
