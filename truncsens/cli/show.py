"""``truncsens show FILE``: per-window statistics of a results file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from truncsens.cli.errors import user_errors
from truncsens.cli.options import NoProgress


def show(
    file: Path = typer.Argument(..., help="A results file written by `truncsens measure`."),
    metric: Optional[List[str]] = typer.Option(None, "--metric", "--metrics", "-m", help="Metric(s) to show, repeated or comma-separated (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (attrs and rows) to stdout instead of the table."),
    accepted_progress: NoProgress = True,  # no progress to show; accepted as every command accepts it
) -> None:
    """Print, per window, n, mean ± standard error, median, p90 and p99 of each metric (n_inf / n_nan count non-finite values)."""
    from truncsens.api.show import show as summarize
    from truncsens.cli.options import echo_report, split_list
    from truncsens.report.printed import format_results_summary

    with user_errors():
        summary = summarize(file, metrics=split_list(metric, "--metric"))
        if as_json:
            typer.echo(json.dumps(summary.to_json(), indent=2, allow_nan=False))
        else:
            echo_report(format_results_summary(summary))


def register(app: typer.Typer) -> None:
    app.command("show")(show)
