"""``truncsens recommend-window RESULTS_OR_FIT --eps 0.01``: the window w(eps) with an interval."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import List, Optional

import typer

from truncsens.cli.errors import user_errors
from truncsens.cli.options import Progress


def recommend_window(
    source: Optional[Path] = typer.Argument(None, metavar="RESULTS_OR_FIT", help="A fit file (from `truncsens fit`) or a results file (fitted on the fly)."),
    eps: List[str] = typer.Option(..., "--eps", metavar="EPS", help="Distortion target(s) in the metric's units, repeated or comma-separated."),
    metric: Optional[List[str]] = typer.Option(None, "--metric", "--metrics", "-m", help="Metric(s), repeated or comma-separated (default: tv)."),
    fit_file: Optional[Path] = typer.Option(None, "--fit", help="Fit file (instead of the positional argument)."),
    fit_range: Optional[str] = typer.Option(None, "--fit-range", metavar="LO:HI", help="When fitting a results file: windows LO:HI (default as in `fit`: at least 4 windows when the run has them)."),
    bootstrap: int = typer.Option(1000, "--bootstrap", help="When fitting a results file: bootstrap resamples over documents."),
    seed: int = typer.Option(0, "--seed", help="When fitting a results file: seed of the bootstrap."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON to stdout instead of the table."),
    progress: Progress = True,
) -> None:
    """The window that keeps D(w) <= eps: the measured crossing inside the measured range, the power law
    w(eps) = (C/eps)^(1/alpha) outside it, each with its interval, and the KV memory it implies."""
    from truncsens.api.recommend import recommend_window as recommend
    from truncsens.cli.options import float_list, split_list, terminal_width
    from truncsens.fits.fitting import parse_range
    from truncsens.report.printed import format_recommendations

    with user_errors():
        if (source is None) == (fit_file is None):
            raise ValueError("give either RESULTS_OR_FIT or --fit FILE (exactly one)")
        metrics = split_list(metric, "--metric") or ["tv"]
        eps = float_list(eps, "--eps")
        recs = recommend(fit_file or source, eps, metrics=metrics,
                         fit_range=parse_range(fit_range, "--fit-range") if fit_range else None, bootstrap=bootstrap, seed=seed, progress=progress)
        if as_json:
            typer.echo(json.dumps({"source": str(fit_file or source), "recommendations": [r.to_json() for r in recs]}, indent=1))
            for r in recs:
                for w in r.warnings:
                    typer.echo(f"warning: {r.label} {r.metric} eps={r.eps:g}: {w}", err=True)
        else:  # the table and its legend on stdout; warnings and notes on stderr, as --json prints them
            width = terminal_width()
            for line in format_recommendations(recs).splitlines():
                if width and line.startswith("window: "):  # the legend, wrapped to a terminal of known width
                    line = textwrap.fill(line, width, subsequent_indent="  ")
                typer.echo(line, err=line.startswith(("warning: ", "note: ")))


def register(app: typer.Typer) -> None:
    app.command("recommend-window")(recommend_window)
