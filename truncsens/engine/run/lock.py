"""A run owns its results file while it runs: an exclusive lock on ``<out>.lock``.

The lock is an ``fcntl.flock`` on the lock file, so the operating system releases it when the
process ends however it ends (no stale locks after a crash or a kill); the owner writes who it is
(pid, host, start time, command line) into the file so a second run can name it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

from truncsens.results.paths import NO_SPACE_ERRNOS, NoSpaceError


class OutputLockedError(RuntimeError):
    """Another run holds the lock of this output; the message names it."""


class OutputLock:
    """Context manager holding ``<out>.lock`` (no-op when ``enabled`` is False).

    Raises:
        OutputLockedError: another process holds it.
        NoSpaceError: the disk is full (no lock file is left behind).
    """

    def __init__(self, out: str | Path, enabled: bool = True) -> None:
        self.path = Path(str(out) + ".lock")
        self.enabled = enabled
        self.fd: int | None = None

    def __enter__(self) -> "OutputLock":
        if not self.enabled:
            return self
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 65536).decode(errors="replace")
                os.close(fd)
                raise OutputLockedError(f"another truncsens run is writing {self.path.with_suffix('')}: "
                                        f"{_describe(holder)}; wait for it to finish, or choose another --out") from None
            try:  # the previous owner may have removed the file between our open and our lock: lock the live one
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(info).encode())
        except OSError as exc:  # a full disk: leave no lock file behind
            self.path.unlink(missing_ok=True)
            os.close(fd)
            if exc.errno in NO_SPACE_ERRNOS:
                raise NoSpaceError(self.path) from exc
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on {info['host']}, started {info['started']} ({info['command']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not yet recorded itself"
