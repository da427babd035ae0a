"""Shard files of a run: ``<out>.shards/shard-00000.nc`` per group of documents, resumable, merged
into the results file at the end.

An interrupted run loses at most the shard in flight; ``resume`` skips shards already written after
checking (``run.json``) that they come from the same configuration. Under a multi-process launch each
process computes the shards it owns (round robin) and rank 0 merges. A run owns its output while it
runs (:class:`OutputLock`), and the merge refuses any shard set that is not exactly the run's:
every shard carries the run's configuration hash and must hold exactly the targets planned for it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from truncsens import results
from truncsens.engine.config import MeasureError
from truncsens.engine.run.distributed import Ranks
from truncsens.engine.run.lock import OutputLock
from truncsens.targets import TargetSet, TokenDoc, select_targets

SHARD_ONLY_ATTRS = ("run_fingerprint", "shard_index")


class MeasureInterrupted(RuntimeError):
    """The run stopped before all shards were written (used by tests to simulate a crash)."""


def shard_dir_for(out: str | Path) -> Path:
    """The shard folder of results file ``out``: ``<out>.shards``."""
    return Path(str(out) + ".shards")


def kept_shards(out: str | Path) -> list[Path]:
    """Finished shard files of an unfinished run writing ``out`` (sorted; empty when there are none)."""
    folder = shard_dir_for(out)
    return sorted(folder.glob("shard-*.nc")) if folder.is_dir() else []


def fingerprint_hash(fingerprint: dict) -> str:
    """SHA-256 of the canonical JSON of a run's configuration (recorded in each shard)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def check_output(out: str | Path, overwrite: bool, resume: bool) -> None:
    """Refuse to replace a finished results file unless ``overwrite`` (or ``resume`` continuing a run
    whose shards are still there).

    Raises:
        MeasureError: ``out`` exists (naming the options), or is a folder.
    """
    out = Path(out)
    if out.is_dir():
        raise MeasureError(f"--out {out} is a folder; give a results file path such as {out / 'results.nc'}")
    if out.exists() and not overwrite and not (resume and kept_shards(out)):
        raise MeasureError(f"{out} already exists: pass --overwrite to replace it, or choose another --out")


def check_shards(parts: list, plans: list[TargetSet], run_hash: str, shard_dir: Path) -> None:
    """Every shard is of this run and holds exactly its planned targets, in order.

    Raises:
        MeasureError: a shard of another configuration, or with missing / extra / other targets.
    """
    for i, (part, plan) in enumerate(zip(parts, plans)):
        name = shard_dir / f"shard-{i:05d}.nc"
        if part.attrs.get("run_fingerprint") != run_hash:
            raise MeasureError(f"refusing to merge: {name} was written by a run of another configuration "
                               "(another run wrote into the same output?); delete the folder and rerun")
        docs = [str(d) for d in part["doc"].values]
        if docs != list(plan.doc) or not np.array_equal(part["position"].values, plan.position):
            raise MeasureError(f"refusing to merge: {name} holds {len(docs)} targets of documents "
                               f"{sorted(set(docs))[:3]}..., not the {len(plan)} targets planned for it; "
                               "delete the folder and rerun")


def prepare_shard_dir(shard_dir: Path, fingerprint: dict, resume: bool, write: bool = True) -> None:
    """Check that ``shard_dir`` holds no shards, or (``resume``) shards of this very configuration;
    then (``write``) create it and record the configuration in ``run.json``.

    Raises:
        MeasureError: shards without ``resume``, or shards of another configuration.
    """
    spec = shard_dir / "run.json"
    if shard_dir.exists() and any(shard_dir.glob("shard-*.nc")):
        if not resume:
            raise MeasureError(
                f"an earlier run left shards in {shard_dir}: pass --resume to continue it, or delete the folder to start over")
        old = json.loads(spec.read_text()) if spec.is_file() else None
        if old != fingerprint:
            diff = sorted(k for k in set(fingerprint) | set(old or {}) if (old or {}).get(k) != fingerprint.get(k))
            raise MeasureError(
                f"cannot resume: the shards in {shard_dir} come from a different configuration ({', '.join(diff)} differ); "
                "rerun with the same options or delete the folder")
    if write:
        shard_dir.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps(fingerprint, indent=2, sort_keys=True))


