"""Before/after check of the command line: small runs of every command, printed output pinned.

The files in ``tests/golden/`` were first written by the code as it stood before the layout's redesign
(commit e80e457, before issue 18) and rewritten, values only, when the 2,048-context reference model
was installed (issue 20); a change that alters what a command prints fails here. Volatile
parts (ISO timestamps, the package version, elapsed seconds) are masked before comparing, and
progress bars (stderr lines with ``it/s`` or ``%|``) are dropped.

Regenerate only for an intended change of output:
``TRUNCSENS_GOLDEN_WRITE=1 python -m pytest tests/test_cli_golden.py``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from truncsens.cli.main import app

GOLDEN = Path(__file__).parent / "golden"
SMALL = ["--reference-context", "64", "--max-docs", "3", "--targets-per-doc", "2", "--no-progress"]
# (name, argv): run in order in one folder, so later commands read earlier files.
COMMANDS = [
    ("measure", ["measure", *SMALL, "--out", "a.nc"]),
    ("show", ["show", "a.nc"]),
    ("show_json", ["show", "a.nc", "--json", "-m", "tv"]),
    ("fit", ["fit", "a.nc", "--out", "a.fit.json"]),
    ("recommend", ["recommend-window", "a.fit.json", "--eps", "0.05", "--eps", "0.2"]),
    ("measure_stream", ["measure", *SMALL, "--policy", "sink_recent,h2o,poisson", "--semantics", "streaming",
                        "--budgets", "8,16", "--out", "s.nc"]),
    ("compare_stream", ["compare-policies", "s.nc", "--truncation", "a.nc"]),
    ("measure_prefill", ["measure", *SMALL, "--policy", "random,snapkv,topk", "--semantics", "prefill_evict",
                         "--budgets", "8,16", "--out", "p.nc"]),
    ("compare_prefill", ["compare-policies", "p.nc", "--metrics", "kl", "--json"]),
    ("measure_block", ["measure", *SMALL, "--protocol", "block", "--out", "b.nc"]),
    ("show_block", ["show", "b.nc", "-m", "kl"]),
    ("measure_synthetic", ["measure", "--model", "synthetic:0.5", "--max-docs", "4", "--no-progress", "--out", "y.nc"]),
    ("fit_synthetic", ["fit", "y.nc", "--metrics", "tv", "--json"]),
    ("certify", ["certify", "--reference-context", "64", "--max-docs", "2", "--targets-per-doc", "2", "--no-progress",
                 "--out", "c.nc"]),
    ("error_budget", ["measure", *SMALL, "--policy", "h2o", "--budgets", "0", "--out", "e.nc"]),
    ("error_exists", ["measure", *SMALL, "--out", "a.nc"]),
    ("error_missing", ["show", "missing.nc"]),
]
MASKS = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z)?"), "<time>"),
    (re.compile(r"\d+(\.\d+)? ?s elapsed|in \d+(\.\d+)? ?s\b"), "<elapsed>"),
    (re.compile(r'"command": "[^"\n]*"'), '"command": "<command line>"'),  # the test runner's argv
]


def normalise(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "it/s" not in ln and "%|" not in ln and "s/it" not in ln]
    out = "\n".join(lines)
    for pattern, repl in MASKS:
        out = pattern.sub(repl, out)
    return out


def renormalise(golden: str) -> str:
    """A golden file with today's masks applied (masks added later apply to older files too)."""
    for pattern, repl in MASKS:
        golden = pattern.sub(repl, golden)
    return golden


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("golden")
    runner = CliRunner()
    here = os.getcwd()
    os.chdir(folder)
    try:
        return {name: runner.invoke(app, argv) for name, argv in COMMANDS}
    finally:
        os.chdir(here)


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_output_unchanged(outputs, name):
    result = outputs[name]
    got = f"exit {result.exit_code}\n--- stdout\n{normalise(result.stdout)}\n--- stderr\n{normalise(result.stderr)}\n"
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("TRUNCSENS_GOLDEN_WRITE"):
        path.write_text(got)
    assert got == renormalise(path.read_text()), f"output of `truncsens {' '.join(dict(COMMANDS)[name])}` changed"
