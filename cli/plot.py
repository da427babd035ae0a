"""``truncsens plot RESULTS [--fit FIT] --out PREFIX``: log-log D(w) with se bars and fitted laws."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from truncsens.cli.errors import user_errors


def plot(
    results_files: List[Path] = typer.Argument(..., metavar="RESULTS...", help="Results file(s) from `truncsens measure`."),
    fit_file: Optional[Path] = typer.Option(None, "--fit", help="Fit file from `truncsens fit` whose laws to draw (default: fit now, without intervals)."),
    out: Path = typer.Option(..., "--out", help="Output prefix: PREFIX.png and PREFIX.pdf are written."),
    metric: Optional[List[str]] = typer.Option(None, "--metric", "-m", help="Metric panels (default: tv, kl, kl_reverse, js)."),
    fit_range: Optional[str] = typer.Option(None, "--fit-range", help="Fit range LO:HI when fitting now."),
) -> None:
    """One panel per metric: mean D(w) ± se on log-log axes, with the fitted laws."""
    from truncsens.fitting import DEFAULT_METRICS, FitConfig, fit_results, parse_range, read_fit_file
    from truncsens.plots import plot_report

    with user_errors():
        metrics = tuple(metric) if metric else DEFAULT_METRICS
        if fit_file is not None:
            fitted = read_fit_file(fit_file)
            have = {m for c in fitted["curves"] for m in c["metrics"]}
            metrics = tuple(m for m in metrics if m in have) if not metric else metrics
        cfg = FitConfig(metrics=metrics, n_boot=0, fit_range=parse_range(fit_range, "--fit-range") if fit_range else None)
        doc = fit_results([str(p) for p in results_files], cfg).to_json()
        if fit_file is not None:
            doc = _use_fits_from(doc, fitted, fit_file)
        paths = plot_report(doc, out, metrics)
        typer.echo("wrote " + ", ".join(str(p) for p in paths))


def _identity(prov: dict) -> tuple:
    keys = ("model", "created", "corpus_sha256", "command", "seed", "domain", "reference_context", "n_sink", "positions")
    return tuple(str(prov.get(k, "")) for k in keys)


def _same_curve(a: dict, b: dict) -> bool:
    """Same provenance, policy and measured means (the fit was made from this very results file)."""
    if _identity(a["provenance"]) != _identity(b["provenance"]) or a.get("policy") != b.get("policy"):
        return False
    for m, v in a["metrics"].items():
        if m in b["metrics"]:
            x = np.array([np.nan if t is None else t for t in v["mean"]], dtype=float)
            y = np.array([np.nan if t is None else t for t in b["metrics"][m]["mean"]], dtype=float)
            if x.shape != y.shape or not np.allclose(x, y, rtol=1e-9, atol=0, equal_nan=True):
                return False
    return True


def _use_fits_from(doc: dict, fitted: dict, fit_path: Path) -> dict:
    """Replace the laws of ``doc`` by those of a fit file made from the same results files."""
    fits = []
    for c in doc["curves"]:
        match = next((f for f in fitted["curves"] if _same_curve(c, f)), None)
        if match is None:
            raise ValueError(f"{fit_path} was not made from {c['results_file']} (provenance or curve differs); "
                             "refit it or drop --fit")
        fits.extend({**f, "curve": c["index"]} for f in fitted["fits"] if f["curve"] == match["index"])
        c["fit_range"] = match["fit_range"]
    return {**doc, "fits": fits}


def register(app: typer.Typer) -> None:
    app.command("plot")(plot)
