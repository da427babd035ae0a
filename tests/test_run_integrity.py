"""A run owns its output: no silent overwrite, one run per output at a time (a lock that names the
holder), merges only of the run's own shards, progress that suits log files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import save_tiny_llama
from truncsens import results
from truncsens.cli.main import app
from truncsens.divergences import METRICS
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.measure import run_measure
from truncsens.engine.run.lock import OutputLock, OutputLockedError
from truncsens.engine.run.shards import MeasureInterrupted, shard_dir_for

runner = CliRunner()


def cfg(model_dir, corpus_dir, out, **kw) -> MeasureConfig:
    return MeasureConfig(**{"model": model_dir, "corpus": corpus_dir, "reference_context": 64, "windows": [1, 8],
                            "targets_per_doc": 2, "docs_per_shard": 2, "out": str(out), "progress": False, **kw})


def measure_args(model_dir, corpus_dir, out) -> list[str]:
    return ["measure", "--model", model_dir, "--corpus", corpus_dir, "--reference-context", "64", "--windows", "1,8",
            "--targets-per-doc", "2", "--docs-per-shard", "1", "--out", str(out)]


def test_existing_results_are_not_overwritten(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    r = runner.invoke(app, measure_args(tiny_llama_dir, corpus_dir, out) + ["--no-progress"])
    assert r.exit_code == 0, r.output
    before = out.read_bytes()
    r = runner.invoke(app, measure_args(tiny_llama_dir, corpus_dir, out) + ["--no-progress"])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: {out} already exists: pass --overwrite to replace it, or choose another --out"
    assert out.read_bytes() == before
    r = runner.invoke(app, measure_args(tiny_llama_dir, corpus_dir, out) + ["--no-progress", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert results.load(out).attrs["created"] != "" and not list(tmp_path.glob("*.tmp"))


def test_resume_may_replace_an_old_file_it_continues(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    run_measure(cfg(tiny_llama_dir, corpus_dir, out))
    with pytest.raises(MeasureInterrupted):
        run_measure(cfg(tiny_llama_dir, corpus_dir, out, windows=[1, 8, 16], overwrite=True), stop_after_shards=1)
    with pytest.raises(MeasureError, match="already exists"):  # neither --overwrite nor --resume
        run_measure(cfg(tiny_llama_dir, corpus_dir, out, windows=[1, 8, 16]))
    run_measure(cfg(tiny_llama_dir, corpus_dir, out, windows=[1, 8, 16], resume=True))
    assert list(results.load(out)["window"].values) == [1, 8, 16]


def test_a_held_lock_is_named_and_released_on_every_exit(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    with OutputLock(out):
        with pytest.raises(OutputLockedError, match=rf"another truncsens run is writing {out}: pid {os.getpid()} on "):
            run_measure(cfg(tiny_llama_dir, corpus_dir, out))
        r = runner.invoke(app, measure_args(tiny_llama_dir, corpus_dir, out) + ["--no-progress"])
        assert r.exit_code == 2 and "another truncsens run is writing" in r.stderr
    assert not out.exists() and not Path(str(out) + ".lock").exists()
    with pytest.raises(MeasureInterrupted):  # a failure releases the lock too
        run_measure(cfg(tiny_llama_dir, corpus_dir, out), stop_after_shards=1)
    assert not Path(str(out) + ".lock").exists()
    run_measure(cfg(tiny_llama_dir, corpus_dir, out, resume=True))
    assert results.load(out).sizes["target"] == 12


def test_merge_refuses_a_shard_of_another_run(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(cfg(tiny_llama_dir, corpus_dir, out), stop_after_shards=1)
    shard = shard_dir_for(out) / "shard-00000.nc"
    ds = results.load(shard)
    own = ds.attrs["run_fingerprint"]
    ds.attrs["run_fingerprint"] = "0" * 64  # as if another configuration had written it
    results.save(ds, shard)
    with pytest.raises(MeasureError, match="shard-00000.nc was written by a run of another configuration"):
        run_measure(cfg(tiny_llama_dir, corpus_dir, out, resume=True))
    assert [p.name for p in shard_dir_for(out).glob("shard-*.nc")] == ["shard-00000.nc"]  # refused before computing
    ds = ds.isel(target=slice(0, 3))  # right configuration, missing targets
    ds.attrs["run_fingerprint"] = own
    results.save(ds, shard)
    with pytest.raises(MeasureError, match="holds 3 targets .* not the 4 targets planned for it"):
        run_measure(cfg(tiny_llama_dir, corpus_dir, out, resume=True))
    assert not out.exists()


def test_progress_in_a_log_file_is_one_line_per_shard(tiny_llama_dir, corpus_dir, tmp_path):
    r = runner.invoke(app, measure_args(tiny_llama_dir, corpus_dir, tmp_path / "r.nc"))  # stderr is not a terminal
    assert r.exit_code == 0, r.output
    lines = [l for l in r.stderr.splitlines() if "shard" in l]
    assert len(lines) == 6 and "\r" not in r.stderr
    assert lines[-1].startswith("measure: shard 6/6 done, ") and " ETA 0 s" in lines[-1]


def test_two_concurrent_runs_on_one_output(tiny_llama_dir, corpus_dir, tmp_path):
    """Two processes, two models, one --out: one finishes, the other exits 2 naming the lock or the
    finished file; the file equals a single run of the winner; no temporary files are left."""
    other = save_tiny_llama(tmp_path / "other", seed=1)
    single = {}
    for name, model in (("a", tiny_llama_dir), ("b", other)):
        single[name] = tmp_path / f"single-{name}.nc"
        run_measure(cfg(model, corpus_dir, single[name], docs_per_shard=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for trial in range(int(os.environ.get("TRUNCSENS_LOCK_TRIALS", "3"))):  # 10 for the acceptance run by hand
        out = tmp_path / f"shared-{trial}.nc"
        procs = {name: subprocess.Popen([sys.executable, "-m", "truncsens.cli.main",
                                          *measure_args(model, corpus_dir, out), "--no-progress"],
                                         stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                 for name, model in (("a", tiny_llama_dir), ("b", other))}
        done = {name: (p.wait(timeout=300), p.stderr.read()) for name, p in procs.items()}
        winners = [n for n, (rc, _) in done.items() if rc == 0]
        assert len(winners) == 1, done
        loser_rc, loser_err = done[{"a": "b", "b": "a"}[winners[0]]]
        assert loser_rc == 2 and ("another truncsens run is writing" in loser_err or "already exists" in loser_err), loser_err
        want, got = results.load(single[winners[0]]), results.load(out)
        for m in METRICS:
            np.testing.assert_array_equal(got[m].values, want[m].values)
        assert got.attrs["model"] == want.attrs["model"]
        assert sorted(p.name for p in tmp_path.iterdir() if f"shared-{trial}" in p.name) == [out.name]  # no temp, lock or shards left


def test_a_run_stopped_before_its_first_shard_leaves_nothing(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch):
    from truncsens.models import load_model

    loaded = load_model(tiny_llama_dir)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loaded.model, "forward", interrupted)
    out = tmp_path / "r.nc"
    with pytest.raises(KeyboardInterrupt):
        run_measure(cfg(tiny_llama_dir, corpus_dir, out), loaded=loaded)
    assert list(tmp_path.iterdir()) == []  # no shard folder, no lock, no temporary file


def test_a_file_finished_while_waiting_for_the_lock_is_not_overwritten(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch):
    """The early check passed (the other run had not finished yet); once the lock is held the file
    exists: the waiting run must refuse, not replace it."""
    import truncsens.engine.measure as driver

    out = tmp_path / "r.nc"
    run_measure(cfg(tiny_llama_dir, corpus_dir, out))
    before = out.read_bytes()
    monkeypatch.setattr(driver, "check_output", lambda *args: None)  # as if checked before the file appeared
    with pytest.raises(MeasureError, match="already exists: pass --overwrite"):
        run_measure(cfg(tiny_llama_dir, corpus_dir, out))
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["r.nc"]


def test_progress_total_grows_to_the_tokens_done(capsys):
    """The planned total is an estimate: a run that needs more tokens never prints done > total or a
    negative ETA."""
    from truncsens.engine.run.shards import ShardProgress

    with ShardProgress(100, "measure", True, 2) as p:
        p.shard_done(60)
        p.shard_done(50)
    lines = capsys.readouterr().err.strip().splitlines()
    assert "shard 1/2 done, 60/100 tokens" in lines[0]
    assert "shard 2/2 done, 110/110 tokens" in lines[1] and lines[1].endswith("ETA 0 s"), lines
