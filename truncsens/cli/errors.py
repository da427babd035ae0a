"""One place that turns library errors into one clear line on stderr and a non-zero exit, and keeps
the notices of the libraries underneath (transformers, huggingface_hub, kernels, torch: log records
and Python warnings) off a command's output."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import warnings
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

# The parser's words for a value that does not parse, and what the option takes, said plainly.
PARSE_FAILURES = (("valid integer", "a whole number"), ("valid number", "a number"), ("valid boolean", "true or false"))
_INVALID_VALUE = re.compile(r"Invalid value for '(-[\w-]+)'(?: / '-[\w-]+')*: (.*)", re.S)


def plain_usage_message(message: str, args: list[str]) -> str:
    """A usage error's message with the parser's wording for a value that does not parse replaced:
    ``Invalid value for '--draws': Input should be a valid integer, unable to parse ...`` becomes
    ``--draws takes a whole number, got 'two'`` (the value read back from ``args``, the command line
    without the program name). Any other message is returned as it is."""
    match = _INVALID_VALUE.fullmatch(message.strip())
    if match is None:
        return message
    flag, why = match.groups()
    kind = next((plain for words, plain in PARSE_FAILURES if words in why), None)
    if kind is None:
        return message
    given = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    given += [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return f"{flag} takes {kind}, got {given[-1]!r}" if given else f"{flag} takes {kind}"


# Exceptions whose message is written for the user: print it, exit 2.
# OSError covers FileNotFoundError and also PermissionError, IsADirectoryError, a full disk, ...
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError, KeyError)


# Set to 1 to let the libraries' notices through (debugging a model that fails to load).
SHOW_LIBRARY_NOTICES = "TRUNCSENS_LIBRARY_NOTICES"


@contextlib.contextmanager
def library_notices_silenced() -> Iterator[None]:
    """While a command runs, drop log records below ERROR of every logger (truncsens itself logs
    nothing: its lines are printed) and Python warnings not raised by truncsens, so that notices such
    as transformers' or kernels' offline-mode messages ("Skipping publisher trust check ...") never
    come before a command's own lines. Errors are exceptions and still end as the ``error:`` line;
    log records at ERROR and above still print. Nothing is silenced when the environment variable
    :data:`SHOW_LIBRARY_NOTICES` is 1."""
    if os.environ.get(SHOW_LIBRARY_NOTICES, "") == "1":
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # global, whatever level a library sets on its own loggers on import
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", module=r"truncsens(\.|$)")
            yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Run a command body with the libraries' notices silenced (:func:`library_notices_silenced`); a
    user-facing error becomes ``error: <message>`` and exit code 2; a broken pipe on stdout ends
    quietly (:func:`quiet_broken_pipe`)."""
    try:
        with library_notices_silenced():
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


# The signals that stop a run as Ctrl-C does (a batch system's or a closed terminal's stop), where the platform has them.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class StoppedBySignal(KeyboardInterrupt):
    """A command stopped by a signal of :data:`STOP_SIGNALS`: raised in the main thread as Ctrl-C's
    ``KeyboardInterrupt`` is (a subclass of it), so everything that runs on Ctrl-C runs too (the
    output lock released, a run's finished shards kept and named with how to resume)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def signals_stop_like_ctrl_c() -> Iterator[None]:
    """While a command body runs, SIGTERM and SIGHUP raise :class:`StoppedBySignal` instead of ending
    the process at once; the command then prints ``stopped by SIGTERM`` on stderr and exits 128 + the
    signal's number, as a shell reports a process the signal ended. The previous handlers are put
    back afterwards (outside the main thread, where handlers cannot be set, nothing changes).

    Raises:
        typer.Exit: the body was stopped by a signal (code 128 + signum).
    """
    previous = {}
    def stop(signum, frame):
        raise StoppedBySignal(signum)
    for sig in STOP_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, stop)
        except ValueError:  # not the main thread
            break
    try:
        yield
    except StoppedBySignal as exc:
        typer.echo(f"{exc.args[0]}", err=True)
        raise typer.Exit(code=128 + exc.signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def note_kept_shards(out, exc: BaseException) -> None:
    """After a run writing ``out`` failed with ``exc``: name the finished shards kept and how to resume,
    when they are this run's own (:func:`truncsens.engine.run.shards.resumable`; a run refused before
    it began, e.g. because another run holds the output, says nothing of that run's shards)."""
    from truncsens.engine.run.shards import kept_shards, resumable, shard_dir_for

    kept = kept_shards(out)
    if kept and resumable(exc):
        typer.echo(f"note: {len(kept)} finished shard(s) kept in {shard_dir_for(out)}; "
                   "rerun the same command with --resume to continue", err=True)


@contextlib.contextmanager
def kept_shards_note(out) -> Iterator[None]:
    """Run the body of a command that writes results file ``out`` in shards; when it fails or is
    interrupted (Ctrl-C, SIGTERM, SIGHUP) after some of this run's shards were finished, say on stderr
    that they were kept and how to continue (:func:`note_kept_shards`); the exception goes on."""
    try:
        yield
    except BaseException as exc:
        note_kept_shards(out, exc)
        raise
