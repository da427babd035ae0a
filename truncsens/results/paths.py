"""Output paths: whether a file can be created there, checked before any work is done."""

from __future__ import annotations

import os
from pathlib import Path


def check_creatable(path: Path) -> None:
    """Whether ``path`` can be written: its nearest existing ancestor must be a writable folder
    (the missing folders below it are created on writing). Checked before computing, so an
    impossible output path costs nothing.

    Raises:
        NotADirectoryError: that ancestor is a file; PermissionError: it is not writable.
    """
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: the folder {parent} is not writable")
