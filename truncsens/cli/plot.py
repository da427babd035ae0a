"""``truncsens plot RESULTS [--fit FIT] --out PREFIX``: log-log D(w) with se bars and fitted laws."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from truncsens.cli.errors import user_errors
from truncsens.cli.options import NoProgress


def plot(
    results_files: List[Path] = typer.Argument(..., metavar="RESULTS...", help="Results file(s) from `truncsens measure`."),
    fit_file: Optional[Path] = typer.Option(None, "--fit", help="Fit file from `truncsens fit` whose laws to draw (default: fit now, without intervals)."),
    out: Path = typer.Option(..., "--out", "--plot-out", help="Output prefix: PREFIX.png and PREFIX.pdf are written (--out fig.png also writes fig.png and fig.pdf)."),
    metric: Optional[List[str]] = typer.Option(None, "--metric", "--metrics", "-m", help="Metric panels, repeated or comma-separated (default: tv, kl, kl_reverse, js)."),
    fit_range: Optional[str] = typer.Option(None, "--fit-range", metavar="LO:HI", help="Fit range LO:HI when fitting now."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing PREFIX.png / PREFIX.pdf."),
    accepted_progress: NoProgress = True,  # no progress to show; accepted as every command accepts it
) -> None:
    """One panel per metric: mean D(w) ± se on log-log axes, with the fitted laws."""
    from truncsens.api.plot import plot as plot_results
    from truncsens.cli.options import split_list
    from truncsens.fits.fitting import parse_range

    with user_errors():
        paths = plot_results(results_files, out, fit=fit_file, metrics=split_list(metric, "--metric"),
                             fit_range=parse_range(fit_range, "--fit-range") if fit_range else None, overwrite=overwrite)
        typer.echo("wrote " + ", ".join(str(p) for p in paths))


def register(app: typer.Typer) -> None:
    app.command("plot")(plot)
