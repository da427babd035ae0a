"""Entry point of the ``truncsens`` console script.

Every command lives in its own module of this package and adds itself with ``register(app)``;
this file only collects them, so commands stay independent of each other. ``-h`` is ``--help``
everywhere; the conventions of list options, ``--json``/``--json-out``, ``--plot``/``--plot-out``
and ``--overwrite`` are :mod:`truncsens.cli.options`; errors and broken pipes are
:mod:`truncsens.cli.errors`.
"""

from __future__ import annotations

import importlib
import sys

import typer
from typer.core import TyperGroup

from truncsens.cli.errors import plain_usage_message

COMMAND_MODULES = (
    "measure", "show", "train_reference", "fit", "recommend_window", "plot", "compare_policies", "certify",
    "certify_attribution", "plan",
)



# Typer's type labels -> the value's name in --help
READABLE = {"<int>": "N", "<float>": "X", "<str>": "TEXT", "<path>": "PATH", "<bool>": ""}


def readable_metavar(param) -> None:
    """Name an option's value in ``--help`` by what it is, not by Typer's type column (``<list[str]>``,
    ``<bool>``): a metavar given on the option stays; otherwise N (whole number), X (number), TEXT,
    PATH, LIST (repeatable), nothing for a switch; an argument shows its name alone. Typer before its
    type column (click's TEXT, INTEGER) is left as it is."""
    display = getattr(param, "display_type", None)
    if display is None:
        return
    if param.param_type_name == "argument":
        param.display_type_rich = lambda ctx=None: None  # the argument's name says what it is
        return
    if param.metavar is not None:
        return
    try:
        label = display(None)
    except Exception:  # a label that needs the context (choices): leave it
        return
    param.metavar = "LIST" if label.startswith("<list[") else READABLE.get(label)


class Commands(TyperGroup):
    """The ``truncsens`` group: every command's options get :func:`readable_metavar` when it is built."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for command in (self, *self.commands.values()):
            for param in command.params:
                readable_metavar(param)
            _name_help_option(command)


def _name_help_option(command) -> None:
    """:func:`readable_metavar` for ``-h/--help`` too, which click makes only when help is asked for."""
    make = command.get_help_option

    def get_help_option(ctx):
        option = make(ctx)
        if option is not None:
            readable_metavar(option)
        return option

    command.get_help_option = get_help_option


app = typer.Typer(
    name="truncsens",
    cls=Commands,
    help="Measure how sensitive a causal LM is to losing its context, and turn it into KV-cache budgets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)

def _version(value: bool) -> None:
    if value:
        import truncsens

        typer.echo(f"truncsens {truncsens.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Measure how sensitive a causal LM is to losing its context, and turn it into KV-cache budgets."""
    from truncsens.cli.options import terminal_width
    from truncsens.report.tables import set_width

    set_width(terminal_width())  # wide tables split to the terminal; unchanged into a pipe or file
    ctx.call_on_close(lambda: set_width(None))  # for this command only (the API, later in a process, prints whole)


for _name in COMMAND_MODULES:
    importlib.import_module(f"truncsens.cli.{_name}").register(app)


def _click_errors() -> tuple[type[BaseException], ...]:
    """The exception bases of command-line errors: typer >= 0.22 carries its own click (``TyperException``),
    older versions raise click's ``ClickException``."""
    bases: list[type[BaseException]] = []
    if hasattr(typer, "TyperException"):
        bases.append(typer.TyperException)
    try:
        import click

        bases.append(click.ClickException)
    except ImportError:  # pragma: no cover - typer without click
        pass
    return tuple(bases)


def run(args: list[str] | None = None) -> None:
    """The console script: :data:`app`, with a command-line usage error (an unknown option or command, a
    value that does not parse) reported as one ``error: ...`` line on stderr and exit code 2, as the
    library's errors are (:mod:`truncsens.cli.errors`), instead of a framed box.

    Raises:
        SystemExit: always, with the command's exit code.
    """
    try:
        code = app(args=args, standalone_mode=False, prog_name="truncsens")
    except typer.Abort:
        typer.echo("aborted", err=True)
        code = 1
    except _click_errors() as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:  # a bare group: its help
            typer.echo(ctx.get_help(), err=True)
        else:
            where = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
            message = plain_usage_message(exc.format_message(), sys.argv[1:] if args is None else list(args))
            typer.echo(f"error: {message}{where}", err=True)
        code = getattr(exc, "exit_code", 2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    run()
