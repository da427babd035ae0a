"""A resume checks the shards it would reuse before computing anything: a shard of another run under
the same name, or one cut short, was refused only at the merge, after the remaining shards had been
computed, with the advice to delete the whole folder (or, for a cut shard, to "rerun with --resume",
which failed the same way forever). Now the one file to delete is named before any new shard, and
after deleting it ``--resume`` gives the file an uninterrupted run gives, byte for byte. A run
refused because another run holds the output does not advise resuming that run's shards; SIGTERM and
SIGHUP stop a run as Ctrl-C does, with the note naming the kept shards."""

from __future__ import annotations

import os
import signal

import pytest
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.measure import run_measure
from truncsens.engine.run.lock import OutputLock
from truncsens.engine.run.shards import MeasureInterrupted, shard_dir_for

NOW = "2026-01-01T00:00:00+00:00"


def _config(model_dir, corpus_dir, out, resume=False, **kw):
    return MeasureConfig(**{"model": model_dir, "corpus": corpus_dir, "reference_context": 64, "windows": [1, 4, 16],
                            "targets_per_doc": 3, "docs_per_shard": 2, "out": str(out), "resume": resume,
                            "progress": False, **kw})


def _shards(out) -> list[str]:
    return sorted(p.name for p in shard_dir_for(out).glob("shard-*.nc"))


@pytest.fixture()
def whole(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch):
    """The bytes of an uninterrupted run (the merge time fixed, so two runs can be compared byte for byte)."""
    monkeypatch.setattr(results, "utc_now", lambda: NOW)
    out = tmp_path / "whole.nc"
    run_measure(_config(tiny_llama_dir, corpus_dir, out))
    return out.read_bytes()


def test_a_foreign_shard_is_named_before_any_shard_is_computed(tiny_llama_dir, corpus_dir, tmp_path, whole):
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_config(tiny_llama_dir, corpus_dir, out), stop_after_shards=1)
    foreign = shard_dir_for(out) / "shard-00000.nc"  # another run's shard under the same name
    ds = results.load(foreign)
    ds.attrs["run_fingerprint"] = "0" * 64
    results.save(ds, foreign)
    with pytest.raises(MeasureError) as refused:
        run_measure(_config(tiny_llama_dir, corpus_dir, out, resume=True))
    message = str(refused.value)
    assert message.startswith(f"cannot resume: {foreign} was written by a run of another configuration"), message
    assert message.endswith(f"delete {foreign} (only that file: the other shards are kept) and rerun with --resume")
    assert _shards(out) == ["shard-00000.nc"] and not out.exists()  # nothing computed
    foreign.unlink()
    assert run_measure(_config(tiny_llama_dir, corpus_dir, out, resume=True)).shards_reused == 0
    assert out.read_bytes() == whole


def test_a_shard_cut_short_is_named_and_resume_then_finishes(tiny_llama_dir, corpus_dir, tmp_path, whole):
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_config(tiny_llama_dir, corpus_dir, out), stop_after_shards=2)
    cut = shard_dir_for(out) / "shard-00001.nc"
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    for _ in range(2):  # the same answer every time, never "rerun with --resume" alone
        with pytest.raises(MeasureError, match=rf"^cannot resume: {cut} cannot be read \(a shard cut short or damaged: "
                                               rf".*\); delete {cut} \(only that file"):
            run_measure(_config(tiny_llama_dir, corpus_dir, out, resume=True))
        assert _shards(out) == ["shard-00000.nc", "shard-00001.nc"]
    cut.unlink()
    assert run_measure(_config(tiny_llama_dir, corpus_dir, out, resume=True)).shards_reused == 1
    assert out.read_bytes() == whole


def test_a_shard_beyond_the_run_is_named(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_config(tiny_llama_dir, corpus_dir, out), stop_after_shards=1)
    extra = shard_dir_for(out) / "shard-00007.nc"
    extra.write_bytes((shard_dir_for(out) / "shard-00000.nc").read_bytes())
    with pytest.raises(MeasureError, match=rf"cannot resume: {extra} is not one of this run's 3 shards"):
        run_measure(_config(tiny_llama_dir, corpus_dir, out, resume=True))
    assert _shards(out) == ["shard-00000.nc", "shard-00007.nc"]


