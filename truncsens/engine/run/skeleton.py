"""The run skeleton every driver uses: lock the output, check it, plan the shards, resume, compute the
missing shards, merge, write, report progress.

A driver (``truncsens measure``'s exact and block protocols, :mod:`truncsens.engine.measure`;
``truncsens certify``, :mod:`truncsens.certificates.driver`) says only what is its own in a
:class:`ShardWork` (how it draws a shard's targets and computes the shard's results Dataset, and the
progress estimate), puts it with its documents and resume fingerprint in a :class:`ShardedRun` and
hands that to :func:`run_sharded`. A driver whose targets are fixed before the run
(``truncsens certify-attribution``, :mod:`truncsens.certificates.attribution_driver`: its task set)
gives its own ``select``, and a ``finish`` for what is computed once over the merged file.

Shard files, their checks and the progress reporter are in :mod:`truncsens.engine.run.shards`; the
lock in :mod:`truncsens.engine.run.lock`; the processes of a multi-process launch in
:mod:`truncsens.engine.run.distributed`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import xarray as xr

from truncsens import results
from truncsens.engine.run.distributed import Ranks
from truncsens.engine.run.lock import OutputLock
from truncsens.engine.run.shards import (
    SHARD_ONLY_ATTRS, MeasureInterrupted, ShardProgress, check_kept_shards, check_output, check_shards,
    fingerprint_hash, kept_shards, mark_resumable, prepare_shard_dir, shard_dir_for,
)
from truncsens.targets import TargetSet, TokenDoc, select_targets

ComputeShard = Callable[[TargetSet, Callable[[int], None]], xr.Dataset]
"""``(targets, on_tokens) -> results Dataset`` of one shard; ``on_tokens(n)`` reports n forward tokens
done (progress); the Dataset's attr ``n_clamped`` is summed over shards at the merge."""

SelectTargets = Callable[[list[TokenDoc], int, "int | None", int], TargetSet]
"""``(docs, N, targets_per_doc, seed) -> TargetSet``: the targets of one shard's documents."""


@dataclass
class ShardWork:
    """What a driver computes, shard by shard.

    Attributes:
        compute_shard: see :data:`ComputeShard`.
        tokens_per_target: forward tokens per target (the progress total is this times the targets).
        label: progress label (``measure``, ``certify``, ...).
        select: how a shard's targets are drawn (default :func:`truncsens.targets.select_targets`;
            the block protocol draws blocks).
    """

    compute_shard: ComputeShard
    tokens_per_target: int
    label: str
    select: SelectTargets = select_targets


@dataclass
class ShardedRun:
    """A run written in resumable shards: ``<out>.shards/shard-00000.nc`` per ``docs_per_shard``
    documents, merged into ``out`` at the end.

    Attributes:
        out: results file path.
        docs: the documents of the run (long enough), in order.
        reference_context: N (tokens); with ``targets_per_doc`` and ``seed`` the target selection.
        fingerprint: what must match for ``resume`` to reuse shards (written to ``run.json``; its
            SHA-256 is stamped into every shard).
        work: how each shard is computed (:class:`ShardWork`).
        docs_per_shard: documents per shard.
        resume: continue from shards already written; overwrite: an existing ``out`` may be replaced
            (checked again once the lock is held, so a run that finished in the meantime is never
            overwritten by one that waited); progress: show progress.
        finish: ``Dataset -> Dataset`` applied to the merged Dataset before it is written, the shards
            still kept (what is computed once for the whole run; default: nothing).
    """

    out: Path
    docs: list[TokenDoc]
    reference_context: int
    fingerprint: dict
    work: ShardWork
    targets_per_doc: int | None = None
    seed: int = 0
    docs_per_shard: int = 8
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    finish: Callable[[xr.Dataset], xr.Dataset] | None = None

    @classmethod
    def of(cls, cfg, docs: list[TokenDoc], reference_context: int, fingerprint: dict, work: ShardWork) -> "ShardedRun":
        """The run of a configuration with the run options of :class:`~truncsens.engine.config.MeasureConfig`
        (``out``, ``targets_per_doc``, ``seed``, ``docs_per_shard``, ``resume``, ``overwrite``, ``progress``;
        :class:`~truncsens.certificates.config.CertifyConfig` has them too)."""
        return cls(Path(cfg.out), docs, reference_context, fingerprint, work, cfg.targets_per_doc, cfg.seed,
                   cfg.docs_per_shard, cfg.resume, cfg.overwrite, cfg.progress)


class RunOutcome(NamedTuple):
    """What :func:`run_sharded` did: the merged file, shards reused (by every rank: those an earlier run
    had left), targets (-1 on ranks other than 0)."""

    path: Path
    shards_reused: int
    n_targets: int


def run_sharded(run: ShardedRun, ranks: Ranks | None = None, stop_after_shards: int | None = None) -> RunOutcome:
    """Lock ``run.out``, check it, compute the shards not yet written, merge them into ``run.out``.

    Rank 0 holds the lock from the first shard to the merge; under a multi-process launch each rank
    computes the shards it owns (round robin) and rank 0 merges. A run that fails before any shard is
    finished leaves no shard folder.

    Args:
        run: the run (:class:`ShardedRun`).
        ranks: this process's place in a multi-process run (default: a single process).
        stop_after_shards: raise :class:`~truncsens.engine.run.shards.MeasureInterrupted` after this
            many new shards (tests).

    Returns:
        :class:`RunOutcome`. The merged file's attrs are the shards' less ``run_fingerprint`` and
        ``shard_index``, with ``n_clamped`` summed, ``created`` (now, UTC) and ``n_docs``; then
        ``run.finish`` (an interruption there keeps every shard for ``resume``).

    Raises:
        MeasureError: ``out`` exists (without ``overwrite``), shards of another run / without
            ``resume``, or a shard set that is not this run's.
        OutputLockedError: another run is writing ``out``.
    """
    shard_dir = shard_dir_for(run.out)
    ranks = ranks or Ranks()
    with OutputLock(run.out, enabled=ranks.is_main):  # held by rank 0 from the first shard to the merge
        try:
            if ranks.is_main:
                check_output(run.out, run.overwrite, run.resume)
            return _run_locked(run, shard_dir, ranks, stop_after_shards)
        except BaseException:
            if ranks.is_main and shard_dir.is_dir() and not kept_shards(run.out):  # nothing finished: leave no folder
                shutil.rmtree(shard_dir, ignore_errors=True)
            raise


