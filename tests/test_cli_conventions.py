"""One convention for every command: lists by repeats and commas, -h, --json / --json-out,
--plot / --plot-out, --overwrite before computing, a quiet broken pipe, undecided comparisons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from truncsens.cli.errors import BROKEN_PIPE_EXIT, user_errors
from truncsens.cli.main import app
from truncsens.cli.options import float_list, int_list, split_list
from truncsens.results import save
from truncsens.results.constructed import curve_results

runner = CliRunner()
POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ROOT = Path(__file__).resolve().parents[1]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    ds = curve_results({"tv": lambda w: 0.02 * w**-0.5, "kl": lambda w: 1e-3 * w**-1.0}, POW2, n_docs=10, doc_noise=0.1, seed=1)
    return save(ds, root / "code.nc")


def test_lists_accept_repeats_and_commas():
    assert split_list(["a", "b"], "--policy") == split_list(["a,b"], "--policy") == ["a", "b"]
    assert split_list(["a,b", "b", " c "], "--policy") == ["a", "b", "c"]
    assert split_list(None, "--policy") is None and split_list([], "--policy") is None
    assert int_list(["1,2", "4"], "--windows") == [1, 2, 4]
    assert float_list(["0.01", "0.05,0.1"], "--eps") == [0.01, 0.05, 0.1]
    with pytest.raises(ValueError, match="--windows must be comma-separated whole numbers, got '1,four'"):
        int_list(["1,four"], "--windows")
    with pytest.raises(ValueError, match="--policy is empty"):
        split_list([", ,"], "--policy")


def test_fit_and_recommend_lists(code, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert invoke("fit", code, "--metric", "tv", "--metric", "kl", "--family", "power", "--bootstrap", 0, "--out", a).exit_code == 0
    assert invoke("fit", code, "--metric", "tv,kl", "--family", "power", "--bootstrap", 0, "--out", b).exit_code == 0
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert da["settings"]["metrics"] == db["settings"]["metrics"] == ["tv", "kl"]
    assert [f["params"] for f in da["fits"]] == [f["params"] for f in db["fits"]]
    r1 = invoke("recommend-window", a, "--eps", "0.01,0.005", "--metric", "tv,kl", "--json")
    r2 = invoke("recommend-window", a, "--eps", "0.01", "--eps", "0.005", "-m", "tv", "-m", "kl", "--json")
    assert r1.exit_code == 0 and r1.stdout == r2.stdout
    assert [(r["metric"], r["eps"]) for r in json.loads(r1.stdout)["recommendations"]] == [
        ("tv", 0.01), ("tv", 0.005), ("kl", 0.01), ("kl", 0.005)]


def test_dash_h_on_the_app_and_every_command():
    top = invoke("-h")
    assert top.exit_code == 0 and "Usage" in top.stdout
    for cmd in ("measure", "show", "fit", "recommend-window", "plot", "compare-policies", "train-reference"):
        r = invoke(cmd, "-h")
        assert r.exit_code == 0 and "Usage" in r.stdout and "--help" in r.stdout, cmd


def test_overwrite_is_refused_before_computing(code, tmp_path):
    out = tmp_path / "f.json"
    out.write_text("keep me")
    r = invoke("fit", code, "--bootstrap", 0, "--out", out)
    assert r.exit_code == 2 and f"error: {out} already exists: pass --overwrite" in r.stderr
    assert out.read_text() == "keep me"
    assert invoke("fit", code, "--bootstrap", 0, "--out", out, "--overwrite").exit_code == 0
    assert json.loads(out.read_text())["kind"] == "truncsens-fit"
    # figures: fit --plot-out and plot --out refuse the same way
    (tmp_path / "fig.pdf").write_text("old")
    r = invoke("fit", code, "--bootstrap", 0, "--out", tmp_path / "g.json", "--plot-out", tmp_path / "fig")
    assert r.exit_code == 2 and "fig.pdf already exists" in r.stderr and not (tmp_path / "g.json").exists()
    r = invoke("plot", code, "--out", tmp_path / "fig")
    assert r.exit_code == 2 and "--overwrite" in r.stderr and (tmp_path / "fig.pdf").read_text() == "old"
    r = invoke("plot", code, "--out", tmp_path / "fig", "--overwrite", "-m", "tv")
    assert r.exit_code == 0 and (tmp_path / "fig.pdf").stat().st_size > 1000


def test_recommend_window_law_that_barely_decays_no_traceback(tmp_path):
    ds = curve_results({"tv": lambda w: 0.3 * w**-0.001}, POW2, n_docs=6, seed=1)
    path = save(ds, tmp_path / "flat.nc")
    r = invoke("recommend-window", path, "--eps", "0.1", "--bootstrap", 20)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "inf (eps not reachable with this law)" in r.stdout and "Traceback" not in r.output
    r = invoke("recommend-window", path, "--eps", "0.1", "--bootstrap", 20, "--json")
    [rec] = json.loads(r.stdout)["recommendations"]
    assert rec["law_status"] == "not_reachable" and rec["w_law"] is None and rec["window"] is None


def test_broken_pipe_is_quiet(monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdout", io.StringIO())  # no file descriptor: nothing is redirected in this process

    def body():
        with user_errors():
            raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(typer.Exit) as info:
        body()
    assert info.value.exit_code == BROKEN_PIPE_EXIT == 141


def test_show_into_a_closed_pipe_exits_quietly(code):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "truncsens.cli.main", "show", str(code)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line (as `| head -0`)
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=300)
    assert rc in (0, BROKEN_PIPE_EXIT) and "error" not in err and "Traceback" not in err, (rc, err)


def test_compare_policies_json_flag_and_files(tmp_path):
    from truncsens import results
    from truncsens.divergences import METRICS

    rng = np.random.default_rng(0)
    base = np.array([8.0, 16, 32]) ** -1.0
    m = {name: np.zeros((2, 6, 3)) for name in METRICS}
    m["kl"] = np.stack([base * rng.uniform(0.8, 1.2, (6, 3)), 100 * base * rng.uniform(0.8, 1.2, (6, 3))])
    m["tv"] = np.sqrt(m["kl"]) / 4  # TV <= 1 (checked on load)
    ds = results.make_results(m, "budget", [8, 16, 32], [f"d{i // 2}" for i in range(6)], 64 + np.arange(6), np.zeros(6),
                              {**{k: "" for k in results.REQUIRED_ATTRS}, "semantics": "streaming", "positions": "original", "n_sink": 4,
                               "reference_context": 64, "seed": 0, "policy": "sink_recent,random"},
                              policies=["sink_recent", "random"])
    path = results.save(ds, tmp_path / "p.nc")
    r = invoke("compare-policies", path, "--bootstrap", 20, "--fit-range", "8:32", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["policies"] == ["sink_recent", "random"] and not list(tmp_path.glob("*.png"))  # no plot unless --plot
    js = tmp_path / "c.json"
    r = invoke("compare-policies", path, "--bootstrap", 20, "--fit-range", "8:32", "--json-out", js, "--plot", "-m", "kl,tv")
    assert r.exit_code == 0, r.output
    assert json.loads(js.read_text())["metrics"] == ["kl", "tv"] and (tmp_path / "p-policies.png").is_file()
    r = invoke("compare-policies", path, "--bootstrap", 20, "--fit-range", "8:32", "--json-out", js)
    assert r.exit_code == 2 and f"{js} already exists" in r.stderr


def test_compare_policies_counts_an_infinite_kl():
    from truncsens import results
    from truncsens.divergences import METRICS
    from truncsens.report.policy_comparison import CompareConfig, compare_policies
    from truncsens.report.printed import format_comparison

    m = {name: np.full((1, 4, 2), 0.5) for name in METRICS}
    m["kl"][0, 0, 0] = np.inf  # KL values [inf, .5, .5, .5] at budget 8
    ds = results.make_results(m, "budget", [8, 16], ["a", "a", "b", "b"], 64 + np.arange(4), np.zeros(4),
                              {**{k: "" for k in results.REQUIRED_ATTRS}, "semantics": "streaming", "positions": "original", "n_sink": 0,
                               "reference_context": 64, "seed": 0, "policy": "suffix"}, policies=["suffix"])
    cmp = compare_policies(ds, CompareConfig(metrics=("kl",), n_boot=0))
    row8, row16 = cmp.table
    assert (row8["mean"], row8["n_inf"]) == (float("inf"), 1) and (row16["mean"], row16["n_inf"]) == (0.5, 0)
    assert "inf (n_inf 1)" in format_comparison(cmp)


@pytest.mark.parametrize("argv, says", [
    (["measure", "--chunk", "abc"], "--chunk takes a whole number, got 'abc'"),
    (["measure", "--bogus"], "--bogus"),
    (["nosuchcommand"], "'nosuchcommand'"),
    (["show"], "'file'"),
])
def test_usage_errors_are_one_error_line_exit_2(capsys, argv, says):
    from truncsens.cli.main import run

    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err
    assert "╭" not in err  # no framed box


@pytest.mark.parametrize("argv, says", [
    (["measure", "--draws", "two"], "error: --draws takes a whole number, got 'two' (see 'truncsens measure -h')\n"),
    (["measure", "--chunk=1.5"], "error: --chunk takes a whole number, got '1.5' (see 'truncsens measure -h')\n"),
    (["certify", "--delta", "abc"], "error: --delta takes a number, got 'abc' (see 'truncsens certify -h')\n"),
])
def test_a_value_that_does_not_parse_is_said_plainly(capsys, argv, says):
    """The parser's own wording ("Input should be a valid integer, unable to parse string as an
    integer") is replaced by what the option takes and the value given."""
    from truncsens.cli.main import run

    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code == 2 and capsys.readouterr().err == says