def measure_args(model_dir, corpus_dir, out, *more) -> list[str]:
    return ["measure", "--model", model_dir, "--corpus", corpus_dir, "--reference-context", "64", "--windows", "1,4,16",
            "--targets-per-doc", "3", "--docs-per-shard", "2", "--no-progress", "--out", str(out), *more]


def test_the_run_refused_by_the_lock_does_not_advise_resuming_the_other_runs_shards(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):  # the other run's shards: another configuration
        run_measure(_config(tiny_llama_dir, corpus_dir, out, windows=[2, 8]), stop_after_shards=1)
    with OutputLock(out):  # and that run is writing now
        r = CliRunner().invoke(app, measure_args(tiny_llama_dir, corpus_dir, out))
    assert r.exit_code == 2 and "another truncsens run is writing" in r.stderr, r.output
    assert "note:" not in r.stderr and "--resume" not in r.stderr, r.stderr
    assert _shards(out) == ["shard-00000.nc"]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_keeps_the_shards_with_the_note_ctrl_c_prints(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch,
                                                                   signame):
    sig = getattr(signal, signame)
    out = tmp_path / "r.nc"
    real_save = results.save

    def save_then_signal(ds, path):  # the signal arrives once the first shard is written
        written = real_save(ds, path)
        if written.name == "shard-00000.nc":
            os.kill(os.getpid(), sig)
        return written

    monkeypatch.setattr(results, "save", save_then_signal)
    seen = []
    previous = signal.signal(sig, lambda signum, frame: seen.append(signum))  # what the command must replace
    try:
        r = CliRunner().invoke(app, measure_args(tiny_llama_dir, corpus_dir, out))
        assert signal.getsignal(sig) is not None and seen == []  # the command handled it, then restored ours
        restored = signal.getsignal(sig)
    finally:
        signal.signal(sig, previous)
    assert r.exit_code == 128 + sig, r.output
    assert f"note: 1 finished shard(s) kept in {shard_dir_for(out)}; rerun the same command with --resume" in r.stderr
    assert f"stopped by {signame}" in r.stderr
    assert callable(restored) and restored.__name__ == "<lambda>"
    assert _shards(out) == ["shard-00000.nc"] and not out.exists()
    assert not (tmp_path / "r.nc.lock").exists()
    monkeypatch.setattr(results, "save", real_save)
    resumed = CliRunner().invoke(app, measure_args(tiny_llama_dir, corpus_dir, out, "--resume"))
    assert resumed.exit_code == 0 and "1 shard reused" in resumed.stdout, resumed.output


def test_a_failed_merge_keeps_the_shard_merged_from_memory_and_resume_gives_the_same_bytes(
        tiny_llama_dir, corpus_dir, tmp_path, whole, monkeypatch):
    """A single process merges its last shard from memory, without writing and reading it back; when the
    merge fails, that shard is written for --resume, and the resumed file (every shard read from its
    file) equals the uninterrupted run's byte for byte."""
    out = tmp_path / "r.nc"
    real_save = results.save

    def failing_save(ds, path):
        if str(path) == str(out):
            raise OSError(28, "No space left on device", str(path))
        return real_save(ds, path)

    monkeypatch.setattr(results, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        run_measure(_config(tiny_llama_dir, corpus_dir, out))
    assert not out.exists()
    kept = _shards(out)
    assert len(kept) >= 2 and kept[-1] == f"shard-{len(kept) - 1:05d}.nc"  # the last one included
    monkeypatch.setattr(results, "save", real_save)
    assert run_measure(_config(tiny_llama_dir, corpus_dir, out, resume=True)).shards_reused == len(kept)
    assert out.read_bytes() == whole
    assert not shard_dir_for(out).exists()


def test_a_run_of_one_shard_writes_no_shard_file(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch):
    written = []
    real_save = results.save
    monkeypatch.setattr(results, "save", lambda ds, path: written.append(os.path.basename(path)) or real_save(ds, path))
    out = tmp_path / "one.nc"
    run_measure(_config(tiny_llama_dir, corpus_dir, out, docs_per_shard=1000))
    assert written == ["one.nc"]
