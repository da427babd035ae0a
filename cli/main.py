"""Entry point of the ``truncsens`` console script.

Every command lives in its own module of this package and adds itself with ``register(app)``;
this file only collects them, so commands stay independent of each other. ``-h`` is ``--help``
everywhere; the conventions of list options, ``--json``/``--json-out``, ``--plot``/``--plot-out``
and ``--overwrite`` are :mod:`truncsens.cli.options`; errors and broken pipes are
:mod:`truncsens.cli.errors`.
"""

from __future__ import annotations

import importlib

import typer

COMMAND_MODULES = (
    "measure", "show", "train_reference", "fit", "recommend_window", "plot", "compare_policies", "certify",
    "certify_attribution",
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


if __name__ == "__main__":  # pragma: no cover
    app()
