"""``truncsens train-reference``: train the bundled reference model and write its model card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

from truncsens.cli.errors import user_errors


def train_reference(
    out_dir: Path = typer.Option(Path("runs/reference"), help="Working folder (checkpoints, training log)."),
    minutes: float = typer.Option(115.0, help="Wall-clock budget; the learning rate decays to its floor by then."),
    max_steps: int = typer.Option(4000, help="Optimizer steps at most."),
    seed: int = typer.Option(0, help="Seed of initialisation and batch sampling."),
    install: bool = typer.Option(False, "--install", help="Copy the result into truncsens/reference/weights."),
) -> None:
    """Train the reference model on the builtin corpora's training split (about two hours on 2 CPU cores)."""
    from truncsens.models import REFERENCE_DIR, load_model
    from truncsens.reference.card import context_nll, write_card
    from truncsens.reference.train import TrainConfig, train

    with user_errors():
        final = train(TrainConfig(out_dir=str(out_dir), max_minutes=minutes, max_steps=max_steps, seed=seed))
        shutil.copy(out_dir / "train_log.csv", final / "train_log.csv")
        loaded = load_model(str(final))
        evals = [context_nll(loaded, d, [16, 64, 256]) for d in ("code", "nl")]
        summary = json.loads((final / "training_summary.json").read_text())
        write_card(final, evals, summary)
        typer.echo(f"trained model and card in {final}")
        if install:
            REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
            for f in final.iterdir():
                shutil.copy(f, REFERENCE_DIR / f.name)
            typer.echo(f"installed into {REFERENCE_DIR}")


def register(app: typer.Typer) -> None:
    app.command("train-reference")(train_reference)
