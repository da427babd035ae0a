"""The run skeleton (truncsens.engine.run.skeleton) on its own: a fake shard computation (no model)
checks what every driver relies on: which shards are computed, resumed, refused, merged."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from truncsens import results
from truncsens.divergences import METRICS
from truncsens.engine.config import MeasureError
from truncsens.engine.run.lock import OutputLock
from truncsens.engine.run.shards import MeasureInterrupted, shard_dir_for
from truncsens.engine.run.skeleton import ShardedRun, ShardWork, run_sharded
from truncsens.targets import TokenDoc, select_targets

N = 8
ATTRS = {"truncsens_version": "0", "model": "fake", "model_revision": "", "tokenizer": "", "dtype": "float32",
         "device": "cpu", "semantics": "reencode", "positions": "original", "n_sink": 0, "reference_context": N,
         "corpus": "fake", "corpus_sha256": "", "domain": "code", "seed": 0, "created": "", "command": "test"}


def docs(n: int = 5) -> list[TokenDoc]:
    return [TokenDoc(f"d{i}", torch.arange(i, i + 20)) for i in range(n)]


class FakeShards:
    """compute_shard: metric kl = the target's token id (so the merged file shows where each value came
    from); records the documents of every shard it computes; n_clamped 1 per target."""

    def __init__(self) -> None:
        self.computed: list[list[str]] = []

    def __call__(self, plan, on_tokens):
        self.computed.append(sorted(set(plan.doc)))
        n = len(plan)
        ids = plan.token_id.numpy().astype(np.float64)[:, None]  # [n, 1]
        metrics = {m: (ids if m == "kl" else np.zeros((n, 1))) for m in METRICS}
        on_tokens(n * 3)
        return results.make_results(metrics, "window", [4], plan.doc, plan.position, plan.token_id.numpy(),
                                    {**ATTRS, "n_clamped": n})


def sharded(out, compute, fingerprint=None, **options) -> ShardedRun:
    work = ShardWork(compute, tokens_per_target=3, label="fake")
    return ShardedRun(out, docs(), N, fingerprint or {"a": 1}, work, targets_per_doc=2, seed=0, docs_per_shard=2,
                      **options)


def test_a_sharded_run_merges_every_target_in_order(tmp_path):
    out = tmp_path / "r.nc"
    compute = FakeShards()
    done = run_sharded(sharded(out, compute, progress=False))
    assert done == (out, 0, 10)  # 5 docs x 2 targets, no shard reused
    assert compute.computed == [["d0", "d1"], ["d2", "d3"], ["d4"]]  # 2 documents per shard
    ds = results.load(out)
    plan = select_targets(docs(), N, 2, 0)
    assert [str(d) for d in ds["doc"].values] == list(plan.doc)
    np.testing.assert_array_equal(ds["kl"].values[:, 0], plan.token_id.numpy())
    assert ds.attrs["n_clamped"] == 10 and ds.attrs["n_docs"] == 5 and ds.attrs["created"] != ""
    assert "run_fingerprint" not in ds.attrs and "shard_index" not in ds.attrs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.nc"]  # no shards, no lock left


def test_resume_computes_only_the_missing_shards(tmp_path, capsys):
    out = tmp_path / "r.nc"
    first = FakeShards()
    with pytest.raises(MeasureInterrupted):
        run_sharded(sharded(out, first, progress=False), stop_after_shards=1)
    assert first.computed == [["d0", "d1"]] and (shard_dir_for(out) / "shard-00000.nc").is_file()
    with pytest.raises(MeasureError, match="pass --resume"):
        run_sharded(sharded(out, FakeShards(), progress=False))
    with pytest.raises(MeasureError, match=r"different configuration \(a differ\)"):
        run_sharded(sharded(out, FakeShards(), fingerprint={"a": 2}, resume=True, progress=False))
    second = FakeShards()
    done = run_sharded(sharded(out, second, resume=True, progress=True))
    assert done == (out, 1, 10) and second.computed == [["d2", "d3"], ["d4"]]
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln.split(",")[0] for ln in lines] == ["fake: shard 1/3 reused", "fake: shard 2/3 done", "fake: shard 3/3 done"]
    assert "30/30 tokens" in lines[-1]  # 10 targets x 3 tokens
    fresh = tmp_path / "fresh.nc"
    run_sharded(sharded(fresh, FakeShards(), progress=False))
    np.testing.assert_array_equal(results.load(out)["kl"].values, results.load(fresh)["kl"].values)


def test_a_finished_file_is_refused_and_a_failed_first_shard_leaves_nothing(tmp_path):
    out = tmp_path / "r.nc"
    run_sharded(sharded(out, FakeShards(), progress=False))
    with pytest.raises(MeasureError, match="already exists: pass --overwrite"):
        run_sharded(sharded(out, FakeShards(), progress=False))

    def broken(plan, on_tokens):
        raise RuntimeError("boom")

    other = tmp_path / "o.nc"
    with pytest.raises(RuntimeError, match="boom"):
        run_sharded(sharded(other, broken, progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.nc"]


def test_finish_runs_on_the_merged_file_under_the_lock_and_an_interrupted_finish_resumes(tmp_path):
    """``finish`` sees the merged Dataset with the lock held and the shards still there; an
    interruption inside it keeps every shard, and ``resume`` then computes no shard again."""
    out = tmp_path / "f.nc"
    seen = {}

    def interrupted(ds):
        raise KeyboardInterrupt

    def finish(ds):
        seen.update(locked=OutputLock(out).path.is_file(), shards=len(list(shard_dir_for(out).glob("shard-*.nc"))),
                    targets=int(ds.sizes["target"]), n_docs=ds.attrs["n_docs"])
        ds["extra"] = (("step",), np.arange(3.0))
        return ds

    with pytest.raises(KeyboardInterrupt):
        run_sharded(sharded(out, FakeShards(), progress=False, finish=interrupted))
    assert sorted(p.name for p in shard_dir_for(out).glob("shard-*.nc")) == [
        "shard-00000.nc", "shard-00001.nc", "shard-00002.nc"] and not out.exists()
    again = FakeShards()
    done = run_sharded(sharded(out, again, resume=True, progress=False, finish=finish))
    assert done == (out, 3, 10) and again.computed == []
    assert seen == {"locked": True, "shards": 3, "targets": 10, "n_docs": 5}
    ds = results.load(out)
    np.testing.assert_array_equal(ds["extra"].values, [0.0, 1.0, 2.0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.nc"]
