"""``truncsens train-reference``: train the bundled reference model and write its model card."""

from __future__ import annotations

from pathlib import Path

import typer

from truncsens.cli.errors import user_errors


def train_reference(
    out_dir: Path = typer.Option(Path("runs/reference"), help="Working folder (checkpoints, training log)."),
    minutes: float = typer.Option(115.0, help="Wall-clock budget; the learning rate decays to its floor by then."),
    max_steps: int = typer.Option(4000, help="Optimizer steps at most."),
    seed: int = typer.Option(0, help="Seed of initialisation and batch sampling."),
    install: bool = typer.Option(False, "--install", help="Copy the result into truncsens/models/reference/weights."),
) -> None:
    """Train the reference model on the builtin corpora's training split (about two hours on 2 CPU cores)."""
    from truncsens.api.reference import train_reference as train

    with user_errors():
        final, installed = train(out_dir, minutes=minutes, max_steps=max_steps, seed=seed, install=install)
        typer.echo(f"trained model and card in {final}")
        if installed:
            typer.echo(f"installed into {installed}")


def register(app: typer.Typer) -> None:
    app.command("train-reference")(train_reference)
