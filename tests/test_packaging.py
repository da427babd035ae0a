"""The installed package holds every subpackage of the source tree (a wheel or `pip install .`, not only
an editable install, where the source folders stay importable)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the project supports 3.10: skipped there)

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "truncsens").rglob("__init__.py")
             if "__pycache__" not in p.parts and not p.parent.is_symlink()}
    found |= {"truncsens.cli"} if (ROOT / "cli" / "__init__.py").exists() else set()
    missing = sorted(found - listed)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"
    assert "truncsens.certificates" in listed and "truncsens.engine" in listed
