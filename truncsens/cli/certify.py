"""``truncsens certify``: error certificates of certainty-plus-Poisson eviction, measured
(coverage, Spearman, relative errors, output KL; arXiv 2607.21475)."""

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
from truncsens.cli.options import DesignGranularity, DesignScore, ObsWindow, Temper, TopFraction, AsJson, BatchTokens, CertifyBudgets, CertifyDevice, CertifyDtype, CertifyModel, CertifySinks, Delta, Domain, Overwrite, Progress, Resume, Split



def certify(
    model: CertifyModel = "reference",
    domain: Domain = "code",
    corpus: Optional[str] = typer.Option(None, help=f"Override the corpus: {corpus_help()}."),
    split: Split = "auto",
    reference_context: Optional[int] = typer.Option(None, help="N: tokens of context (default: model maximum)."),
    budgets: CertifyBudgets = "12.5%,25%,50%",
    delta: Delta = 0.05,
    sinks: CertifySinks = 4,
    targets_per_doc: int = typer.Option(2, help="Targets drawn per document."),
    max_docs: Optional[int] = typer.Option(16, help="Use at most this many (long enough) documents."),
    seed: int = typer.Option(0, help="Seed of the target draw and the Poisson draws."),
    device: CertifyDevice = DEFAULT_DEVICE,
    dtype: CertifyDtype = "float32",
    batch_tokens: BatchTokens = None,
    out: Optional[Path] = typer.Option(None, help="Results file (default results/<model>-<domain>-certify.nc)."),
    resume: Resume = False,
    overwrite: Overwrite = False,
    progress: Progress = True,
    granularity: DesignGranularity = "head",
    score: DesignScore = "window",
    obs_window: ObsWindow = DEFAULT_OBS_WINDOW,
    temper: Temper = DEFAULT_TEMPER,
    top_fraction: TopFraction = 0.25,
    as_json: AsJson = False,
) -> None:
    """Measure the coverage and tightness of Hájek error certificates (poisson vs topk vs random)."""
    from truncsens.api.certify import certify_config, run_certification

    with user_errors():
        cfg = certify_config(
            model, domain=domain, corpus=corpus, split=split, reference_context=reference_context,
            budgets=budgets, delta=delta, sinks=sinks, targets_per_doc=targets_per_doc, max_docs=max_docs, seed=seed,
            device=device, dtype=dtype, batch_tokens=batch_tokens, out=out,
            resume=resume, overwrite=overwrite, progress=progress, granularity=granularity, score=score,
            obs_window=obs_window, temper=temper, top_fraction=top_fraction, command="truncsens " + " ".join(sys.argv[1:]))
        # the figures and (unless resuming) the results file are checked together before anything is computed
        done = run_certification(cfg, Path(cfg.out).with_suffix(""))
        if as_json:
            typer.echo(json.dumps(done.to_json(), indent=2, allow_nan=False))
        else:
            typer.echo(f"wrote {done.path} and {', '.join(map(str, done.figures))}")
            typer.echo(done.table())


def register(app: typer.Typer) -> None:
    app.command("certify")(certify)
