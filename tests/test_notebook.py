"""The notebooks' helpers (truncsens/api/notebook.py): the checkout is found from a notebook file,
a missing results file is measured by its command, and nothing is run when it exists."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from truncsens.api.notebook import ensure_results, repo_root, show

ROOT = Path(__file__).resolve().parents[1]


def test_repo_root_from_a_notebook_file_and_outside(tmp_path, monkeypatch):
    assert repo_root(ROOT / "notebooks" / "certify.py") == ROOT
    monkeypatch.chdir(ROOT / "docs")
    assert repo_root() == ROOT  # under Jupyter: from the working directory
    with pytest.raises(SystemExit, match="inside the truncsens checkout"):
        repo_root(tmp_path / "elsewhere.py")


def test_ensure_results_measures_only_a_missing_file(tmp_path, capsys):
    writer = tmp_path / "writer.py"  # stands in for `truncsens measure`: writes the file after --out
    writer.write_text("import sys\nargs = sys.argv[1:]\nopen(args[args.index('--out') + 1], 'w').write(' '.join(args))\n")
    out = tmp_path / "r.nc"
    assert ensure_results(out, [sys.executable, str(writer), "--domain", "code"]) == out
    assert out.read_text() == f"--domain code --out {out} --no-progress"
    assert "is missing: measuring it now" in capsys.readouterr().out
    out.write_text("kept")
    ensure_results(out, [sys.executable, "-c", "raise SystemExit(1)"])  # exists: the command is not run
    assert out.read_text() == "kept"


def test_show_prints_the_paths(tmp_path, capsys):
    show([tmp_path / "a.png", tmp_path / "b.pdf"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "a.png"), str(tmp_path / "b.pdf")]
