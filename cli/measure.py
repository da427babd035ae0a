"""``truncsens measure``: truncation sensitivity of a model on a corpus (re-encode semantics)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from truncsens.cli.errors import user_errors


def parse_int_list(text: Optional[str], what: str) -> Optional[list[int]]:
    """``"1,2,4"`` -> [1, 2, 4]; None stays None. Raises ValueError naming ``what``."""
    if text is None:
        return None
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what} is empty")
    return values


def default_out(model: str, corpus: Optional[str], domain: str, suffix: str = "") -> Path:
    """``results/<model name>-<corpus stem or domain><suffix>.nc`` (``:`` of synthetic specs as ``-``)."""
    stem = Path(model.replace(":", "-")).name
    if model.startswith("synthetic") and corpus in (None, "synthetic"):
        return Path("results") / f"{stem}{suffix}.nc"  # its own corpus: no domain
    return Path("results") / f"{stem}-{corpus and Path(corpus).stem or domain}{suffix}.nc"


def measure(
    ctx: typer.Context,
    model: str = typer.Option("reference", help="'reference' (bundled), a Hugging Face id, a local checkpoint folder, or synthetic:ALPHA."),
    domain: str = typer.Option("code", help="code or nl: picks the default corpus of the domain."),
    corpus: Optional[str] = typer.Option(None, help="Override the corpus: shipped manifest name, .yaml manifest, folder, .txt, .jsonl, or 'synthetic'."),
    split: str = typer.Option("auto", help="heldout, train, all, or auto (held-out for builtin corpora)."),
    text_field: str = typer.Option("text", help="Text field of a .jsonl corpus."),
    reference_context: Optional[int] = typer.Option(None, help="N: tokens of context of the reference distribution (default: model maximum)."),
    windows: Optional[str] = typer.Option(None, help="Comma-separated windows w (default: powers of two from 1 to N/2)."),
    sinks: int = typer.Option(0, help="First tokens of the reference context kept in front of every window (with --policy: sinks of sink_recent/poisson, default 4)."),
    positions: str = typer.Option("original", help="original (kept tokens keep their position ids) or reindexed."),
    targets_per_doc: int = typer.Option(8, help="Targets drawn per document."),
    max_docs: Optional[int] = typer.Option(None, help="Use at most this many (long enough) documents."),
    seed: int = typer.Option(0, help="Seed of the target draw."),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N, mps or auto."),
    dtype: str = typer.Option("float32", help="float32, bfloat16, float16 or float64 (divergences are float32 regardless)."),
    batch_tokens: Optional[int] = typer.Option(None, help="Token budget of one forward pass (default by device; halves on out-of-memory)."),
    docs_per_shard: int = typer.Option(8, help="Documents per shard file (an interruption loses at most one shard)."),
    out: Optional[Path] = typer.Option(None, help="Results file (default results/<model>-<domain>.nc)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its shards."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar with ETA."),
    # -- retention policies (truncsens.engine.retention): sweep budgets instead of windows --
    policy: Optional[str] = typer.Option(None, help="Comma-separated retention policies (suffix, sink_recent, random, poisson): measure D(k) at budgets instead of windows; several share the reference pass."),
    budgets: Optional[str] = typer.Option(None, help="With --policy: comma-separated budgets k, kept tokens of the target's query, its own included (default: powers of two from 16 to N/2)."),
    semantics: Optional[str] = typer.Option(None, help="With --policy: reencode, streaming (default) or prefill_evict."),
    score: str = typer.Option("attention", help="With --policy poisson: inclusion scores, attention (default) or key_norm."),
    per_query: bool = typer.Option(False, "--per-query", help="With --policy random: draw anew for every query instead of once per sequence."),
) -> None:
    """Measure D(w): divergences between p(.|full reference context) and p(.|last w tokens)."""
    from truncsens.engine.measure import MeasureConfig, run_measure

    if policy is not None or budgets is not None or semantics is not None:
        _measure_policies(locals())
        return
    if out is None:
        out = default_out(model, corpus, domain)
    with user_errors():
        cfg = MeasureConfig(
            model=model, domain=domain, corpus=corpus, split=split, text_field=text_field,
            reference_context=reference_context, windows=parse_int_list(windows, "--windows"), n_sink=sinks,
            positions=positions, targets_per_doc=targets_per_doc, max_docs=max_docs, seed=seed, device=device,
            dtype=dtype, max_batch_tokens=batch_tokens, docs_per_shard=docs_per_shard, out=str(out), resume=resume,
            progress=progress, command="truncsens " + " ".join(sys.argv[1:]),
        )
        _run_and_report(run_measure, cfg, Path(out), "window", "windows")


def _run_and_report(run, cfg, out: Path, sweep: str, what: str) -> None:
    """Run ``run(cfg)``; on failure say which shards were kept; on success print a summary table."""
    from truncsens import results
    from truncsens.summary import format_table, summarize

    try:
        summary = run(cfg)
    except BaseException:
        _report_kept_shards(out)
        raise
    if summary.n_targets < 0:  # not rank 0 of a multi-process run: rank 0 reports
        return
    typer.echo(
        f"wrote {summary.path}: {summary.n_targets} targets from {summary.n_docs} documents "
        f"({summary.n_docs_skipped} of {summary.n_docs_checked} too short for N={summary.reference_context}), "
        f"{what} {summary.windows[0]}..{summary.windows[-1]}"
        + (f", {summary.shards_reused} shards reused" if summary.shards_reused else ""))
    typer.echo(format_table(summarize(results.load(summary.path), ["tv", "kl"]), sweep))


def _report_kept_shards(out: Path) -> None:
    shard_dir = Path(str(out) + ".shards")
    kept = sorted(shard_dir.glob("shard-*.nc")) if shard_dir.is_dir() else []
    if kept:
        typer.echo(f"note: {len(kept)} finished shard(s) kept in {shard_dir}; rerun the same command with --resume to continue", err=True)


# ----------------------------------------------------------------------------- retention policies


def _measure_policies(opts: dict) -> None:
    """``measure --policy ...``: a budget sweep (truncsens.engine.retention.run_retention)."""
    from truncsens.engine.retention import DEFAULT_SINKS, RetentionConfig, run_retention
    from truncsens.policies import parse_policies

    def given(name: str) -> bool:  # whether an option was on the command line (not its default)
        source = opts["ctx"].get_parameter_source(name)
        return source is not None and source.name != "DEFAULT"

    out = opts["out"]
    with user_errors():
        if opts["policy"] is None:
            raise ValueError("--budgets and --semantics need --policy NAME (window sweeps are re-encode; "
                             "for a suffix window under another semantics use --policy suffix)")
        names = parse_policies(opts["policy"])
        if out is None:
            out = default_out(opts["model"], opts["corpus"], opts["domain"], "-policies")
        cfg = RetentionConfig(
            model=opts["model"], domain=opts["domain"], corpus=opts["corpus"], split=opts["split"],
            text_field=opts["text_field"], reference_context=opts["reference_context"],
            windows=parse_int_list(opts["windows"], "--windows"), n_sink=opts["sinks"] if given("sinks") else DEFAULT_SINKS,
            positions=opts["positions"], targets_per_doc=opts["targets_per_doc"], max_docs=opts["max_docs"],
            seed=opts["seed"], device=opts["device"], dtype=opts["dtype"], max_batch_tokens=opts["batch_tokens"],
            docs_per_shard=opts["docs_per_shard"], out=str(out), resume=opts["resume"], progress=opts["progress"],
            command="truncsens " + " ".join(sys.argv[1:]), policies=names,
            budgets=parse_int_list(opts["budgets"], "--budgets"), semantics=opts["semantics"] or "streaming",
            score=opts["score"], per_query=opts["per_query"],
        )
        _run_and_report(run_retention, cfg, Path(out), "budget",
                        f"policies {', '.join(names)}, semantics {cfg.semantics}, budgets")


def register(app: typer.Typer) -> None:
    app.command("measure")(measure)