def _run_locked(run: ShardedRun, shard_dir: Path, ranks: Ranks, stop_after_shards: int | None) -> RunOutcome:
    prepare_shard_dir(shard_dir, run.fingerprint, run.resume, write=False)
    docs, work = run.docs, run.work
    groups = [docs[i : i + run.docs_per_shard] for i in range(0, len(docs), run.docs_per_shard)]
    plans = [work.select(g, run.reference_context, run.targets_per_doc, run.seed) for g in groups]
    run_hash = fingerprint_hash(run.fingerprint)
    # every kept shard readable and this run's, checked by every rank before any rank computes one
    check_kept_shards(shard_dir, plans, run_hash)
    # the shards an earlier run left, seen by every rank before any rank writes one: the run's reused count
    # (each rank skips only its own; rank 0 reports all of them)
    before = {p.name for p in shard_dir.glob("shard-*.nc")} if shard_dir.is_dir() else set()
    ranks.barrier()  # every rank has checked (and looked) before rank 0 writes
    if ranks.is_main:
        prepare_shard_dir(shard_dir, run.fingerprint, run.resume)
    ranks.barrier()
    try:
        return _compute_and_merge(run, shard_dir, ranks, stop_after_shards, plans, run_hash, before)
    except BaseException as exc:
        mark_resumable(exc)  # past the checks: the kept shards are this run's own
        raise


def _compute_and_merge(run: ShardedRun, shard_dir: Path, ranks: Ranks, stop_after_shards: int | None,
                       plans: list[TargetSet], run_hash: str, before: set[str]) -> RunOutcome:
    """The shards not yet written (each rank its own), then rank 0's merge into ``run.out``."""
    docs, work = run.docs, run.work
    reused, written = 0, 0
    mine = [i for i in range(len(plans)) if ranks.owns(i)]
    # a single process merges the last shard it computes from memory: its file is written only if the merge
    # fails (so nothing computed is lost), which spares a run of one shard a write and a read-back of its results
    last_in_memory = mine[-1] if ranks.count == 1 and mine else None
    in_memory: dict[int, xr.Dataset] = {}
    total = sum(len(plans[i]) for i in mine) * work.tokens_per_target
    with ShardProgress(total, work.label, run.progress and ranks.is_main, len(mine)) as bar:
        for i in mine:
            plan = plans[i]
            path = shard_dir / f"shard-{i:05d}.nc"
            if path.is_file():
                reused += 1
                bar.shard_done(len(plan) * work.tokens_per_target, reused=True)
                continue
            ds = work.compute_shard(plan, bar.update)
            ds.attrs.update(run_fingerprint=run_hash, shard_index=i)
            if i == last_in_memory:
                in_memory[i] = ds
            else:
                results.save(ds, path)
            written += 1
            bar.shard_done(0)
            if stop_after_shards is not None and written >= stop_after_shards and i + 1 < len(plans):
                raise MeasureInterrupted(f"stopped after {written} shards; resume with --resume")
    ranks.barrier()
    reused_all = sum(f"shard-{i:05d}.nc" in before for i in range(len(plans)))
    if not ranks.is_main:
        return RunOutcome(run.out, reused_all, -1)
    paths = [shard_dir / f"shard-{i:05d}.nc" for i in range(len(plans))]
    try:
        return _merge(run, shard_dir, plans, run_hash, paths, in_memory, reused_all)
    except BaseException:
        for i, ds in in_memory.items():  # the shard merged from memory is kept for --resume
            _keep_shard(ds, paths[i])
        raise


def _keep_shard(ds: xr.Dataset, path: Path) -> None:
    """Write a shard that was to be merged from memory when the merge failed; a failure to write it
    (the disk that failed the merge, say) leaves the merge's own error to be raised."""
    try:
        results.save(ds, path)
    except Exception:  # noqa: BLE001 - the merge's error is the one the user must see
        pass


def _merge(run: ShardedRun, shard_dir: Path, plans: list[TargetSet], run_hash: str, paths: list[Path],
           in_memory: dict[int, xr.Dataset], reused_all: int) -> RunOutcome:
    """Rank 0's merge of every shard (read from its file, or the one held in memory) into ``run.out``."""
    docs = run.docs
    parts = [in_memory[i] if i in in_memory else results.load(p) for i, p in enumerate(paths)]
    check_shards(parts, plans, run_hash, shard_dir)
    merged = results.merge(parts, [str(p) for p in paths])
    for name in SHARD_ONLY_ATTRS:
        merged.attrs.pop(name, None)
    merged.attrs["n_clamped"] = int(sum(int(p.attrs.get("n_clamped", 0)) for p in parts))
    merged.attrs["created"] = results.utc_now()
    merged.attrs["n_docs"] = len(docs)
    if run.finish is not None:
        merged = run.finish(merged)
    results.save(merged, run.out)
    shutil.rmtree(shard_dir, ignore_errors=True)
    return RunOutcome(run.out, reused_all, int(merged.sizes["target"]))

