"""``truncsens fit RESULTS [RESULTS...]``: decay laws of D(w) with bootstrap intervals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from truncsens.cli.errors import user_errors
from truncsens.fits.laws import FAMILIES, families_in_words
from truncsens.cli.options import Progress


def fit(
    results_files: List[Path] = typer.Argument(..., metavar="RESULTS...", help="Results file(s) from `truncsens measure`; several are fitted side by side."),
    metric: Optional[List[str]] = typer.Option(None, "--metric", "--metrics", "-m", help="Metric(s) to fit, repeated or comma-separated (default: tv, kl, kl_reverse, js)."),
    family: Optional[List[str]] = typer.Option(None, "--family", "--families", help=f"Law families, repeated or comma-separated (default: {', '.join(FAMILIES)})."),
    fit_range: Optional[str] = typer.Option(None, "--fit-range", metavar="LO:HI", help="Windows LO:HI to fit, inclusive (default: smallest window >= 4 up to N/8, widened to 4 windows when it holds fewer)."),
    holdout_range: Optional[str] = typer.Option(None, "--holdout-range", metavar="LO:HI", help="Held-out windows LO:HI for the extrapolation test (default: above the fit range up to N/2)."),
    bootstrap: int = typer.Option(1000, "--bootstrap", help="Bootstrap resamples over documents (0: no intervals)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap."),
    level: float = typer.Option(0.95, "--level", help="Confidence level of the percentile intervals."),
    out: Optional[Path] = typer.Option(None, "--out", "--json-out", help="Fit file to write (JSON; default: <results>.fit.json next to the first results file)."),
    as_json: bool = typer.Option(False, "--json", help="Print the fit JSON to stdout instead of the table (the fit file is written too)."),
    plot: bool = typer.Option(False, "--plot/--no-plot", help="Also draw D(w) with the fitted laws (PNG and PDF; default prefix: the fit file without .json)."),
    plot_out: Optional[Path] = typer.Option(None, "--plot-out", help="Figure prefix: PREFIX.png and PREFIX.pdf (implies --plot; a .png or .pdf suffix is dropped)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing fit file or figure."),
    progress: Progress = True,
) -> None:
    """Fit the decay laws of :data:`truncsens.fits.laws.FAMILY_RECORDS` to D(w); compare them by held-out
    extrapolation (``--help`` names them: :data:`HELP`)."""
    from truncsens.api.fit import fit as fit_results
    from truncsens.cli.options import echo_report, split_list
    from truncsens.fits.fit_file import default_fit_path, plot_prefix
    from truncsens.report.plots import figure_paths

    with user_errors():
        path = Path(out or default_fit_path(results_files))
        prefix = (plot_out or plot_prefix(path)) if plot or plot_out is not None else None
        report = fit_results(results_files, metrics=split_list(metric, "--metric"), families=split_list(family, "--family"),
                             fit_range=fit_range or None, holdout_range=holdout_range or None, bootstrap=bootstrap, seed=seed,
                             level=level, out=path, plot_out=prefix, overwrite=overwrite, progress=progress)
        for line in report.warnings():
            typer.echo(f"warning: {line}", err=True)
        wrote = f"wrote {path}" + "".join(f", {p}" for p in (figure_paths(prefix) if prefix is not None else []))
        if as_json:
            typer.echo(json.dumps(report.to_json(), indent=1))
            typer.echo(wrote, err=True)
        else:
            echo_report(report.table())
            typer.echo(wrote)


HELP = f"Fit {families_in_words()} to D(w); compare them by held-out extrapolation."


def register(app: typer.Typer) -> None:
    app.command("fit", help=HELP)(fit)
