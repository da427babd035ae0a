"""One place that turns library errors into one clear line on stderr and a non-zero exit."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

# Exceptions whose message is written for the user: print it, exit 2.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, RuntimeError, KeyError)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Run a command body; a user-facing error becomes ``error: <message>`` and exit code 2."""
    try:
        yield
    except typer.Exit:
        raise
    except USER_ERRORS as exc:
        message = exc.args[0] if exc.args else type(exc).__name__
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code=2) from None
