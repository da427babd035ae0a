"""benchmarks/command_times.py: one line per command with its exit code, wall and CPU seconds and the
load around it, after a line naming the machine; a failed command makes the run exit 1."""

import importlib.util
import sys
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("command_times", Path(__file__).parents[1] / "benchmarks" / "command_times.py")
times = importlib.util.module_from_spec(SPEC)
sys.modules["command_times"] = times  # its dataclass looks its module up
SPEC.loader.exec_module(times)


def test_a_timing_prints_seconds_minutes_load_and_the_command():
    line = times.format_timing(times.Timing("truncsens measure", 0, 90.04, 150.26, 2.04, 3.96))
    assert line == "    90.0 s wall (1.5 min)     150.3 s CPU  load 2.0 -> 4.0  exit 0  $ truncsens measure"


def test_each_command_is_timed_in_order_and_a_failure_is_the_exit_status(capsys):
    spin = "python -c 'sum(range(3 * 10**6))'"
    rc = times.main(["--commands", spin, "test -d {tmp}", "exit 3"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert lines[0].startswith("machine: ") and "CPUs" in lines[0] and "OMP_NUM_THREADS=" in lines[0]
    assert [line.split("  $ ", 1)[1] for line in lines[1:]] == [spin, "test -d {tmp}", "exit 3"]
    assert [line.split("exit ", 1)[1].split()[0] for line in lines[1:]] == ["0", "0", "3"]  # {tmp} is a folder
    wall, cpu = (float(lines[1].split(" s wall")[0]), float(lines[1].split("s CPU")[0].split(")")[-1]))
    assert wall > 0 and cpu > 0  # the child's own CPU time is counted
