"""``truncsens certify-attribution``: do error certificates attribute task failures to eviction, and
does certificate-gated recomputation pay (arXiv 2607.21475)? Long-range copy targets and synthetic
key-value recall, measured with the passes of ``truncsens certify``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from truncsens.certificates.options import AttributionOptions
from truncsens.cli.errors import kept_shards_note, signals_stop_like_ctrl_c, user_errors
from truncsens.cli.options import AsJson, echo_report, run_command


@run_command(AttributionOptions)
def certify_attribution(as_json: AsJson = False, **options: Any) -> None:
    """Attribution AUCs and gated recomputation of poisson eviction's certificates (vs confidence, random)."""
    from truncsens.api.certify_attribution import attribution_config, run_attribution_report

    with user_errors(), signals_stop_like_ctrl_c():
        cfg = attribution_config(**options, command="truncsens " + " ".join(sys.argv[1:]))
        # the results file (unless resuming) and its figures are checked together before anything is computed
        with kept_shards_note(cfg.out):
            done = run_attribution_report(cfg, Path(cfg.out).with_suffix(""))
        for note in done.notes():
            typer.echo(f"note: {note}", err=True)
        if as_json:
            typer.echo(json.dumps(done.to_json(), indent=2, allow_nan=False))
        else:
            typer.echo(f"wrote {done.path}, {done.figure} and " + ", ".join(map(str, done.head_figures)))
            echo_report(done.table())


def register(app: typer.Typer) -> None:
    app.command("certify-attribution")(certify_attribution)
