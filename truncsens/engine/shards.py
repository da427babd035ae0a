"""Shard files of a run: ``<out>.shards/shard-00000.nc`` per group of documents, resumable, merged
into the results file at the end.

An interrupted run loses at most the shard in flight; ``resume`` skips shards already written after
checking (``run.json``) that they come from the same configuration. Under a multi-process launch each
process computes the shards it owns (round robin) and rank 0 merges.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from truncsens import results
from truncsens.engine.config import MeasureError
from truncsens.engine.distributed import current_ranks
from truncsens.targets import TargetSet, TokenDoc, select_targets


class MeasureInterrupted(RuntimeError):
    """The run stopped before all shards were written (used by tests to simulate a crash)."""


def shard_dir_for(out: str | Path) -> Path:
    """The shard folder of results file ``out``: ``<out>.shards``."""
    return Path(str(out) + ".shards")


def kept_shards(out: str | Path) -> list[Path]:
    """Finished shard files of an unfinished run writing ``out`` (sorted; empty when there are none)."""
    folder = shard_dir_for(out)
    return sorted(folder.glob("shard-*.nc")) if folder.is_dir() else []


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

    Returns:
        (path of the merged file, shards reused, number of targets; -1 on ranks other than 0).

    Raises:
        MeasureError: ``out`` is a folder, or shards of another run / without ``resume``.
    """
    out = Path(out)
    if out.is_dir():  # found now, not at the merge after every shard has been computed
        raise MeasureError(f"--out {out} is a folder; give a results file path such as {out / 'results.nc'}")
    shard_dir = shard_dir_for(out)
    ranks = current_ranks()
    prepare_shard_dir(shard_dir, fingerprint, resume, write=False)
    ranks.barrier()  # every rank has checked before rank 0 writes
    if ranks.is_main:
        prepare_shard_dir(shard_dir, fingerprint, resume)
    ranks.barrier()
    groups = [docs[i : i + docs_per_shard] for i in range(0, len(docs), docs_per_shard)]
    plans = [select_targets(g, reference_context, targets_per_doc, seed) for g in groups]
    reused, written = 0, 0
    from tqdm.auto import tqdm

    mine = [i for i in range(len(plans)) if ranks.owns(i)]
    total = sum(len(plans[i]) for i in mine) * tokens_per_target
    with tqdm(total=total, unit="tok", unit_scale=True, desc=desc, disable=not (progress and ranks.is_main)) as bar:
        for i in mine:
            plan = plans[i]
            path = shard_dir / f"shard-{i:05d}.nc"
            if path.is_file():
                reused += 1
                bar.update(len(plan) * tokens_per_target)
                continue
            results.save(compute_shard(plan, bar.update), path)
            written += 1
            if stop_after_shards is not None and written >= stop_after_shards and i + 1 < len(plans):
                raise MeasureInterrupted(f"stopped after {written} shards; resume with --resume")
    ranks.barrier()
    if not ranks.is_main:
        return out, reused, -1
    parts = [results.load(shard_dir / f"shard-{i:05d}.nc") for i in range(len(plans))]
    merged = results.merge(parts)
    merged.attrs["n_clamped"] = int(sum(int(p.attrs.get("n_clamped", 0)) for p in parts))
    merged.attrs["created"] = results.utc_now()
    merged.attrs["n_docs"] = len(docs)
    results.save(merged, out)
    shutil.rmtree(shard_dir, ignore_errors=True)
    return out, reused, int(merged.sizes["target"])
