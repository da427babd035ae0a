"""The command line starts without torch: ``--help``, every command's ``-h`` and an argument error that
needs no model import neither torch nor transformers (torch alone costs over a second of CPU), while
the API's names and the metric records stay where they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "xarray")

# runs the console script's entry point on argv, then prints which heavy modules it imported
PROBE = """
import json, sys
from truncsens.cli.main import run
try:
    run(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "imported": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def _probe(*argv: str) -> tuple[int, list[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    *lines, last = proc.stderr.strip().splitlines()
    found = json.loads(last)
    return found["code"], found["imported"], "\n".join(lines)


@pytest.mark.parametrize("argv", [["--help"], ["measure", "-h"], ["compare-policies", "-h"], ["certify", "-h"],
                                  ["fit", "-h"], ["plan", "-h"]])
def test_help_imports_no_torch(argv):
    code, imported, _ = _probe(*argv)
    assert code == 0
    assert imported == []


@pytest.mark.parametrize("argv, says", [
    (["measure", "--windows", "1,x"], "error: --windows "),
    (["measure", "--no-such-option"], "error: No such option: --no-such-option"),
    # values that contradict each other or are out of range, refused from the values alone
    (["measure", "--budgets", "16"], "error: budgets (--budgets) needs policies (--policy NAME)"),
    (["measure", "--semantics", "streaming", "--budgets", "16"], "error: budgets (--budgets) and semantics (--semantics) need policies"),
    (["measure", "--windows", "0,4"], "error: windows (--windows) must be at least 1 token each, got 0"),
    (["measure", "--policy", "h2o", "--windows", "4"], "error: windows (--windows) is for suffix truncation"),
    (["measure", "--targets-per-doc", "0"], "error: targets_per_doc (--targets-per-doc) must be at least 1, got 0"),
    (["measure", "--batch-tokens", "0"], "error: batch_tokens (--batch-tokens) must be at least 1, got 0"),
    (["measure", "--sinks", "-1"], "error: sinks (--sinks) must be >= 0, got -1"),
    (["measure", "--seed", "-1"], "error: seed (--seed) must be >= 0, got -1"),
])
def test_an_argument_error_imports_no_torch(argv, says):
    code, imported, err = _probe(*argv)
    assert code == 2
    assert err.startswith(says)
    assert imported == []


def test_metric_records_are_built_on_first_read():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ("import sys, truncsens.metrics as M\n"
              "before = 'torch' in sys.modules\n"
              "default = M.DEFAULT_METRICS\n"
              "print(before, 'torch' in sys.modules, default, M.NAMES, M.find('kl').upper, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out[:4] == ["False", "False", "('kl',", "'tv')"]
    assert out[-2:] == ["inf", "True"]  # the records are read through torch's divergences
    assert "'kl_reverse'," in out
