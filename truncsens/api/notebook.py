"""Helpers of the notebooks in ``notebooks/`` (run with Jupyter or as scripts): find the checkout's
``results/`` folder, measure a missing results file through the API, show figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence


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


def ensure_results(path: str | Path, run: Callable[..., Any], **options: Any) -> Path:
    """``path``, written first by ``run(out=path, progress=False, **options)`` when it is missing
    (``run`` is an API function that writes ``out``: :func:`truncsens.measure`, :func:`truncsens.certify`, ...).

    Raises:
        whatever ``run`` raises.
    """
    path = Path(path)
    if not path.exists():
        call = ", ".join(f"{k}={v!r}" for k, v in options.items())
        print(f"{path} is missing: measuring it now (truncsens.{run.__name__}({call}))")
        run(out=path, progress=False, **options)
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
