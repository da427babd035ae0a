"""One place that turns library errors into one clear line on stderr and a non-zero exit."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import typer

# What a shell reports for a process killed by SIGPIPE (128 + 13), as `cat` or `grep` give under `| head`.
BROKEN_PIPE_EXIT = 141


def quiet_broken_pipe() -> None:
    """The reader of stdout went away (``truncsens show x.nc | head -1``): stop quietly, as Unix tools
    do. stdout is pointed at /dev/null so that Python's final flush does not fail again; exit 141.

    Raises:
        typer.Exit: always, code :data:`BROKEN_PIPE_EXIT`.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. a test runner's buffer)
        pass
    raise typer.Exit(code=BROKEN_PIPE_EXIT)

# Exceptions whose message is written for the user: print it, exit 2.
# OSError covers FileNotFoundError and also PermissionError, IsADirectoryError, a full disk, ...
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError, KeyError)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Run a command body; a user-facing error becomes ``error: <message>`` and exit code 2; a broken
    pipe on stdout ends quietly (:func:`quiet_broken_pipe`)."""
    try:
        yield
    except typer.Exit:
        raise
    except BrokenPipeError:
        quiet_broken_pipe()
    except USER_ERRORS as exc:
        # one-argument exceptions carry their message as args[0] (unquoted, also for KeyError);
        # OSError(errno, strerror, filename) and the like need str() to read as a sentence
        message = exc.args[0] if len(exc.args) == 1 else (str(exc) or type(exc).__name__)
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code=2) from None
