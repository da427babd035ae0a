"""``truncsens certify``: error certificates of certainty-plus-Poisson eviction, measured
(coverage, Spearman, relative errors, output KL; arXiv 2607.21475)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from truncsens.cli.errors import user_errors
from truncsens.cli.options import AsJson, BatchTokens, CertifyBudgets, CertifyDevice, CertifyDtype, CertifyModel, CertifySinks, Delta, Domain, Overwrite, Progress, Resume, Split



def certify(
    model: CertifyModel = "reference",
    domain: Domain = "code",
    corpus: Optional[str] = typer.Option(None, help="Override the corpus: manifest name, .yaml manifest, folder, .txt or .jsonl."),
    split: Split = "auto",
    reference_context: Optional[int] = typer.Option(None, help="N: tokens of context (default: model maximum)."),
    budgets: CertifyBudgets = "12.5%,25%,50%",
    delta: Delta = 0.05,
    sinks: CertifySinks = 4,
    targets_per_doc: int = typer.Option(2, help="Targets drawn per document."),
    max_docs: Optional[int] = typer.Option(16, help="Use at most this many (long enough) documents."),
    seed: int = typer.Option(0, help="Seed of the target draw and the Poisson draws."),
    device: CertifyDevice = "cpu",
    dtype: CertifyDtype = "float32",
    batch_tokens: BatchTokens = None,
    out: Optional[Path] = typer.Option(None, help="Results file (default results/<model>-<domain>-certify.nc)."),
    resume: Resume = False,
    overwrite: Overwrite = False,
    progress: Progress = True,
    as_json: AsJson = False,
) -> None:
    """Measure the coverage and tightness of Hájek error certificates (poisson vs topk vs random)."""
    from truncsens import results
    from truncsens.certify.config import CertifyConfig
    from truncsens.certify.report import certify_figure_paths, format_summary, save_figures, summarize
    from truncsens.certify.run import run_certify

    from truncsens.fit.fit_file import check_new_files, sanitize

    with user_errors():
        cfg = CertifyConfig(
            model=model, domain=domain, corpus=corpus, split=split, reference_context=reference_context,
            budgets=budgets, delta=delta, n_sink=sinks, targets_per_doc=targets_per_doc, max_docs=max_docs, seed=seed,
            device=device, dtype=dtype, max_batch_tokens=batch_tokens, out=None if out is None else str(out),
            resume=resume, overwrite=overwrite, progress=progress, command="truncsens " + " ".join(sys.argv[1:]))
        # before anything is computed: the figures and (unless resuming) the results file, named together
        check_new_files([*([] if resume else [cfg.out]), *certify_figure_paths(Path(cfg.out).with_suffix(""))], overwrite)
        done = run_certify(cfg)
        ds = results.load(done.path)
        summary = summarize(ds, seed=cfg.seed)
        figures = save_figures(ds, summary, Path(done.path).with_suffix(""))
        summary["files"] = [str(done.path), *map(str, figures)]
        if as_json:
            typer.echo(json.dumps(sanitize(summary), indent=2, allow_nan=False))
        else:
            typer.echo(f"wrote {done.path} and {', '.join(map(str, figures))}")
            typer.echo(format_summary(summary))


def register(app: typer.Typer) -> None:
    app.command("certify")(certify)
