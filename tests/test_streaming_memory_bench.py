"""benchmarks/streaming_memory.py: which paths a policy runs, their lengths, the fitted exponent of
peak memory in T, and one run of the online (h2o) path."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("streaming_memory",
                                              Path(__file__).parents[1] / "benchmarks" / "streaming_memory.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_exponent_of_known_growths():
    """The least-squares slope of log memory on log T: 1 for linear, 2 for quadratic, 0 for flat."""
    T = [2048, 4096, 8192, 16384]
    assert bench.exponent(T, [3.0 * t for t in T]) == pytest.approx(1.0)
    assert bench.exponent(T, [t * t / 1e6 for t in T]) == pytest.approx(2.0)
    assert bench.exponent(T, [5.0] * 4) == pytest.approx(0.0, abs=1e-12)
    assert bench.exponent([2048, 16384], [10.0, 80.0 * 2 ** 0.3]) == pytest.approx(1.1)


def test_paths_and_lengths_per_policy():
    """h2o (online scores) runs the online path at --online-lengths; score-free policies the evict path
    at --lengths and the dense one up to 4k."""
    assert bench.path_of("h2o") == ("online",)
    assert bench.path_of("sink_recent") == ("evict", "dense")
    args = argparse.Namespace(lengths=[1024, 4096, 16384], online_lengths=[2048, 4096, 8192, 16384])
    assert bench.lengths_of("online", args) == [2048, 4096, 8192, 16384]
    assert bench.lengths_of("evict", args) == [1024, 4096, 16384]
    assert bench.lengths_of("dense", args) == [1024, 4096]


def test_one_online_run():
    """The online path runs h2o's sequential stream: a peak, no separate decision time."""
    r = bench.run_once("online", "h2o", 96, 16, "cpu")
    assert r["decide_s"] is None and r["forward_s"] > 0 and r["mem_mib"] >= 0


PEAK_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("streaming_memory", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
block = b"\\x01" * (64 << 20)  # 64 MiB touched
del block
before = bench.peak_rss_bytes()
bench.reset_peak_rss()
print(json.dumps([before, bench.peak_rss_bytes(), bench.rss_bytes()]))
"""


def test_the_peak_is_reset_before_a_run():
    """A peak reached before the run (building the model, 64 MiB here) does not count as the run's:
    after the reset the peak is the current resident set, within a few MiB. In a fresh process: in
    this one, earlier tests may have left a higher peak and freed memory the block reuses unseen."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, SPEC.origin], capture_output=True, text=True, check=True,
                         timeout=300)
    before, after, current = json.loads(out.stdout)
    assert before - after > 48 << 20
    assert abs(after - current) < 8 << 20
