"""One place that turns library errors into one clear line on stderr and a non-zero exit."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

# Exceptions whose message is written for the user: print it, exit 2.
# OSError covers FileNotFoundError and also PermissionError, IsADirectoryError, a full disk, ...
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError, KeyError)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Run a command body; a user-facing error becomes ``error: <message>`` and exit code 2."""
    try:
        yield
    except typer.Exit:
        raise
    except USER_ERRORS as exc:
        # one-argument exceptions carry their message as args[0] (unquoted, also for KeyError);
        # OSError(errno, strerror, filename) and the like need str() to read as a sentence
        message = exc.args[0] if len(exc.args) == 1 else (str(exc) or type(exc).__name__)
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code=2) from None
