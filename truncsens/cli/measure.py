"""``truncsens measure``: truncation sensitivity of a model on a corpus (window or policy sweep)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from truncsens import DEFAULT_DEVICE
from truncsens.cli.errors import user_errors
from truncsens.corpora import corpus_help
from truncsens.cli.options import Domain, Overwrite, Resume, Split


def measure(
    model: str = typer.Option("reference", help="'reference' (bundled), a Hugging Face id, a local checkpoint folder, or synthetic:ALPHA."),
    domain: Domain = "code",
    corpus: Optional[str] = typer.Option(None, help="Override the corpus: " + corpus_help("'synthetic'") + "."),
    split: Split = "auto",
    text_field: str = typer.Option("text", help="Text field of a .jsonl corpus."),
    reference_context: Optional[int] = typer.Option(None, help="N: tokens of context of the reference distribution (default: model maximum)."),
    windows: Optional[List[str]] = typer.Option(None, help="Windows w, repeated or comma-separated (default: powers of two from 1 to N/2)."),
    sinks: Optional[int] = typer.Option(None, help="First tokens of the reference context kept in front of every window (default 0; with --policy: sinks of sink_recent/poisson, default 4)."),
    positions: str = typer.Option("original", help="original (kept tokens keep their position ids) or reindexed."),
    targets_per_doc: int = typer.Option(8, help="Targets drawn per document (with --protocol block they come in blocks of at most this many consecutive targets)."),
    max_docs: Optional[int] = typer.Option(None, help="Use at most this many (long enough) documents."),
    seed: int = typer.Option(0, help="Seed of the target draw (and of randomized policies unless --policy-seed is given)."),
    device: str = typer.Option(DEFAULT_DEVICE, help="auto (CUDA when present, else cpu), cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("float32", help="float32, bfloat16, float16 or float64 of the forward passes (divergences are computed in float64 and stored as float32 regardless)."),
    batch_tokens: Optional[int] = typer.Option(None, help="Token budget of one forward pass (default by device; halves on out-of-memory)."),
    docs_per_shard: int = typer.Option(8, help="Documents per shard file (an interruption loses at most one shard)."),
    out: Optional[Path] = typer.Option(None, help="Results file (default results/<model>-<domain>.nc)."),
    resume: Resume = False,
    overwrite: Overwrite = False,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar with ETA."),
    # -- retention policies (truncsens.engine.retention): sweep budgets instead of windows --
    policy: Optional[List[str]] = typer.Option(None, help="Retention policies (suffix, sink_recent, random, poisson, h2o, tova, key_norm, snapkv, topk), repeated or comma-separated: measure D(k) at budgets instead of windows; several share the reference pass."),
    budgets: Optional[List[str]] = typer.Option(None, help="With --policy: budgets k, repeated or comma-separated: kept tokens of the target's query, its own included (default: powers of two from 16 to N/2)."),
    semantics: Optional[str] = typer.Option(None, help="With --policy: reencode, streaming (default) or prefill_evict; with --per-layer: prefill_evict (default) or streaming."),
    score: str = typer.Option("attention", help="With --policy poisson: inclusion scores, attention (default) or key_norm."),
    per_query: bool = typer.Option(False, "--per-query", help="With --policy random: draw anew for every query instead of once per sequence (not under streaming)."),
    policy_arg: Optional[List[str]] = typer.Option(None, help="With --policy kvpress:<PressClass>: a press parameter key=value (repeatable; int, float, true/false or text), e.g. n_sink=8."),
    chunk: int = typer.Option(1, help="With --semantics streaming: tokens processed between eviction decisions (1: token by token; larger: evict at chunk ends)."),
    protocol: str = typer.Option("exact", help="exact (one pass per target and window) or block (K consecutive targets per pass: re-encode window sweeps; policy sweeps under streaming and prefill_evict, one pass per block; docs/method.md)."),
    block_fraction: float = typer.Option(0.125, help="With --protocol block: targets per pass as a fraction of the window, K = max(1, min(block size, floor(w x fraction)))."),
    block_size: int = typer.Option(64, help="With --protocol block: at most this many targets per pass (and per block)."),
    granularity: str = typer.Option("token", help="With --semantics streaming or prefill_evict: token (one kept set for all layers and heads) or head (one per key/value head, shared by the layers; the budget counts per head)."),
    draws: int = typer.Option(1, help="With --policy random or poisson: independent draws of each randomized policy (R > 1 adds a 'draw' dim; readers average over it)."),
    policy_seed: Optional[int] = typer.Option(None, help="Seed of the randomized policies' draws (default: --seed); the targets stay those of --seed."),
    per_layer: bool = typer.Option(False, "--per-layer", help="Per-layer window sweep: D_l(w) for each layer alone keeping its sinks (default 4) and last w keys, every other layer its full cache (--semantics prefill_evict or streaming); results gain a 'layer' dim."),
) -> None:
    """Measure D(w): divergences between p(.|full reference context) and p(.|last w tokens)."""
    from truncsens.api.measure import measure_config, run_measurement
    from truncsens.cli.options import int_list, split_list
    from truncsens.policies.kvpress_adapter import parse_policy_args

    with user_errors():
        cfg = measure_config(
            model, domain=domain, corpus=corpus, split=split, text_field=text_field,
            reference_context=reference_context, windows=int_list(windows, "--windows"),
            policies=split_list(policy, "--policy"),
            budgets=int_list(budgets, "--budgets"), semantics=semantics, sinks=sinks, positions=positions,
            score=score, per_query=per_query, policy_args=parse_policy_args(policy_arg), chunk=chunk, granularity=granularity, draws=draws, policy_seed=policy_seed,
            per_layer=per_layer,
            protocol=protocol, block_fraction=block_fraction, block_size=block_size,
            targets_per_doc=targets_per_doc, max_docs=max_docs, seed=seed,
            device=device, dtype=dtype, batch_tokens=batch_tokens, docs_per_shard=docs_per_shard,
            out=out, resume=resume, overwrite=overwrite, progress=progress,
            command="truncsens " + " ".join(sys.argv[1:]),
        )
        _run_and_report(run_measurement, cfg)


def _run_and_report(run, cfg) -> None:
    """Run ``run(cfg)``; on failure say which shards were kept; on success print a summary table."""
    from truncsens.api.load import load
    from truncsens.engine.run.shards import kept_shards, shard_dir_for
    from truncsens.report.summary import format_table, summarize
    from truncsens.metrics import DEFAULT_METRICS, present

    try:
        summary = run(cfg)
    except BaseException:
        kept = kept_shards(cfg.out)
        if kept:
            typer.echo(f"note: {len(kept)} finished shard(s) kept in {shard_dir_for(cfg.out)}; "
                       "rerun the same command with --resume to continue", err=True)
        raise
    if summary.n_targets < 0:  # not rank 0 of a multi-process run: rank 0 reports
        return
    extra = summary.extra
    what = (f"policies {', '.join(extra['policies'])}, semantics {extra['semantics']}, budgets"
            if "policies" in extra else "windows")
    if "per_layer" in extra:
        what = f"each of {extra['per_layer']} layers alone, semantics {extra['semantics']}, windows"
    if "protocol" in extra:
        what = f"{extra['protocol']} protocol, {what}"
    points = (", ".join(str(v) for v in summary.sweep) if len(summary.sweep) <= 3
              else f"{summary.sweep[0]}..{summary.sweep[-1]}")  # a few points listed, a range otherwise
    typer.echo(
        f"wrote {summary.path}: {summary.n_targets} targets from {summary.n_docs} "
        f"document{'' if summary.n_docs == 1 else 's'} "
        f"({summary.n_docs_skipped} of {summary.n_docs_checked} too short for N={summary.reference_context}), "
        f"{what} {points}"
        + (f", {summary.shards_reused} shard{'s' if summary.shards_reused > 1 else ''} reused" if summary.shards_reused else ""))
    shown = list(present(DEFAULT_METRICS))  # in results-file order: tv, kl
    typer.echo(format_table(summarize(load(summary.path), shown), summary.sweep_dim))


def register(app: typer.Typer) -> None:
    app.command("measure")(measure)