def test_console_script_help_and_version_exit_0(capsys):
    from truncsens.cli.main import run

    for argv in (["-h"], ["--version"], ["measure", "-h"]):
        with pytest.raises(SystemExit) as exit_info:
            run(argv)
        assert exit_info.value.code == 0, argv
    assert "truncsens 0.1" in capsys.readouterr().out


def test_a_bad_window_is_named_before_the_output_is_looked_at(tmp_path):
    """--windows 0 with an existing --out: the window is the error (it is wrong whatever the output),
    named by its option, and the existing file is untouched."""
    out = tmp_path / "r.nc"
    out.write_text("keep me")
    r = invoke("measure", "--windows", "4,0,-2", "--out", out)
    assert r.exit_code == 2 and "error: windows (--windows) must be at least 1 token each, got 0, -2" in r.stderr
    assert out.read_text() == "keep me"


def test_help_says_what_an_option_is_not_what_it_was():
    """Usage text describes the present tool; what a thing was belongs to CHANGELOG.md."""
    import re

    from typer.main import get_command

    history = re.compile(r"earlier version|formerly|used to be|previously|no longer|was before|until this change", re.I)
    commands = get_command(app).commands
    texts = {f"{name} {p.opts[0] if getattr(p, 'opts', None) else ''}".strip(): getattr(p, "help", None) or ""
             for name, cmd in commands.items() for p in cmd.params}
    texts |= {name: cmd.help or "" for name, cmd in commands.items()}
    assert len(texts) > 50
    assert sorted(k for k, text in texts.items() if history.search(text)) == []


