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

COMMAND_MODULES = (
    "measure", "show", "train_reference", "fit", "recommend_window", "plot", "compare_policies", "certify",
    "certify_attribution", "plan",
)

app = typer.Typer(
    name="truncsens",
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
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Measure how sensitive a causal LM is to losing its context, and turn it into KV-cache budgets."""


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
            typer.echo(f"error: {exc.format_message()}{where}", err=True)
        code = getattr(exc, "exit_code", 2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    run()
