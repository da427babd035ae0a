"""Helpers of the notebooks in ``notebooks/`` (run with Jupyter or as scripts): find the checkout's
``results/`` folder, measure a missing results file, show figures.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Sequence


def repo_root(start: str | Path | None = None) -> Path:
    """The truncsens checkout holding ``start`` (a notebook file; the working directory when None,
    as under Jupyter): the first folder upwards with truncsens's ``pyproject.toml``.

    Raises:
        SystemExit: no such folder (the notebook runs outside a checkout).
    """
    here = Path(start).resolve().parent if start else Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "truncsens").is_dir():
            return folder
    raise SystemExit(f"start the notebook inside the truncsens checkout (looked upwards from {here})")


def ensure_results(path: Path, command: Sequence[str]) -> Path:
    """``path``, measured first with ``command --out path --no-progress`` when it is missing.

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    path = Path(path)
    if not path.exists():
        print(f"{path} is missing: measuring it now ({' '.join(command)})")
        subprocess.run([*command, "--out", str(path), "--no-progress"], check=True)
    return path


def show(paths: Sequence[str | Path]) -> None:
    """Print the figure paths; display the images too under Jupyter."""
    for path in paths:
        print(path)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is not None:
        for path in paths:
            display(Image(filename=str(path)))
