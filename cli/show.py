"""``truncsens show FILE``: per-window statistics of a results file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from truncsens.cli.errors import user_errors


def show(
    file: Path = typer.Argument(..., help="A results file written by `truncsens measure`."),
    metric: Optional[List[str]] = typer.Option(None, "--metric", "-m", help="Metric(s) to show (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (attrs and rows) instead of a table."),
) -> None:
    """Print, per window, mean ± standard error, median, p90 and p99 of each metric."""
    from truncsens import results
    from truncsens.fitting import sanitize
    from truncsens.summary import format_table, summarize

    with user_errors():
        ds = results.load(file)
        rows = summarize(ds, metric)
        sweep = results.sweep_dim(ds)
        if as_json:
            # sanitize: numpy scalars to Python, NaN (se of one target) and inf (KL of disjoint supports) to null
            doc = sanitize({"file": str(file), "attrs": dict(ds.attrs), "sweep": sweep, "rows": rows})
            typer.echo(json.dumps(doc, indent=2, allow_nan=False))
            return
        a = ds.attrs
        typer.echo(
            f"{file}: model {a['model']}, corpus {a['corpus']} ({a['domain']}), semantics {a['semantics']}, "
            f"positions {a['positions']}, sinks {a['n_sink']}, reference context {a['reference_context']}, "
            f"{ds.sizes['target']} targets")
        typer.echo(format_table(rows, sweep))


def register(app: typer.Typer) -> None:
    app.command("show")(show)
