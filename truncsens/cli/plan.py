"""``truncsens plan``: per-layer KV windows from measured per-layer sensitivity, validated against the
uniform window and a linear schedule at equal KV bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from truncsens import DEFAULT_DEVICE
from truncsens.cli.errors import user_errors
from truncsens.corpora import corpus_help


def plan(
    model: str = typer.Option("reference", metavar="MODEL", help="'reference' (bundled), a Hugging Face id or a local checkpoint folder."),
    domain: str = typer.Option("code", metavar="DOMAIN", help="Builtin domain: code or nl."),
    corpus: Optional[str] = typer.Option(None, metavar="CORPUS", help=f"Override the corpus: {corpus_help()}."),
    reference_context: Optional[int] = typer.Option(None, help="N: tokens of context (default: model maximum)."),
    average_window: Optional[List[str]] = typer.Option(None, "--average-window", help="Budget as the average window per layer (recent keys; sinks on top), repeated or comma-separated (default 64,256)."),
    kv_bytes: Optional[List[str]] = typer.Option(None, "--kv-bytes", help="Budget in KV bytes per sequence (sinks included), instead of --average-window; repeated or comma-separated."),
    eps: Optional[List[str]] = typer.Option(None, "--eps", metavar="EPS", help="Budget as a distortion to reach: the smallest KV budget whose plan the per-layer laws predict at or below it; repeated or comma-separated."),
    sweep: Optional[List[str]] = typer.Option(None, metavar="LIST", help="Windows of the per-layer sweep, repeated or comma-separated (default 4,8,...,N/2)."),
    sinks: int = typer.Option(4, help="First keys every windowed layer keeps."),
    metric: str = typer.Option("kl", metavar="METRIC", help="Divergence planned for (kl, tv, js, ...)."),
    semantics: str = typer.Option("prefill_evict", metavar="NAME", help="prefill_evict (keys from the full-context prefill, then each layer keeps its window) or streaming (every token processed under its layers' windows)."),
    targets_per_doc: int = typer.Option(4, help="Targets per document (half the documents fit, half validate)."),
    max_docs: Optional[int] = typer.Option(16, help="Use at most this many (long enough) documents."),
    bootstrap: int = typer.Option(200, "--bootstrap", help="Document-bootstrap resamples of every interval."),
    seed: int = typer.Option(0, help="Seed of the targets and the bootstrap."),
    device: Optional[str] = typer.Option(DEFAULT_DEVICE, metavar="DEVICE", help="auto (CUDA when present, else cpu), cpu, cuda, cuda:N or mps."),
    dtype: Optional[str] = typer.Option(None, metavar="DTYPE", help="float32, bfloat16, float16 or float64 (default float32)."),
    out: Optional[Path] = typer.Option(None, "--out", "--json-out", help="Write the plan JSON here."),
    plot_out: Optional[Path] = typer.Option(None, "--plot-out", help="Draw D_l(w) per layer with the planned windows: PREFIX.png and PREFIX.pdf (a .png or .pdf suffix is dropped)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan JSON instead of the table."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing plan file or figure."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress."),
) -> None:
    """Plan per-layer KV windows for a KV budget from each layer's measured sensitivity (prefill-evict or streaming)."""
    from truncsens.api.plan import plan as make_plan
    from truncsens.cli.options import echo_report, float_list, int_list

    with user_errors():
        averages = float_list(average_window, "--average-window")
        budgets = int_list(kv_bytes, "--kv-bytes")
        eps_values = float_list(eps, "--eps")
        if averages is None and budgets is None and eps_values is None:
            averages = [64.0, 256.0]
        report = make_plan(model, domain=domain, corpus=corpus, reference_context=reference_context,
                           average_windows=averages, kv_bytes=budgets, eps=eps_values,
                           sweep=int_list(sweep, "--sweep"), sinks=sinks, metric=metric,
                           targets_per_doc=targets_per_doc, max_docs=max_docs, seed=seed, n_boot=bootstrap,
                           device=device, dtype=dtype, out=out, plot_out=plot_out, overwrite=overwrite,
                           progress=progress, semantics=semantics)
        if as_json:
            typer.echo(json.dumps(report.to_json(), indent=1, allow_nan=False))
        else:
            echo_report(report.table())
            if report.written:
                typer.echo("wrote " + ", ".join(str(p) for p in report.written))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
