"""Conventions shared by every command: list options, output files.

Lists: every option that takes a list accepts repeats **and** commas, in any mix:
``--policy a --policy b`` == ``--policy a,b`` == ``--policy a,b --policy b`` (repeats removed,
first order kept). JSON and figures: ``--json`` prints JSON to stdout instead of the table;
``--json-out PATH`` (``fit``: ``--out``) writes a JSON file; ``--plot`` draws figures and
``--plot-out PREFIX`` says where (``PREFIX.png``, ``PREFIX.pdf``). A command that writes a file
refuses to replace an existing one unless ``--overwrite`` is given, before computing anything
(:func:`truncsens.fits.fit_file.check_new_files`).

The options of a run (``measure``, ``certify``, ``certify-attribution``) are declared once, with the
fields of their configs (:mod:`truncsens.engine.options`); :func:`run_command` makes them a command's
options. The few other options several commands declare alike are ``Annotated`` types here.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Annotated, Any, Callable, List, Optional, Sequence, TypeVar

import typer

from truncsens.cli.errors import user_errors
from truncsens.engine.options import LIST_KINDS

if TYPE_CHECKING:
    from truncsens.engine.options import RunOption

T = TypeVar("T")

# options of the commands' own (the run options are declared with their configs: run_command)
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing results file.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON instead of tables.")]
Progress = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress on stderr.")]  # commands without run options
NoProgress = Annotated[bool, typer.Option("--progress/--no-progress", help="Accepted as every command accepts it (a script may pass it to all); this command shows no progress.")]  # show, plot, compare-policies: seconds of work

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _cli_type(o: RunOption) -> Any:
    """The type Typer parses a run option's value(s) as: lists come in as repeated text."""
    if o.kind in LIST_KINDS:
        return Optional[List[str]]
    base = _TYPES[o.kind]
    return Optional[base] if o.optional else base


def _cli_default(o: RunOption) -> Any:
    """A run option's default as Typer holds it: a list option's text default is its one repeat."""
    if o.kind in LIST_KINDS and isinstance(o.default, str):
        return [o.default]
    return o.default


def _parse(o: RunOption, value: Any) -> Any:
    """A run option's value as the API keyword takes it (lists split and checked, ``key=value`` pairs a dict).

    Raises:
        ValueError: a list that holds no item or a value that is not a number (named by its flag).
    """
    if o.kind == "int_list":
        return int_list(value, o.flag)
    if o.kind == "name_list":
        return split_list(value, o.flag)
    if o.kind == "text_list":  # the API keyword is one comma-separated text
        items = split_list(value, o.flag)
        return None if items is None else ",".join(items)
    if o.kind == "key_values":
        if not value:  # nothing to parse: the parser's module (and torch) stays unimported
            return None
        from truncsens.policies.kvpress_adapter import parse_policy_args

        return parse_policy_args(value)
    return value


def run_command(options_cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a command of ``fn(**run_options, **own)``: its options are the run options declared on
    ``options_cls`` (:func:`truncsens.engine.options.run_options`; flag, help, metavar and default
    from there, the values parsed as the API keyword takes them) followed by ``fn``'s own parameters
    (e.g. ``--json``); ``fn`` receives every one by keyword.
    """
    from truncsens.engine.options import run_options

    declared = [o for o in run_options(options_cls) if o.cli]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
        params = [inspect.Parameter(o.keyword, inspect.Parameter.KEYWORD_ONLY, default=_cli_default(o), annotation=Annotated[
            _cli_type(o), typer.Option(o.flag, help=o.help, metavar=o.metavar or None)]) for o in declared]

        @functools.wraps(fn)
        def command(**given: Any) -> Any:
            with user_errors():  # a list that does not parse is one error line, as the library's errors
                run = {o.keyword: _parse(o, given.pop(o.keyword)) for o in declared}
            return fn(**run, **given)

        command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [*params, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own)])
        del command.__wrapped__  # Typer reads the signature above, not fn's
        command.__annotations__ = {}
        return command

    return wrap


NOTICE_PREFIXES = ("note: ", "warning: ")


def echo_report(text: str) -> None:
    """Print a command's report: its lines on stdout, except notes and warnings (a line beginning, after
    its indent, with ``note: `` or ``warning: ``), which go to stderr without the indent, so that stdout
    holds the tables alone."""
    for line in text.split("\n"):
        notice = line.lstrip()
        if notice.startswith(NOTICE_PREFIXES):
            typer.echo(notice, err=True)
        else:
            typer.echo(line)


def terminal_width() -> Optional[int]:
    """Characters per line of the terminal the output goes to: ``COLUMNS`` when set to a number, else the
    terminal's own width when stdout is one; None (tables printed whole) into a pipe or a file."""
    import os
    import shutil
    import sys

    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError):  # a replaced or closed stdout
        pass
    return None


def split_list(values: Optional[Sequence[str]], what: str) -> Optional[list[str]]:
    """Repeated and comma-separated values as one list (blanks dropped, duplicates removed, order kept).

    Args:
        values: what Typer collected from a repeatable option (None when not given).
        what: the option's name, for the error.

    Returns:
        the items, or None when the option was not given.

    Raises:
        ValueError: the option was given but holds no item (e.g. ``--policy ,``).
    """
    if values is None or len(values) == 0:
        return None
    items = [v.strip() for text in values for v in str(text).split(",") if v.strip()]
    if not items:
        raise ValueError(f"{what} is empty")
    return list(dict.fromkeys(items))


def _typed_list(values: Optional[Sequence[str]], what: str, cast: Callable[[str], T], kind: str) -> Optional[list[T]]:
    items = split_list(values, what)
    if items is None:
        return None
    for text in values:  # name the value as typed in the error
        for v in str(text).split(","):
            try:
                cast(v.strip()) if v.strip() else None
            except ValueError:
                raise ValueError(f"{what} must be comma-separated {kind}, got {text!r}") from None
    return list(dict.fromkeys(cast(v) for v in items))


def int_list(values: Optional[Sequence[str]], what: str) -> Optional[list[int]]:
    """:func:`split_list` of whole numbers (``--windows 1,2 --windows 4`` -> [1, 2, 4])."""
    return _typed_list(values, what, int, "whole numbers")


def float_list(values: Optional[Sequence[str]], what: str) -> Optional[list[float]]:
    """:func:`split_list` of numbers (``--eps 0.01,0.05``)."""
    return _typed_list(values, what, float, "numbers")