def run_shards(
    out: str | Path, docs: list[TokenDoc], reference_context: int, targets_per_doc: int | None, seed: int,
    docs_per_shard: int, fingerprint: dict, resume: bool,
    compute_shard: Callable[[TargetSet, Callable[[int], None]], "results.xr.Dataset"],
    tokens_per_target: int, desc: str, progress: bool = True, stop_after_shards: int | None = None,
    ranks: Ranks | None = None, overwrite: bool = False, select: Callable[..., TargetSet] | None = None,
) -> tuple[Path, int, int]:
    """Process documents in shards, write each shard file, merge them into ``out``.

    Args:
        out: results file path.
        docs: the documents of the run (long enough), in order.
        reference_context, targets_per_doc, seed: target selection (:func:`truncsens.targets.select_targets`).
        docs_per_shard: documents per shard.
        fingerprint: what must match for ``resume`` to reuse shards.
        resume: continue from shards already written.
        compute_shard: ``(targets, on_tokens) -> results Dataset`` of one shard; its attr
            ``n_clamped`` is summed over shards.
        tokens_per_target: forward tokens per target (progress bar total).
        desc: progress bar label; progress: show it.
        stop_after_shards: raise :class:`MeasureInterrupted` after this many new shards (tests).
        ranks: this process's place in a multi-process run (default: a single process).
        overwrite: whether an existing ``out`` may be replaced (checked again once the lock is held,
            so a run that finished in the meantime is never overwritten by one that waited).
        select: ``(docs, N, targets_per_doc, seed) -> TargetSet`` (default
            :func:`truncsens.targets.select_targets`; the block protocol draws blocks).

    Returns:
        (path of the merged file, shards reused, number of targets; -1 on ranks other than 0).

    Raises:
        MeasureError: shards of another run / without ``resume``, or a shard set that is not this run's.
        OutputLockedError: another run is writing ``out``.
    """
    out = Path(out)
    shard_dir = shard_dir_for(out)
    ranks = ranks or Ranks()
    with OutputLock(out, enabled=ranks.is_main):  # held by rank 0 from the first shard to the merge
        try:
            if ranks.is_main:
                check_output(out, overwrite, resume)
            return _run_locked(out, shard_dir, ranks, docs, reference_context, targets_per_doc, seed, docs_per_shard,
                               fingerprint, resume, compute_shard, tokens_per_target, desc, progress, stop_after_shards,
                               select or select_targets)
        except BaseException:
            if ranks.is_main and shard_dir.is_dir() and not kept_shards(out):  # nothing finished: leave no folder
                shutil.rmtree(shard_dir, ignore_errors=True)
            raise


def _run_locked(out, shard_dir, ranks, docs, reference_context, targets_per_doc, seed, docs_per_shard, fingerprint,
                resume, compute_shard, tokens_per_target, desc, progress, stop_after_shards, select=select_targets):
    prepare_shard_dir(shard_dir, fingerprint, resume, write=False)
    ranks.barrier()  # every rank has checked before rank 0 writes
    if ranks.is_main:
        prepare_shard_dir(shard_dir, fingerprint, resume)
    ranks.barrier()
    groups = [docs[i : i + docs_per_shard] for i in range(0, len(docs), docs_per_shard)]
    plans = [select(g, reference_context, targets_per_doc, seed) for g in groups]
    run_hash = fingerprint_hash(fingerprint)
    reused, written = 0, 0
    mine = [i for i in range(len(plans)) if ranks.owns(i)]
    total = sum(len(plans[i]) for i in mine) * tokens_per_target
    with ShardProgress(total, desc, progress and ranks.is_main, len(mine)) as bar:
        for i in mine:
            plan = plans[i]
            path = shard_dir / f"shard-{i:05d}.nc"
            if path.is_file():
                reused += 1
                bar.shard_done(len(plan) * tokens_per_target, reused=True)
                continue
            ds = compute_shard(plan, bar.update)
            ds.attrs.update(run_fingerprint=run_hash, shard_index=i)
            results.save(ds, path)
            written += 1
            bar.shard_done(0)
            if stop_after_shards is not None and written >= stop_after_shards and i + 1 < len(plans):
                raise MeasureInterrupted(f"stopped after {written} shards; resume with --resume")
    ranks.barrier()
    if not ranks.is_main:
        return out, reused, -1
    parts = [results.load(shard_dir / f"shard-{i:05d}.nc") for i in range(len(plans))]
    check_shards(parts, plans, run_hash, shard_dir)
    merged = results.merge(parts)
    for name in SHARD_ONLY_ATTRS:
        merged.attrs.pop(name, None)
    merged.attrs["n_clamped"] = int(sum(int(p.attrs.get("n_clamped", 0)) for p in parts))
    merged.attrs["created"] = results.utc_now()
    merged.attrs["n_docs"] = len(docs)
    results.save(merged, out)
    shutil.rmtree(shard_dir, ignore_errors=True)
    return out, reused, int(merged.sizes["target"])


class ShardProgress:
    """Progress of a run: a tqdm bar (tokens, ETA) on a terminal; one line per shard on stderr when
    stderr is a file or a pipe (no carriage-return frames in logs); nothing when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool, n_shards: int) -> None:
        self.total, self.desc, self.n_shards = total, desc, n_shards
        self.enabled, self.interactive = enabled, enabled and sys.stderr.isatty()
        self.done, self.shards, self.start, self.bar = 0, 0, time.monotonic(), None

    def __enter__(self) -> "ShardProgress":
        if self.interactive:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, unit="tok", unit_scale=True, desc=self.desc)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, tokens: int) -> None:
        """``tokens`` more forward tokens processed (the total is an estimate from the plan: it grows
        to the tokens done when a run needs more, so the count never passes it)."""
        self.done += tokens
        if self.done > self.total:
            self.total = self.done
            if self.bar is not None:
                self.bar.total = self.total
        if self.bar is not None:
            self.bar.update(tokens)

    def shard_done(self, tokens: int, reused: bool = False) -> None:
        """A shard finished (``tokens`` not yet counted by :meth:`update`)."""
        self.update(tokens)
        self.shards += 1
        if self.enabled and not self.interactive:
            elapsed = time.monotonic() - self.start
            eta = f"ETA {elapsed / self.done * max(0, self.total - self.done):.0f} s" if self.done and not reused else "ETA -"
            print(f"{self.desc}: shard {self.shards}/{self.n_shards} {'reused' if reused else 'done'}, "
                  f"{self.done}/{self.total} tokens, {elapsed:.0f} s elapsed, {eta}", file=sys.stderr, flush=True)
