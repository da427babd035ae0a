"""An interrupted run resumed with --resume gives the same file as an uninterrupted one."""

from __future__ import annotations

import numpy as np
import pytest

from truncsens import results
from truncsens.divergences import METRICS
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.measure import run_measure
from truncsens.engine.run.shards import MeasureInterrupted


def _config(model_dir, corpus_dir, out, resume=False):
    return MeasureConfig(model=model_dir, corpus=corpus_dir, reference_context=64, windows=[1, 4, 16],
                         targets_per_doc=3, docs_per_shard=2, out=str(out), resume=resume, progress=False)


def test_resume_gives_the_same_file(tiny_llama_dir, corpus_dir, tmp_path):
    full = run_measure(_config(tiny_llama_dir, corpus_dir, tmp_path / "full.nc"))
    assert full.n_docs == 6 and full.n_targets == 18

    part = tmp_path / "part.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_config(tiny_llama_dir, corpus_dir, part), stop_after_shards=1)
    shard_dir = tmp_path / "part.nc.shards"
    assert sorted(p.name for p in shard_dir.glob("shard-*.nc")) == ["shard-00000.nc"]
    assert not part.exists()

    with pytest.raises(MeasureError, match="--resume"):
        run_measure(_config(tiny_llama_dir, corpus_dir, part))
    resumed = run_measure(_config(tiny_llama_dir, corpus_dir, part, resume=True))
    assert resumed.shards_reused == 1
    assert not shard_dir.exists()

    a, b = results.load(tmp_path / "full.nc"), results.load(part)
    for name in METRICS:
        np.testing.assert_array_equal(a[name].values, b[name].values)
    for coord in ("doc", "position", "token_id", "window"):
        np.testing.assert_array_equal(a[coord].values, b[coord].values)
    ignore = {"created", "command"}
    assert {k: v for k, v in a.attrs.items() if k not in ignore} == {k: v for k, v in b.attrs.items() if k not in ignore}


def test_resume_refuses_shards_of_another_configuration(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_config(tiny_llama_dir, corpus_dir, out), stop_after_shards=1)
    other = _config(tiny_llama_dir, corpus_dir, out, resume=True)
    other.windows = [1, 8]
    with pytest.raises(MeasureError, match="windows"):
        run_measure(other)
    assert (tmp_path / "r.nc.shards" / "shard-00000.nc").is_file()  # nothing already written is lost


def test_a_multi_process_resume_reports_every_reused_shard(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch):
    """Rank 0 once counted only the shards it owns. Shards 0 (an interrupted run) and 1, 3, 5
    (rank 1 of 2) exist; rank 0 of 2 resumes, computes 2 and 4 and merges: 4 shards reused."""
    import truncsens.engine.measure as measure_module
    from truncsens.engine.run.distributed import Ranks

    out = tmp_path / "r.nc"

    def cfg(resume):
        c = _config(tiny_llama_dir, corpus_dir, out, resume)
        c.docs_per_shard = 1
        return c

    with pytest.raises(MeasureInterrupted):
        run_measure(cfg(False), stop_after_shards=1)
    monkeypatch.setattr(measure_module, "current_ranks", lambda device: Ranks(index=1, count=2))
    assert run_measure(cfg(True)).shards_reused == 1  # rank 1 saw shard 0 left by the interrupted run
    shards = sorted(p.name for p in (tmp_path / "r.nc.shards").glob("shard-*.nc"))
    assert shards == ["shard-00000.nc", "shard-00001.nc", "shard-00003.nc", "shard-00005.nc"]
    monkeypatch.setattr(measure_module, "current_ranks", lambda device: Ranks(index=0, count=2))
    done = run_measure(cfg(True))
    assert done.shards_reused == 4 and done.n_targets == 18


def test_resume_refuses_another_observation_window(tiny_llama_dir, corpus_dir, tmp_path):
    """--observation-window changes what snapkv keeps: shards of another window are not reused."""
    out = tmp_path / "w.nc"

    def cfg(resume, window=None):
        return MeasureConfig(model=tiny_llama_dir, corpus=corpus_dir, reference_context=64, policies=["snapkv"],
                             semantics="prefill_evict", budgets=[16], targets_per_doc=2, docs_per_shard=2,
                             observation_window=window, out=str(out), resume=resume, progress=False)

    with pytest.raises(MeasureInterrupted):
        run_measure(cfg(False), stop_after_shards=1)
    with pytest.raises(MeasureError, match="observation_window"):
        run_measure(cfg(True, window=8))
    assert run_measure(cfg(True)).shards_reused == 1
