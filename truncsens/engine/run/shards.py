"""Shard files of a run: ``<out>.shards/shard-00000.nc`` per group of documents, resumable, merged
into the results file at the end (by :func:`truncsens.engine.run.skeleton.run_sharded`), and the
progress a run reports.

An interrupted run loses at most the shard in flight; ``resume`` skips shards already written after
checking (``run.json``) that they come from the same configuration. Under a multi-process launch each
process computes the shards it owns (round robin) and rank 0 merges. A run owns its output while it
runs (:class:`~truncsens.engine.run.lock.OutputLock`), and the merge refuses any shard set that is
not exactly the run's: every shard carries the run's configuration hash and must hold exactly the
targets planned for it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from truncsens import results
from truncsens.engine.config import MeasureError
from truncsens.results.paths import check_creatable, write_atomic
from truncsens.targets import TargetSet

SHARD_ONLY_ATTRS = ("run_fingerprint", "shard_index")


class MeasureInterrupted(RuntimeError):
    """The run stopped before all shards were written (used by tests to simulate a crash)."""


_RESUMABLE = "truncsens_shards_resumable"


def mark_resumable(exc: BaseException) -> None:
    """Record on ``exc`` that it stopped a run after the run's checks had passed, so the shards in its
    folder are this run's own and ``--resume`` continues them (:func:`resumable`)."""
    try:
        setattr(exc, _RESUMABLE, True)
    except AttributeError:  # an exception type without instance attributes
        pass


