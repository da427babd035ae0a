"""Two processes under ``accelerate launch`` split the shards; rank 0 merges the same file."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from truncsens import results
from truncsens.divergences import METRICS
from truncsens.engine.distributed import Ranks, current_ranks, process_device
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
