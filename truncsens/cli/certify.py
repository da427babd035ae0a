"""``truncsens certify``: error certificates of certainty-plus-Poisson eviction, measured
(coverage, Spearman, relative errors, output KL; arXiv 2607.21475)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from truncsens.certificates.options import CertifyCommandOptions
from truncsens.cli.errors import kept_shards_note, signals_stop_like_ctrl_c, user_errors
from truncsens.cli.options import AsJson, echo_report, run_command


@run_command(CertifyCommandOptions)
def certify(as_json: AsJson = False, **options: Any) -> None:
    """Measure the coverage and tightness of Hájek error certificates (poisson vs topk vs random)."""
    from truncsens.api.certify import certify_config, run_certification

    with user_errors(), signals_stop_like_ctrl_c():
        cfg = certify_config(**options, command="truncsens " + " ".join(sys.argv[1:]))
        # the figures and (unless resuming) the results file are checked together before anything is computed
        with kept_shards_note(cfg.out):
            done = run_certification(cfg, Path(cfg.out).with_suffix(""))
        for note in done.notes():
            typer.echo(f"note: {note}", err=True)
        if as_json:
            typer.echo(json.dumps(done.to_json(), indent=2, allow_nan=False))
        else:
            typer.echo(f"wrote {done.path} and {', '.join(map(str, done.figures))}")
            echo_report(done.table())


def register(app: typer.Typer) -> None:
    app.command("certify")(certify)
