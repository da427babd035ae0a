"""The notebooks' helpers (truncsens/api/notebook.py): the checkout is found from a notebook file, a
missing results file is measured through the API function given, and nothing is run when it exists;
the notebooks call the API, never a subprocess."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import truncsens
from truncsens.api.notebook import ensure_results, repo_root, show

ROOT = Path(__file__).resolve().parents[1]


def test_repo_root_from_a_notebook_file_and_outside(tmp_path, monkeypatch):
    assert repo_root(ROOT / "notebooks" / "certify.py") == ROOT
    monkeypatch.chdir(ROOT / "docs")
    assert repo_root() == ROOT  # under Jupyter: from the working directory
    with pytest.raises(SystemExit, match="inside the truncsens checkout"):
        repo_root(tmp_path / "elsewhere.py")


def test_ensure_results_measures_only_a_missing_file(tmp_path, capsys):
    calls = []

    def measure(**options):  # stands in for truncsens.measure: writes its out
        calls.append(options)
        Path(options["out"]).write_text("measured")

    out = tmp_path / "r.nc"
    assert ensure_results(out, measure, domain="code") == out
    assert calls == [{"out": out, "progress": False, "domain": "code"}] and out.read_text() == "measured"
    assert f"{out} is missing: measuring it now (truncsens.measure(domain='code'))" in capsys.readouterr().out
    out.write_text("kept")
    ensure_results(out, measure, domain="nl")  # exists: nothing is run
    assert len(calls) == 1 and out.read_text() == "kept"


@pytest.mark.parametrize("name", ["reference_truncation.py", "certify.py"])
def test_notebooks_call_the_api(name):
    tree = ast.parse((ROOT / "notebooks" / name).read_text())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"truncsens"}  # no subprocess
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "truncsens"}
    assert used and used <= set(truncsens.__all__), used


def test_show_prints_the_paths(tmp_path, capsys):
    show([tmp_path / "a.png", tmp_path / "b.pdf"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "a.png"), str(tmp_path / "b.pdf")]
