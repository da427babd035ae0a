"""The ``truncsens certify-attribution`` driver: held-out corpus -> attribution task set
(:mod:`truncsens.certificates.tasks`) -> the certify passes of every target
(:func:`truncsens.certificates.driver.compute_arrays`, the same engine as ``truncsens certify``) -> one
results file; optionally a greedy trajectory under eviction (:mod:`truncsens.certificates.trajectory`).

Results file: the layout of :mod:`truncsens.certificates.driver` (dims policy × target × budget [× layer ×
head]) plus, per target, ``task_kind`` ("copy" or "kv") and ``source_position`` (the earlier
occurrence of the target token); attrs add ``min_distance``, ``copy_per_doc``, ``kv_docs``,
``failure_nll`` and, with a trajectory, ``trajectory`` (its summary as JSON) and the variables
``trajectory_error``, ``trajectory_radius_step`` (EB radius at δ_t), ``trajectory_radius_naive``
(at δ), dims (step, layer, head), and ``trajectory_token`` (dim step). The run is written in
resumable shards of ``docs_per_shard`` task documents each (a key-value document is one), as
``truncsens certify`` is (:func:`truncsens.engine.run.skeleton.run_sharded`: lock, shards, ``resume``,
merge); the trajectory is computed once, on the merged file, before the shards are removed.

Beside the certify variables, dims (policy, target, budget, layer, head), the server-side records of
the realizable attribution scores (:data:`SERVER_VARS`): ``attn_hat_norm`` ‖ô‖₂, ``kept_share_hat``
(Hájek share of the query's attention on kept keys) and the design records of
:mod:`truncsens.certificates.design_records` (score share evicted, its expectation, variance and
largest evicted share).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from truncsens import results
from truncsens.certificates.attribution import FAILURE_NLL
from truncsens.certificates.options import AttributionOptions
from truncsens.certificates.config import CertifyBase, CertifyConfig, CertifyError, parse_budgets, resolve_budgets
from truncsens.certificates.probe import check_model
from truncsens.certificates.driver import (
    certify_sweep, certify_tokens_per_target, compute_arrays, design_attrs, shard_dataset,
)
from truncsens.certificates.tasks import COPY_RULES, build_task_set, copy_vocabulary, default_min_distance
from truncsens.certificates.trajectory import greedy_trajectory, streamed_trajectory, trajectory_summary
from truncsens.engine.config import MeasureError
from truncsens.engine.measure import provenance, resolve_reference_context
from truncsens.engine.options import recorded_attrs
from truncsens.engine.run.progress import say
from truncsens.engine.run.shards import check_output
from truncsens.engine.run.skeleton import SelectTargets, ShardedRun, ShardWork, run_sharded
from truncsens.models import LoadedModel, load_model
from truncsens.targets import TargetSet, TokenDoc


SERVER_VARS = {  # results variable -> record name of certify_batch: what a server that drew the design knows
    "attn_hat_norm": "o_hat_norm", "kept_share_hat": "kept_share", "evicted_share": "evicted_share",
    "evicted_share_expected": "evicted_share_expected", "evicted_share_var": "evicted_share_var",
    "evicted_share_max": "evicted_share_max",
}


def add_server_vars(ds, records: dict):
    """Add the :data:`SERVER_VARS` of ``records`` (name -> [P, n, K, L, H]) to a shard Dataset."""
    for var, rec in SERVER_VARS.items():
        ds[var] = (("policy", "target", "budget", "layer", "head"), records[rec])
        ds[var].attrs["description"] = f"server-side record {rec} of the target query (truncsens.certificates)"
    return ds


@dataclass
class AttributionConfig(AttributionOptions, CertifyBase):  # the options first: their defaults win
    """Configuration of one attribution run (token counts in tokens); validates itself once.

    Attributes:
        the fields of :class:`~truncsens.certificates.config.CertifyBase` (model, domain, corpus, split,
            budgets, delta, n_sink, max_docs, seed, device, dtype, max_batch_tokens, out, overwrite,
            progress, command), with
        reference_context: N (default 512: small enough for a few minutes on 2 CPU cores).
        max_docs: held-out documents searched for copy targets; copy_per_doc: copy targets per document;
        copy_rule: a name in :data:`truncsens.certificates.tasks.COPY_RULES` ("induction": the preceding
            token repeats too; "span": the preceding 4 tokens repeat, nowhere nearer; "token").
        kv_docs: synthetic key–value documents (one target each).
        min_distance: D (default N // 4).
        trajectory: steps of the greedy trajectory (0: none); trajectory_budget: its budget, a token
            count or a percentage of N (the same syntax as ``budgets``, one value).
        out: results file (default ``results/<model>-<corpus or domain>-attribution.nc``).

    Raises:
        CertifyError: every check of :class:`CertifyBase`, a negative count, no target source.
    """

    OUT_SUFFIX: ClassVar[str] = "-attribution"
    POLICY_SET: ClassVar[str] = "attribution_policies"

    def __post_init__(self) -> None:
        for name in ("copy_per_doc", "kv_docs", "trajectory"):
            if getattr(self, name) < 0:
                raise CertifyError(f"{name} (--{name.replace('_', '-')}) must be >= 0, got {getattr(self, name)}")
        if self.copy_rule not in COPY_RULES:
            raise CertifyError(f"copy_rule (--copy-rule) must be one of {', '.join(COPY_RULES)}, got {self.copy_rule!r}")
        if self.copy_per_doc == 0 and self.kv_docs == 0:
            raise CertifyError("no attribution targets: copy_per_doc (--copy-per-doc) and kv_docs (--kv-docs) are both 0")
        if self.min_distance is not None and self.min_distance < 1:
            raise CertifyError(f"min_distance (--min-distance) must be at least 1 token, got {self.min_distance}")
        super().__post_init__()  # delta, budgets, run options: the checks of CertifyBase / MeasureConfig
        if len(parse_budgets(self.trajectory_budget, "trajectory_budget (--trajectory-budget)")) != 1:  # the syntax of --budgets, one value
            raise CertifyError(f"trajectory_budget (--trajectory-budget) takes one budget, got {self.trajectory_budget!r}")

    def check_run_options(self) -> None:
        """Checked by building :meth:`certify_config` (which checks its MeasureConfig once)."""
        self.certify_config()

    def certify_config(self) -> CertifyConfig:
        """The equivalent :class:`CertifyConfig` (documents, policies, budgets): the shared fields,
        one target per document (unused: the task set picks the targets)."""
        return CertifyConfig(**{**self.shared_fields(), "out": self.out or "unused.nc",
                                "policies": ",".join(self.policy_names())}, targets_per_doc=1)


def task_documents(targets: TargetSet) -> tuple[list[TokenDoc], SelectTargets]:
    """The documents of a task set's targets, in order, and how a group of them selects its targets
    (the run skeleton's ``docs`` and ``select``): the targets of consecutive documents are one slice
    of ``targets``. The documents carry their ids only (no tokens): the targets are already drawn.

    Raises:
        ValueError: the targets of a document are not consecutive.
    """
    spans: dict[str, list[int]] = {}  # doc id -> [first, stop) of its targets
    for i, d in enumerate(targets.doc):
        span = spans.setdefault(d, [i, i])
        if span[1] != i:
            raise ValueError(f"the targets of document {d!r} are not consecutive in the task set")
        span[1] = i + 1
    docs = [TokenDoc(d, torch.zeros(0, dtype=torch.long)) for d in spans]

    def select(group: list[TokenDoc], reference_context: int, targets_per_doc: int | None, seed: int) -> TargetSet:
        return targets.subset(slice(spans[group[0].id][0], spans[group[-1].id][1]))

    return docs, select


@dataclass
class AttributionRun:
    """What a finished run wrote: the results file and its Dataset (task set, budgets, N and the
    trajectory summary are in its variables and attrs)."""

    path: Path
    dataset: object


def run_attribution(cfg: AttributionConfig, loaded: LoadedModel | None = None) -> AttributionRun:
    """Build the task set, run the certify passes on every target shard by shard, merge them into
    ``cfg.out`` (with the trajectory, if asked for); progress on stderr unless ``cfg.progress`` is off.

    Raises:
        CertifyError: a budget at or above N or at most the sinks (also the trajectory's).
        truncsens.certificates.probe.CertifyModelError: a model without the attention interface.
        truncsens.certificates.tasks.TaskError: D outside [1, N], no target found.
        MeasureError: ``cfg.out`` exists (without ``--overwrite``), bad N or corpus, a model
            without a tokenizer, shards of another run (or without ``--resume``). Nothing is written
            before every check has passed; an interrupted run keeps its finished shards.
        truncsens.engine.run.lock.OutputLockedError: another run is writing ``cfg.out``.
    """
    check_output(cfg.out, cfg.overwrite, cfg.resume)
    ccfg = cfg.certify_config()
    ccfg.check_before_loading()
    label = "certify-attribution"
    if loaded is None:
        say(label, f"loading model {cfg.model}", cfg.progress)
        loaded = load_model(cfg.model, cfg.device, cfg.dtype)
    check_model(loaded.model, loaded.name)
    if loaded.tokenizer is None:
        raise MeasureError(f"model {loaded.name!r} has no tokenizer: the attribution tasks are text")
    N = resolve_reference_context(ccfg.measure_config(), loaded)
    budgets = ccfg.resolve_budgets(N)
    traj_budget = None
    if cfg.trajectory:
        named = "trajectory_budget (--trajectory-budget)"
        traj_budget = resolve_budgets(parse_budgets(cfg.trajectory_budget, named), N, cfg.n_sink, named)[0]
    if cfg.trajectory and N - cfg.trajectory <= traj_budget:
        raise CertifyError(f"trajectory={cfg.trajectory} (--trajectory {cfg.trajectory}) leaves a prefix of {N - cfg.trajectory} tokens, not above "
                           f"the trajectory budget of {traj_budget} tokens; use fewer steps or a smaller "
                           "trajectory_budget (--trajectory-budget)")
    mcfg, sweep, docs = certify_sweep(ccfg, loaded, N, budgets, on_stage=lambda text: say(label, text, cfg.progress))
    tok = loaded.tokenizer
    D = cfg.min_distance or default_min_distance(N)
    say(label, f"building the task set: copy targets of {len(docs.used)} document{'s' * (len(docs.used) != 1)}, "
               f"{cfg.kv_docs} key-value document{'s' * (cfg.kv_docs != 1)}", cfg.progress)
    eligible = copy_vocabulary(tok.convert_ids_to_tokens(list(range(len(tok)))))
    tasks = build_task_set(docs.used, eligible, lambda s: tok(s, add_special_tokens=False)["input_ids"], N, D,
                           cfg.copy_per_doc, cfg.kv_docs, cfg.seed, COPY_RULES[cfg.copy_rule])
    attrs = {**provenance(mcfg, loaded, N, docs, sweep), **recorded_attrs(cfg), "delta": cfg.delta, **design_attrs(cfg.design, loaded.dtype), "targets_per_doc": 0,
             "min_distance": D, "copy_per_doc": cfg.copy_per_doc, "copy_rule": cfg.copy_rule, "kv_docs": cfg.kv_docs,
             "failure_nll": FAILURE_NLL,
             "certify": "attribution tasks of truncsens certify-attribution (arXiv 2607.21475)",
             "certified_process": cfg.rule.process_for(cfg.design)}
    plan = tasks.targets
    index = {(d, int(t)): i for i, (d, t) in enumerate(zip(plan.doc, plan.position))}  # a target's row in the task set
    batch_tokens = mcfg.batch_tokens(loaded.device)
    per_target = certify_tokens_per_target(N, sweep, cfg.rule.streams)

    def compute_shard(part: TargetSet, on_tokens):
        arrays = compute_arrays(loaded.model, part, sweep, cfg.seed, cfg.delta, loaded.device, batch_tokens, on_tokens,
                                cfg.design, cfg.rule.batch(), per_target)
        ds = add_server_vars(shard_dataset(arrays, part, sweep, attrs), arrays["records"])
        rows = [index[(d, int(t))] for d, t in zip(part.doc, part.position)]
        ds["task_kind"] = (("target",), np.asarray(tasks.kind, dtype=str)[rows])
        ds["source_position"] = (("target",), tasks.source[rows])
        ds["source_position"].attrs["description"] = "position of the most recent earlier occurrence of the target token"
        return ds

    def finish(ds):  # the trajectory, once, on the merged file
        if cfg.trajectory:
            say(label, f"greedy trajectory of {cfg.trajectory} steps", cfg.progress)
            poisson = next(p for p in sweep.policies if p.name == "poisson")
            first = docs.used[0]
            prefix = first.ids[: N - cfg.trajectory].to(loaded.device)  # the trajectory ends within N tokens
            trajectory = streamed_trajectory if cfg.rule.streams else greedy_trajectory
            traj = trajectory(loaded.model, prefix, poisson, traj_budget, cfg.trajectory, cfg.delta, cfg.seed, cfg.design)
            ds.attrs["trajectory"] = json.dumps({"doc": first.id, **trajectory_summary(traj)})
            for name, values in (("trajectory_error", traj.error), ("trajectory_radius_step", traj.radius_step),
                                 ("trajectory_radius_naive", traj.radius_naive)):
                ds[name] = (("step", "layer", "head"), values)  # [n, L, H]
            ds["trajectory_token"] = (("step",), traj.tokens.numpy())
        return ds

    task_docs, select = task_documents(plan)
    work = ShardWork(compute_shard, per_target, label, select)
    fingerprint = cfg.fingerprint(reference_context=N, corpus_sha256=docs.sha256, budgets_tokens=budgets,
                                  min_distance_tokens=D, model_sha256=loaded.content_sha256,
                                  model_revision=loaded.revision)
    run = ShardedRun(Path(cfg.out), task_docs, N, fingerprint, work, None, cfg.seed, cfg.docs_per_shard, cfg.resume,
                     cfg.overwrite, cfg.progress, finish)
    done = run_sharded(run)
    return AttributionRun(done.path, results.load(done.path))
