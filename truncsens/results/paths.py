"""Output paths: whether a file can be created there, checked before any work is done, and writing a
file's bytes there atomically, with a full disk reported as one clear error."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# What a write fails with when the disk (or the user's quota) is full.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class NoSpaceError(OSError):
    """Not enough free space to write a file: an ``OSError`` with errno ``ENOSPC`` whose message names
    the path and says "no space left on device" (with the bytes needed and free, where known)."""

    def __init__(self, path: str | Path, needed: int | None = None, free: int | None = None) -> None:
        sizes = f" ({needed:,} bytes needed, {free:,} free)" if needed is not None and free is not None else ""
        self.message = f"cannot write {path}: no space left on device{sizes}; free some space and rerun"
        super().__init__(errno.ENOSPC, self.message, str(path))

    def __str__(self) -> str:
        return self.message


def check_creatable(path: Path) -> None:
    """Whether ``path`` can be written: its nearest existing ancestor must be a writable folder
    (the missing folders below it are created on writing). Checked before computing, so an
    impossible output path costs nothing.

    Raises:
        NotADirectoryError: that ancestor is a file; PermissionError: it is not writable.
    """
    parent = _existing_ancestor(path)
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: the folder {parent} is not writable")


def _existing_ancestor(path: Path) -> Path:
    parent = Path(path).absolute().parent
    while not parent.exists():
        parent = parent.parent
    return parent


def check_free_space(path: str | Path, n_bytes: int) -> None:
    """Whether the file system of ``path`` (its nearest existing folder) has ``n_bytes`` free for an
    unprivileged writer (``shutil.disk_usage``).

    Raises:
        NoSpaceError: fewer bytes are free (the message gives both numbers).
    """
    free = shutil.disk_usage(_existing_ancestor(Path(path))).free
    if free < n_bytes:
        raise NoSpaceError(path, n_bytes, free)


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: the free space is checked first (:func:`check_free_space`),
    the missing parent folders are created, the bytes go to a temporary file of this process
    (``.<name>.<pid>.tmp`` beside it, so concurrent writers never share one), are flushed to disk and
    renamed over ``path``. On any failure the temporary file is removed and ``path`` is untouched.

    Returns:
        ``path`` (a ``Path``).

    Raises:
        NoSpaceError: the disk or quota is full (before writing, or during it).
        OSError: the path cannot be written otherwise.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(path, len(data))
        _write_file(tmp, data)
        tmp.replace(path)
    except NoSpaceError:
        tmp.unlink(missing_ok=True)
        raise
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in NO_SPACE_ERRNOS:
            raise NoSpaceError(path) from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_file(path: Path, data: bytes) -> None:
    """Create ``path`` and write ``data`` to it, flushed to disk."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # a delayed-allocation file system may report a full disk only here
