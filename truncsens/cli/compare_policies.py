"""``truncsens compare-policies RESULTS...``: retention policies at equal budget, side by side (one run, or
several runs of other policies on the same targets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from truncsens.cli.errors import user_errors
from truncsens.cli.options import NoProgress
from truncsens.metrics import DEFAULT_METRICS


def compare_policies(
    results_file: List[Path] = typer.Argument(..., help="Results file of `truncsens measure --policy ...` (a budget sweep); several files: runs of other policies on the same targets and settings, compared side by side."),
    metrics: Optional[List[str]] = typer.Option(None, "--metrics", "--metric", "-m", help=f"Metrics to summarize and fit, repeated or comma-separated (default: {', '.join(DEFAULT_METRICS)})."),
    numerator: Optional[str] = typer.Option(None, metavar="POLICY", help="Policy on top of the ratio of means (default random)."),
    denominator: Optional[str] = typer.Option(None, metavar="POLICY", help="Policy at the bottom of the ratio of means (default sink_recent)."),
    bootstrap: int = typer.Option(1000, help="Bootstrap resamples over documents (0: no intervals)."),
    seed: int = typer.Option(0, help="Seed of the resampling."),
    fit_range: Optional[str] = typer.Option(None, metavar="LO:HI", help="Budgets LO:HI of the power-law fits (default: as truncsens fit)."),
    truncation: Optional[Path] = typer.Option(None, help="A window results file (truncsens measure) whose power-law alpha is listed beside the policies'; recency policies are also fitted against the recent span they keep (k - S for sink_recent, k for suffix) and their exponent's difference from truncation's is printed, paired with an interval and a verdict when both runs measured the same targets (measure --sinks S: the matched run for S sinks)."),
    paired_against: Optional[str] = typer.Option(None, metavar="POLICY", help="A policy of the results (e.g. sink_recent): every other policy's power-law exponent in k minus its, paired on the same targets, with an interval and a verdict (faster, same or slower decay)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON to stdout instead of the table."),
    json_out: Optional[Path] = typer.Option(None, "--json-out", help="Also write the comparison as JSON to this file."),
    plot: bool = typer.Option(False, "--plot/--no-plot", help="Draw the log-log plot (default prefix: <results>-policies next to the results)."),
    plot_out: Optional[Path] = typer.Option(None, "--plot-out", help="Plot prefix: PREFIX.png and PREFIX.pdf (implies --plot; a .png or .pdf suffix is dropped)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing JSON file or plot."),
    accepted_progress: NoProgress = True,  # no progress to show; accepted as every command accepts it
) -> None:
    """Mean and interval of each metric per policy and budget, random/sink_recent ratio, power-law fits, log-log plot;
    with several draws (measure --draws R): means over draws per target, and the spread between draws."""
    from truncsens.api.compare import compare_policies as compare
    from truncsens.cli.options import echo_report, split_list
    from truncsens.fits.fitting import parse_range
    from truncsens.report.plots import figure_paths
    from truncsens.report.policy_comparison import default_plot_stem
    from truncsens.report.printed import format_comparison, format_draw_spread

    with user_errors():
        plot = plot or plot_out is not None
        stem = (plot_out or default_plot_stem(results_file[0])) if plot else None
        cmp = compare(results_file, metrics=split_list(metrics, "--metrics"), numerator=numerator, denominator=denominator,
                      bootstrap=bootstrap, seed=seed, fit_range=parse_range(fit_range, "--fit-range") if fit_range else None,
                      truncation=truncation, paired_against=paired_against, json_out=json_out, plot_out=stem, overwrite=overwrite)
        wrote = [str(p) for p in figure_paths(stem)] if plot else []
        if json_out:
            wrote.append(str(json_out))
        if as_json:
            typer.echo(json.dumps(cmp.to_json(), indent=1))
            if wrote:
                typer.echo("wrote " + ", ".join(wrote), err=True)
        else:
            echo_report(format_comparison(cmp))
            if cmp.spread:
                echo_report(format_draw_spread(cmp))
            if wrote:
                typer.echo("wrote " + ", ".join(wrote))


def register(app: typer.Typer) -> None:
    app.command("compare-policies")(compare_policies)
