"""``truncsens certify-attribution``: do error certificates attribute task failures to eviction, and
does certificate-gated recomputation pay (arXiv 2607.21475)? Long-range copy targets and synthetic
key-value recall, measured with the passes of ``truncsens certify``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from truncsens.certificates.designs import DEFAULT_OBS_WINDOW, DEFAULT_TEMPER
from truncsens import DEFAULT_DEVICE
from truncsens.cli.errors import user_errors
from truncsens.corpora import corpus_help
from truncsens.cli.options import DesignGranularity, DesignScore, ObsWindow, Temper, TopFraction, AsJson, BatchTokens, CertifyBudgets, CertifyDevice, CertifyDtype, CertifyModel, CertifySinks, Delta, Domain, Overwrite, Progress, Split


def certify_attribution(
    model: CertifyModel = "reference",
    domain: Domain = "code",
    corpus: Optional[str] = typer.Option(None, help=f"Override the corpus searched for copy targets: {corpus_help()}."),
    split: Split = "auto",
    reference_context: int = typer.Option(512, help="N: tokens of context of every target."),
    budgets: CertifyBudgets = "12.5%,25%,50%",
    delta: Delta = 0.05,
    sinks: CertifySinks = 4,
    max_docs: Optional[int] = typer.Option(16, help="Held-out documents searched for copy targets."),
    copy_per_doc: int = typer.Option(4, help="Copy targets drawn per document."),
    copy_rule: str = typer.Option("induction", help="induction (the token before the target also precedes its earlier occurrence), span (the 4 tokens before it do, and nowhere nearer) or token (the token alone)."),
    kv_docs: int = typer.Option(8, help="Synthetic key-value recall documents (one target each)."),
    min_distance: Optional[int] = typer.Option(None, help="D: the copied token lies at least D tokens back and not in the last D - 1 (default N/4)."),
    trajectory: int = typer.Option(0, help="Also run a greedy trajectory of this many steps under poisson eviction and report its e-process (0: none)."),
    trajectory_budget: str = typer.Option("25%", help="Budget of the trajectory: a token count or a percentage of N."),
    seed: int = typer.Option(0, help="Seed of the target draw, the key-value documents and the Poisson draws."),
    device: CertifyDevice = DEFAULT_DEVICE,
    dtype: CertifyDtype = "float32",
    batch_tokens: BatchTokens = None,
    out: Optional[Path] = typer.Option(None, help="Results file (default results/<model>-<domain>-attribution.nc)."),
    overwrite: Overwrite = False,
    progress: Progress = True,
    granularity: DesignGranularity = "head",
    score: DesignScore = "window",
    obs_window: ObsWindow = DEFAULT_OBS_WINDOW,
    temper: Temper = DEFAULT_TEMPER,
    top_fraction: TopFraction = 0.25,
    as_json: AsJson = False,
) -> None:
    """Attribution AUCs and gated recomputation of poisson eviction's certificates (vs confidence, random)."""
    from truncsens.api.certify_attribution import attribution_config, run_attribution_report

    with user_errors():
        cfg = attribution_config(
            model, domain=domain, corpus=corpus, split=split, reference_context=reference_context,
            budgets=budgets, delta=delta, sinks=sinks, max_docs=max_docs, copy_per_doc=copy_per_doc, copy_rule=copy_rule,
            kv_docs=kv_docs,
            min_distance=min_distance, trajectory=trajectory, trajectory_budget=trajectory_budget, seed=seed,
            device=device, dtype=dtype, batch_tokens=batch_tokens, out=out,
            overwrite=overwrite, progress=progress, granularity=granularity, score=score,
            obs_window=obs_window, temper=temper, top_fraction=top_fraction, command="truncsens " + " ".join(sys.argv[1:]))
        # the results file and its figure are checked together before anything is computed
        done = run_attribution_report(cfg, Path(cfg.out).with_suffix(""))
        if as_json:
            typer.echo(json.dumps(done.to_json(), indent=2, allow_nan=False))
        else:
            typer.echo(f"wrote {done.path} and {done.figure}")
            typer.echo(done.table())


def register(app: typer.Typer) -> None:
    app.command("certify-attribution")(certify_attribution)
