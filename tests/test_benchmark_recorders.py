"""The diagnostics benchmarks (benchmarks/certify_misses.py, certify_tail_range.py) stand in for the
estimator the certify probe calls: their recorder must take every argument the probe passes, or the
benchmark fails only when someone reruns it."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from certify_misses import Recorder  # noqa: E402
from truncsens.certificates.estimator import attention_records  # noqa: E402


def test_the_recorder_takes_the_estimators_arguments():
    wanted = [(p.name, p.default) for p in inspect.signature(attention_records).parameters.values()]
    got = [(p.name, p.default) for p in inspect.signature(Recorder.__call__).parameters.values()][1:]  # less self
    assert got == wanted
