"""The declared minimum versions really work: a fast subset of the suite runs against them.

``pyproject.toml`` declares each dependency as ``package>=MIN``. This test builds a virtual
environment that sees nothing of the interpreter running the suite (no ``--system-site-packages``,
no path borrowed from it), so a package that happens to be installed here, such as ``kernels``,
which transformers imports when it finds it, cannot change the outcome. Into it go:

- torch, taken from a local wheel of the running torch's version (pip's own ``find-links``, with
  ``--no-index``: a CUDA build from the index would be several GB);
- every other dependency at the lowest version the declarations allow, as resolved by
  ``uv pip install --resolution lowest-direct`` (direct dependencies lowest, what they need resolved
  against them), so ``transformers`` is exactly its declared minimum;
- pytest, the newest (a test tool, not a dependency of the library).

It then runs :data:`SUBSET` there in a subprocess, from the repository root: model loading from every
source (the bundled reference model included), the engine against its naive reference with Llama and
GPT-2, prefill-evict cache surgery, streaming masks and attention from eviction steps. It is part of
the README's test command (``python -m pytest -q``). It skips, saying why, when no local torch wheel
can be found, when ``uv`` is not installed, or when the package index cannot be reached. Deselect it
while iterating with ``-m "not lowest_versions"``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ["tests/test_models.py", "tests/test_model_sources.py", "tests/test_engine_equality.py",
          "tests/test_prefill_evict.py", "tests/test_masks_streaming.py", "tests/test_evict_attention.py"]
SELECT = "not reference or test_reference_source or cache_surgery_reference and suffix"  # tiny models + 2 reference tests
MIN_PASSED = 90  # the selection holds 103 tests today; fewer passing means tests were skipped or lost
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
           "Network is unreachable", "Could not fetch URL", "ProxyError", "Name or service not known",
           "dns error", "error sending request", "Could not connect", "Failed to fetch")

pytestmark = pytest.mark.lowest_versions


def declared_dependencies(text: str) -> dict[str, str]:
    """``{package: MIN}`` for every ``"package>=MIN"`` of the ``dependencies = [...]`` list.

    Args:
        text: the contents of ``pyproject.toml`` (read as text: ``tomllib`` is Python >= 3.11 only).

    Raises:
        LookupError: no ``dependencies`` list, or one of its entries has no ``>=`` lower bound.
    """
    match = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, flags=re.MULTILINE | re.DOTALL)
    if match is None:
        raise LookupError("pyproject.toml has no 'dependencies = [...]' list")
    found = {}
    for entry in re.findall(r'"([^"]+)"', match.group(1)):
        bound = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9a-z.]*)\s*", entry)
        if bound is None:
            raise LookupError(f"dependency {entry!r} in pyproject.toml has no plain '>=' lower bound")
        found[bound.group(1)] = bound.group(2)
    return found


def declared_minimum(package: str) -> str:
    """The X of ``package>=X`` in the ``dependencies`` of ``pyproject.toml``.

    Raises:
        LookupError: the package is not declared with a ``>=`` lower bound.
    """
    declared = declared_dependencies((ROOT / "pyproject.toml").read_text())
    if package not in declared:
        raise LookupError(f"{package} has no '>=' lower bound in pyproject.toml")
    return declared[package]


def lowest_requirements(declared: dict[str, str]) -> list[str]:
    """The requirement lines handed to the lowest-versions resolver: every declared dependency but
    torch (installed beforehand from a local wheel), with its declared lower bound."""
    return [f"{name}>={low}" for name, low in declared.items() if name != "torch"]


def _offline(log: str) -> bool:
    return any(sign in log for sign in OFFLINE)


def _uv() -> str | None:
    """The uv executable: the one the ``uv`` package ships, else one on PATH, else None."""
    try:
        import uv  # the PyPI package ships the binary

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def test_declared_dependencies_parse():
    declared = declared_dependencies((ROOT / "pyproject.toml").read_text())
    assert re.fullmatch(r"4\.\d+(\.\d+)?", declared["transformers"]) and "torch" in declared
    assert declared_minimum("transformers") == declared["transformers"]
    with pytest.raises(LookupError, match="no-such-package has no '>=' lower bound"):
        declared_minimum("no-such-package")
    with pytest.raises(LookupError, match="'numpy<2' in pyproject.toml has no plain '>=' lower bound"):
        declared_dependencies('dependencies = [\n    "torch>=2",\n    "numpy<2",\n]\n')
    text = 'name = "x"\ndependencies = [\n    "torch>=2.13",\n    "transformers>=4.54.0",\n    "h5py>=3.8",\n]\n' \
           '[project.optional-dependencies]\ntest = ["pytest>=7"]\n'
    assert declared_dependencies(text) == {"torch": "2.13", "transformers": "4.54.0", "h5py": "3.8"}
    assert lowest_requirements(declared_dependencies(text)) == ["transformers>=4.54.0", "h5py>=3.8"]


def test_fast_subset_with_lowest_versions(tmp_path):
    declared = declared_dependencies((ROOT / "pyproject.toml").read_text())
    uv = _uv()
    if uv is None:
        pytest.skip("uv is not installed (pip install -e '.[test]' brings it): it resolves the lowest declared versions")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
    # torch: the running version from a local wheel (pip's find-links), never a download
    torch_version = importlib.metadata.version("torch")
    wheel = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index",
                            "--no-deps", f"torch=={torch_version}"], capture_output=True, text=True)
    if wheel.returncode != 0:
        pytest.skip(f"no local wheel of torch=={torch_version} in pip's find-links to reuse (downloading one "
                    f"can be several GB): {(wheel.stdout + wheel.stderr).strip().splitlines()[-1]}")
    requirements = tmp_path / "lowest.txt"
    requirements.write_text("\n".join([f"torch=={torch_version}", *lowest_requirements(declared)]) + "\n")
    for args in (["--resolution", "lowest-direct", "-r", str(requirements)], ["pytest"]):
        install = subprocess.run([uv, "pip", "install", "-q", "--python", python, *args],
                                 capture_output=True, text=True)
        if install.returncode != 0:
            log = install.stdout + install.stderr
            if _offline(log):
                pytest.skip(f"the package index is unreachable, so the lowest declared versions cannot be "
                            f"installed: {log.strip().splitlines()[-1]}")
            pytest.fail(f"uv pip install {' '.join(args)} failed:\n{log[-3000:]}")
    shown = subprocess.run([python, "-c", "import sys, transformers; print(transformers.__version__); "
                            "print('\\n'.join(sys.path))"], capture_output=True, text=True, check=True)
    version, *path = shown.stdout.strip().splitlines()
    assert version == declared["transformers"]
    # nothing of the environment running the suite is visible inside (a stray package there changed
    # what transformers imported)
    outer = {p for p in sys.path if "site-packages" in p}
    assert not outer & set(path), sorted(outer & set(path))
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET, "-k", SELECT],
                         cwd=ROOT, capture_output=True, text=True)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, (f"fast subset failed with the lowest declared versions "
                                 f"(transformers=={version}):\n{(run.stdout + run.stderr)[-6000:]}")
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= MIN_PASSED, summary
