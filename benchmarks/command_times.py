"""How long the commands the pages time take here: wall and CPU seconds of each, with the machine
and its load said, so that every time a page quotes comes from one printed record.

Each command runs from the repository root in a subprocess, one after the other. Printed per
command: its exit code, wall seconds, CPU seconds of it and its children (user + system, from
``resource.getrusage(RUSAGE_CHILDREN)``), and the 1-minute load average before and after it. The
header gives the machine: CPU count, processor, Python and torch versions, ``OMP_NUM_THREADS``.

Usage::

    python benchmarks/command_times.py                 # the README's measurements, docs/python.md's example, the tests
    python benchmarks/command_times.py --commands "truncsens measure --domain code --reference-context 2048 --out {tmp}/b.nc"

``{tmp}`` in a command is a temporary folder removed afterwards, so no results file is left behind.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COMMANDS = (
    "truncsens measure --domain code --reference-context 1024 --no-progress --out {tmp}/reference-code.nc",
    "truncsens measure --domain code --reference-context 2048 --no-progress --out {tmp}/reference-code-2048.nc",
    'python -c "$(python reproduce/reference_numbers.py --print-source api-example)"',  # docs/python.md's example
    "python -m pytest -q -p no:cacheprovider",
)


@dataclass(frozen=True)
class Timing:
    """One command's run: ``wall`` and ``cpu`` in seconds, ``load_before`` / ``load_after`` the
    1-minute load average, ``returncode`` its exit status."""

    command: str
    returncode: int
    wall: float
    cpu: float
    load_before: float
    load_after: float


def machine_line() -> str:
    """The machine in one line: CPUs, processor, Python, torch, OMP_NUM_THREADS."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the timing needs no torch of its own
        torch_version = "absent"
    return (f"machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch_version}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


def format_timing(t: Timing) -> str:
    """One printed line per command (minutes beside seconds; the load average before -> after)."""
    return (f"{t.wall:8.1f} s wall ({t.wall / 60:.1f} min)  {t.cpu:8.1f} s CPU  load {t.load_before:.1f} -> "
            f"{t.load_after:.1f}  exit {t.returncode}  $ {t.command}")


def run(command: str, tmp: str) -> Timing:
    """Run one command from the repository root, its output discarded, and time it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command.format(tmp=tmp)], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(command, proc.returncode, wall, cpu, load_before, os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commands", nargs="+", default=list(DEFAULT_COMMANDS),
                    help="bash command lines, run from the repository root in order ({tmp}: a temporary folder)")
    args = ap.parse_args(argv)
    print(machine_line(), flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for command in args.commands:
            timing = run(command, tmp)
            failed += timing.returncode != 0
            print(format_timing(timing), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
