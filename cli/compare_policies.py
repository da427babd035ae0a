"""``truncsens compare-policies RESULTS``: retention policies at equal budget, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from truncsens.cli.errors import user_errors


def compare_policies(
    results_file: Path = typer.Argument(..., help="Results file of `truncsens measure --policy ...` (a budget sweep)."),
    metrics: str = typer.Option("kl,tv", help="Comma-separated metrics to summarize and fit."),
    numerator: Optional[str] = typer.Option(None, help="Policy on top of the ratio of means (default random)."),
    denominator: Optional[str] = typer.Option(None, help="Policy at the bottom of the ratio of means (default sink_recent)."),
    bootstrap: int = typer.Option(1000, help="Bootstrap resamples over documents (0: no intervals)."),
    seed: int = typer.Option(0, help="Seed of the resampling."),
    fit_range: Optional[str] = typer.Option(None, help="Budgets LO:HI of the power-law fits (default: as truncsens fit)."),
    truncation: Optional[Path] = typer.Option(None, help="A window results file (truncsens measure) whose power-law alpha is listed beside the policies'."),
    plot: Optional[Path] = typer.Option(None, help="Plot path without suffix (.png and .pdf); default <results>-policies next to the results."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Do not draw the plot."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the comparison as JSON here."),
) -> None:
    """Mean and interval of each metric per policy and budget, random/sink_recent ratio, power-law fits, log-log plot."""
    from truncsens.fitfile import write_json
    from truncsens.fitting import parse_range
    from truncsens.plots import plot_comparison
    from truncsens.policy_compare import CompareConfig, compare_policies_file, default_plot_stem
    from truncsens.reports import format_comparison

    with user_errors():
        names = tuple(m.strip() for m in metrics.split(",") if m.strip())
        cfg = CompareConfig(metrics=names, numerator=numerator, denominator=denominator, n_boot=bootstrap, seed=seed,
                            fit_range=parse_range(fit_range, "--fit-range") if fit_range else None)
        cmp = compare_policies_file(results_file, cfg, truncation)
        typer.echo(format_comparison(cmp))
        if not no_plot:
            paths = plot_comparison(cmp, plot or default_plot_stem(results_file), names[0])
            typer.echo("plot: " + ", ".join(str(p) for p in paths))
        if json_out:
            typer.echo(f"wrote {write_json(cmp.to_json(), json_out)}")


def register(app: typer.Typer) -> None:
    app.command("compare-policies")(compare_policies)
