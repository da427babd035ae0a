"""The built wheel holds every subpackage of the source tree and its data (the reference model's
weights, the corpus manifests): a wheel or `pip install .`, not only an editable install, where the
source folders stay importable."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    pytest.importorskip("setuptools")  # both are test dependencies (pyproject [test])
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"  # a copy without build/ or egg-info left by other installs
    top_level = {".git", "build", "results", "runs", ".venv", "notebooks", "tests"}  # run outputs, not the package

    def ignore(folder: str, names: list[str]) -> list[str]:
        skip = shutil.ignore_patterns("*.egg-info", "__pycache__", "*.shards")(folder, names)
        return [*skip, *(top_level & set(names) if Path(folder) == ROOT else ())]

    shutil.copytree(ROOT, src, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True)
    (whl,) = out.glob("truncsens-*.whl")
    return set(zipfile.ZipFile(whl).namelist())


def test_wheel_holds_every_subpackage(wheel_names):
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "truncsens").rglob("__init__.py") if "__pycache__" not in p.parts}
    assert "truncsens/certificates/__init__.py" in found and "truncsens/cli/__init__.py" in found
    assert sorted(found - wheel_names) == []


def test_wheel_holds_the_package_data(wheel_names):
    for folder, pattern in (("truncsens/models/reference/weights", "*"), ("truncsens/corpora/manifests", "*.yaml")):
        files = {str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern) if p.is_file()}
        assert files, folder
        assert sorted(files - wheel_names) == []