def test_wide_tables_fit_a_terminal_of_known_width(code, tmp_path, monkeypatch):
    """recommend-window's table (about 170 characters) wraps in a 100-column terminal: with COLUMNS set it
    is split into tables of at most 100 characters, each keeping the curve column; its warnings and notes
    go to stderr. Without a known width (CliRunner's output is no terminal) the table prints whole."""
    fit_file = tmp_path / "f.json"
    assert invoke("fit", code, "--bootstrap", 20, "--out", fit_file).exit_code == 0
    monkeypatch.delenv("COLUMNS", raising=False)
    whole = invoke("recommend-window", fit_file, "--eps", "0.0001,0.01", "-m", "tv,kl")
    assert whole.exit_code == 0 and max(len(line) for line in whole.stdout.splitlines() if not line.startswith("window:")) > 100
    assert "warning: " in whole.stderr and "warning: " not in whole.stdout and "note: " not in whole.stdout
    monkeypatch.setenv("COLUMNS", "100")
    narrow = invoke("recommend-window", fit_file, "--eps", "0.0001,0.01", "-m", "tv,kl")
    assert narrow.exit_code == 0 and max(map(len, narrow.stdout.splitlines())) <= 100  # the legend wrapped too
    table = narrow.stdout.split("\nwindow: ")[0].splitlines()
    assert sum(line.startswith("curve ") for line in table) >= 2  # several tables, each headed by the curve column
    assert narrow.stderr == whole.stderr
    from truncsens.report.tables import _WIDTH

    assert _WIDTH == [None]  # the width was the command's alone: the API's tables, later in the process, print whole


def test_a_report_prints_its_notes_and_warnings_on_stderr(capsys):
    """Notes and warnings inside a printed report (indented or not) go to stderr without their indent;
    the rest, blank lines included, stays on stdout as it was."""
    from truncsens.cli.options import echo_report

    echo_report("table\n  row\n  note: layer 1: at the floor\n\nwarning: a tv: beyond\nnote: x\nnotes: kept")
    out, err = capsys.readouterr()
    assert out == "table\n  row\n\nnotes: kept\n"
    assert err == "note: layer 1: at the floor\nwarning: a tv: beyond\nnote: x\n"
