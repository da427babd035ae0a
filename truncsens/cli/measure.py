"""``truncsens measure``: truncation sensitivity of a model on a corpus (window or policy sweep)."""

from __future__ import annotations

import sys
from typing import Any

import typer

from truncsens.cli.errors import kept_shards_note, signals_stop_like_ctrl_c, user_errors
from truncsens.cli.options import run_command
from truncsens.engine.options import MeasureOptions


@run_command(MeasureOptions)
def measure(**options: Any) -> None:
    """Measure D(w): divergences between p(.|full reference context) and p(.|last w tokens)."""
    from truncsens.engine.argument_checks import check_values
    from truncsens.engine.options import config_fields

    with user_errors():  # what the values say alone is refused before torch is imported
        check_values(config_fields(MeasureOptions, options))
    from truncsens.api.measure import measure_config, run_measurement

    with user_errors(), signals_stop_like_ctrl_c():
        cfg = measure_config(**options, command="truncsens " + " ".join(sys.argv[1:]))
        _run_and_report(run_measurement, cfg)


def _run_and_report(run, cfg) -> None:
    """Run ``run(cfg)``; on failure say which shards of this run were kept; on success print a summary table."""
    from truncsens.api.load import load
    from truncsens.report.summary import format_table, summarize
    from truncsens.report.tables import fmt_count
    from truncsens.metrics import DEFAULT_METRICS, present

    with kept_shards_note(cfg.out):
        summary = run(cfg)
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
        f"wrote {summary.path}: {fmt_count(summary.n_targets, 'target')} from {fmt_count(summary.n_docs, 'document')} "
        f"({summary.n_docs_skipped} of {summary.n_docs_checked} too short for N={summary.reference_context}), "
        f"{what} {points}"
        + (f", {fmt_count(summary.shards_reused, 'shard')} reused" if summary.shards_reused else ""))
    for note in extra.get("notes", ()):
        typer.echo(f"note: {note}", err=True)
    shown = list(present(DEFAULT_METRICS))  # in results-file order: tv, kl
    typer.echo(format_table(summarize(load(summary.path), shown), summary.sweep_dim))


def register(app: typer.Typer) -> None:
    app.command("measure")(measure)
