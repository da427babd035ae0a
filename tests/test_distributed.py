"""Several processes (accelerate launch, torchrun; gloo on the CPU) split the shards; rank 0 merges the
same file a single process writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from truncsens import results
from truncsens.divergences import METRICS
from truncsens.engine.run.distributed import Ranks, current_ranks, process_device
from truncsens.engine.config import MeasureConfig
from truncsens.engine.measure import run_measure


def test_ranks_single_process_and_ownership(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    r = current_ranks()
    assert (r.index, r.count, r.is_main) == (0, 1, True)
    two = Ranks(index=1, count=2, local_index=1)
    assert [i for i in range(5) if two.owns(i)] == [1, 3]
    assert process_device("cuda", two) == "cuda:1"
    assert process_device("cuda:0", two) == "cuda:0" and process_device("cpu", two) == "cpu"
    assert process_device("cuda", Ranks()) == "cuda"


def test_two_processes_write_the_same_file(tiny_llama_dir, corpus_dir, tmp_path):
    common = ["--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64", "--windows", "1,4,16",
              "--targets-per-doc", "3", "--docs-per-shard", "1", "--no-progress"]
    single = tmp_path / "single.nc"
    run_measure(MeasureConfig(model=tiny_llama_dir, corpus=corpus_dir, reference_context=64, windows=[1, 4, 16],
                              targets_per_doc=3, docs_per_shard=1, out=str(single), progress=False))
    multi = tmp_path / "multi.nc"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "truncsens.cli.main", "measure", *common,
         "--out", str(multi)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("wrote ") == 1  # only rank 0 reports
    a, b = results.load(single), results.load(multi)
    for name in METRICS:
        np.testing.assert_allclose(a[name].values, b[name].values, atol=1e-6)
    np.testing.assert_array_equal(a["doc"].values, b["doc"].values)
    assert not (tmp_path / "multi.nc.shards").exists()


def torchrun(n: int, args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                             "-m", "truncsens.cli.main", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


def test_torchrun_three_processes_equal_one_and_resume_after_a_kill(tiny_llama_dir, corpus_dir, tmp_path):
    """torchrun on the CPU (gloo): exactly the documents and values of a single-process run; killed
    mid-run under the launcher and resumed, the same again."""
    common = ["measure", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
              "--windows", "1,4,16", "--targets-per-doc", "3", "--docs-per-shard", "1", "--no-progress"]
    single = tmp_path / "single.nc"
    run_measure(MeasureConfig(model=tiny_llama_dir, corpus=corpus_dir, reference_context=64, windows=[1, 4, 16],
                              targets_per_doc=3, docs_per_shard=1, out=str(single), progress=False))
    a = results.load(single)

    def same_as_single(path) -> None:
        b = results.load(path)
        np.testing.assert_array_equal(a["doc"].values, b["doc"].values)
        np.testing.assert_array_equal(a["position"].values, b["position"].values)
        for name in METRICS:
            np.testing.assert_allclose(a[name].values, b[name].values, atol=1e-6, err_msg=name)
        assert float(b["tv"].sel(window=1).mean()) == pytest.approx(float(a["tv"].sel(window=1).mean()), abs=1e-6)
        assert float(b["tv"].min()) > 0  # no zeroed rows

    multi = tmp_path / "multi.nc"
    proc = torchrun(3, [*common, "--out", str(multi)])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("wrote ") == 1  # only rank 0 reports
    same_as_single(multi)

    killed = tmp_path / "killed.nc"
    proc = torchrun(2, [*common, "--out", str(killed)], start_new_session=True)
    shards = Path(str(killed) + ".shards")
    deadline = time.monotonic() + 240
    while len(list(shards.glob("shard-*.nc"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    if killed.exists():  # the run outran the kill: nothing to resume, and the file must be complete
        same_as_single(killed)
        return
    assert 0 < len(list(shards.glob("shard-*.nc"))) < 6
    resumed = torchrun(2, [*common, "--out", str(killed), "--resume"])
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert "shards reused" in out
    same_as_single(killed)


def test_launch_environment_and_a_disagreeing_process_group(monkeypatch):
    from truncsens.engine.run import distributed
    assert distributed.launch_environment({}) == (0, 1, 0)
    assert distributed.launch_environment({"WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "0"}) == (2, 3, 0)
    with pytest.raises(distributed.LaunchError, match="RANK is not"):
        distributed.launch_environment({"WORLD_SIZE": "2"})
    with pytest.raises(distributed.LaunchError, match="rank 3 of WORLD_SIZE=2"):
        distributed.launch_environment({"WORLD_SIZE": "2", "RANK": "3"})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(distributed, "_join_group", lambda device: None)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    with pytest.raises(distributed.LaunchError, match="announced rank 1 of 2 processes but the process group sees rank 0 of 1"):
        distributed.current_ranks()