def resumable(exc: BaseException) -> bool:
    """Whether ``exc`` stopped a run whose kept shards ``--resume`` continues: False for a run refused
    before its own shards were started (another run holds the output, shards of another run or a
    damaged shard: their messages say what to do)."""
    return bool(getattr(exc, _RESUMABLE, False))


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
        MeasureError: ``out`` exists (naming the options), is a folder, or cannot be created (a
            folder on its path is a file, or its folder is not writable).
    """
    out = Path(out)
    if out.is_dir():
        raise MeasureError(f"out (--out) {out} is a folder; give a results file path such as {out / 'results.nc'}")
    try:
        check_creatable(out)
    except OSError as exc:
        raise MeasureError(f"out (--out): {exc}") from None
    if out.exists() and not overwrite and not (resume and kept_shards(out)):
        raise MeasureError(f"{out} already exists: pass --overwrite to replace it, or choose another --out")


def check_shards(parts: list, plans: list[TargetSet], run_hash: str, shard_dir: Path) -> None:
    """Every shard is of this run and holds exactly its planned targets, in order.

    Raises:
        MeasureError: a shard of another configuration, or with missing / extra / other targets
            (naming the shard file to delete).
    """
    for i, (part, plan) in enumerate(zip(parts, plans)):
        check_shard(part, plan, run_hash, shard_dir / f"shard-{i:05d}.nc", "refusing to merge")


def check_shard(part, plan: TargetSet, run_hash: str, name: Path, refusal: str) -> None:
    """Shard file ``name`` (loaded: ``part``) is of this run and holds exactly the targets of ``plan``.

    Raises:
        MeasureError: ``<refusal>: <name> ...`` naming what is wrong and that file to delete.
    """
    delete = f"delete {name} (only that file: the other shards are kept) and rerun with --resume"
    if part.attrs.get("run_fingerprint") != run_hash:
        raise MeasureError(f"{refusal}: {name} was written by a run of another configuration (another run wrote "
                           f"into the same output?); {delete}")
    docs = [str(d) for d in part["doc"].values]
    if docs != list(plan.doc) or not np.array_equal(part["position"].values, plan.position):
        raise MeasureError(f"{refusal}: {name} holds {len(docs)} targets of documents "
                           f"{sorted(set(docs))[:3]}..., not the {len(plan)} targets planned for it; {delete}")


def check_kept_shards(shard_dir: Path, plans: list[TargetSet], run_hash: str) -> None:
    """Before a resumed run computes anything: every shard file already in ``shard_dir`` can be read,
    is named for one of this run's shards, carries this run's configuration hash and holds exactly
    the targets planned for it (so a shard cut short, damaged, or left by another run is named now,
    not at the merge after every other shard was computed).

    Raises:
        MeasureError: ``cannot resume: <shard file> ...``, naming the one file to delete.
    """
    for path in sorted(shard_dir.glob("shard-*.nc")) if shard_dir.is_dir() else []:
        delete = f"delete {path} (only that file: the other shards are kept) and rerun with --resume"
        match = re.fullmatch(r"shard-(\d+)\.nc", path.name)
        if match is None or int(match.group(1)) >= len(plans):
            raise MeasureError(f"cannot resume: {path} is not one of this run's {len(plans)} shards "
                               f"(shard-00000.nc to shard-{len(plans) - 1:05d}.nc); {delete}")
        try:
            part = results.load(path)
        except (results.ResultsError, OSError) as exc:
            why = str(exc).removeprefix(f"{path}: ")
            raise MeasureError(f"cannot resume: {path} cannot be read (a shard cut short or damaged: {why}); "
                               f"{delete}") from None
        check_shard(part, plans[int(match.group(1))], run_hash, path, "cannot resume")


def prepare_shard_dir(shard_dir: Path, fingerprint: dict, resume: bool, write: bool = True) -> None:
    """Check that ``shard_dir`` holds no shards, or (``resume``) shards of this very configuration;
    then (``write``) create it and record the configuration in ``run.json``.

    Raises:
        MeasureError: shards without ``resume``, or shards of another configuration.
        NoSpaceError: the disk is full (``run.json`` is not written).
    """
    spec = shard_dir / "run.json"
    if shard_dir.exists() and any(shard_dir.glob("shard-*.nc")):
        if not resume:
            raise MeasureError(
                f"an earlier run left shards in {shard_dir}: pass --resume to continue it, or delete the folder to start over")
        old = json.loads(spec.read_text()) if spec.is_file() else None
        if old != fingerprint:
            diff = sorted(k for k in set(fingerprint) | set(old or {}) if (old or {}).get(k) != fingerprint.get(k))
            if "model_sha256" in diff and old is not None and "model_sha256" not in old:
                raise MeasureError(
                    f"cannot resume: the shards in {shard_dir} record no content hash of their model (an older truncsens "
                    "wrote them), so they cannot be checked against these weights; delete the folder to start over")
            if {"model_sha256", "model_revision"} & set(diff) and (old or {}).get("model") == fingerprint.get("model"):
                raise MeasureError(
                    f"cannot resume: model {fingerprint.get('model')!r} is not the one the shards in {shard_dir} were "
                    "computed with (its content hash or revision differs: the checkpoint was replaced or changed); "
                    "delete the folder to start over with this model")
            raise MeasureError(
                f"cannot resume: the shards in {shard_dir} come from a different configuration ({', '.join(diff)} differ); "
                f"the shards have {_values(old, diff)}, this run {_values(fingerprint, diff)}; "
                "rerun with the same options or delete the folder")
    if write:
        write_atomic(spec, json.dumps(fingerprint, indent=2, sort_keys=True).encode())  # creates the folder


def _values(fingerprint: dict | None, keys: list[str]) -> str:
    """``key = value, ...`` of ``keys`` in a fingerprint (long values cut to 80 characters)."""
    shown = [(k, repr((fingerprint or {}).get(k)) if k in (fingerprint or {}) else "(none)") for k in keys]
    return ", ".join(f"{k} = {v if len(v) <= 80 else v[:77] + '...'}" for k, v in shown)


class ShardProgress:
    """Progress of a run: a tqdm bar (tokens, ETA) on a terminal; one line per shard on stderr when
    stderr is a file or a pipe (no carriage-return frames in logs); nothing when disabled. ``unit``
    names the parts in those lines (``shard``; ``pass`` for the passes of ``truncsens plan``)."""

    def __init__(self, total: int, desc: str, enabled: bool, n_shards: int, unit: str = "shard") -> None:
        self.total, self.desc, self.n_shards, self.unit = total, desc, n_shards, unit
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
            print(f"{self.desc}: {self.unit} {self.shards}/{self.n_shards} {'reused' if reused else 'done'}, "
                  f"{self.done}/{self.total} tokens, {elapsed:.0f} s elapsed, {eta}", file=sys.stderr, flush=True)
