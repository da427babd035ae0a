"""``truncsens train-reference``: train the bundled reference model and write its model card."""

from __future__ import annotations

from pathlib import Path

import typer

from truncsens.cli.errors import user_errors


def train_reference(
    out_dir: Path = typer.Option(Path("runs/reference"), help="Working folder (checkpoint, training log, exported model)."),
    minutes: float = typer.Option(170.0, help="Wall-clock budget of this call: the run checkpoints and stops; run again to resume."),
    max_steps: int = typer.Option(2000, help="Optimizer steps of the main stage (its learning rate reaches its floor there)."),
    recall_steps: int = typer.Option(0, help="Optimizer steps of a recall stage after it (dense key-value recall; 0: none; the installed model's three recall stages: 800, 1000 and 600, see docs/reference-model.md)."),
    recall_warm_context: int = typer.Option(512, help="Crop length of the recall stage's first --recall-warm-steps steps."),
    recall_warm_steps: int = typer.Option(150, help="Steps of the recall stage on shorter crops."),
    recall_warm_doublings: int = typer.Option(0, help="Split those steps in n + 1 equal phases whose crops double from --recall-warm-context (0: one phase)."),
    recall_name_words: int = typer.Option(200, help="Name parts of the dense key-value format: the most frequent this many words."),
    recall_kv_share: float = typer.Option(0.6, help="Share of the recall stage's sequences in the dense key-value format."),
    recall_repeat_share: float = typer.Option(0.2, help="Share of the recall stage's sequences with long-range repeats (the rest: corpus text)."),
    recall_lr: float = typer.Option(1e-3, help="Peak learning rate of the recall stage (cosine decay to --min-lr)."),
    min_lr: float = typer.Option(2e-4, help="Floor to which each stage's learning rate decays (cosine); at most each peak."),
    recall_repeat_spans: int = typer.Option(4, help="Spans copied forward in each of the recall stage's repeat sequences."),
    recall_repeat_min_distance: int = typer.Option(64, help="Shortest distance of those copies in tokens (log-uniform up to the crop length)."),
    recall_induction_share: float = typer.Option(0.0, help="Share of the recall stage's sequences whose repeated spans are first replaced by frequency-drawn tokens (induction sequences, truncsens/models/reference/data.py); with --recall-kv-share and --recall-repeat-share it sums to at most 1."),
    init_from: str = typer.Option("", help="Start at the recall stage from this exported model folder's weights and tokenizer ('reference': the bundled model), skipping the main stage."),
    seed: int = typer.Option(0, help="Seed of initialisation and batch sampling."),
    stage_name: str = typer.Option("", help="What the model card calls this run (default: 'main', 'main + recall' with --recall-steps, or 'recall' with --init-from); a label, not part of the recipe."),
    threads: int = typer.Option(0, help="torch CPU threads (0: torch's default)."),
    install: bool = typer.Option(False, "--install", help="Copy the finished result into truncsens/models/reference/weights."),
    rewrite_card: Path = typer.Option(None, help="Only write the model card of this exported model folder again, from its eval.json and training_summary.json (no training; the other options are ignored)."),
) -> None:
    """Train the reference model (resumable: run again to continue from the checkpoint in --out-dir)."""
    from truncsens.api.reference import rewrite_card as rewrite
    from truncsens.api.reference import train_reference as train

    with user_errors():
        if rewrite_card is not None:
            typer.echo(f"model card written again: {rewrite(rewrite_card)}")
            return
        final, installed, summary = train(out_dir, minutes=minutes, max_steps=max_steps, recall_steps=recall_steps,
                                          seed=seed, install=install, threads=threads,
                                          recall_warm_context=recall_warm_context, recall_warm_steps=recall_warm_steps,
                                          recall_warm_doublings=recall_warm_doublings,
                                          recall_name_words=recall_name_words, recall_kv_share=recall_kv_share,
                                          recall_repeat_share=recall_repeat_share, recall_lr=recall_lr, min_lr=min_lr,
                                          recall_repeat_spans=recall_repeat_spans,
                                          recall_repeat_min_distance=recall_repeat_min_distance,
                                          recall_induction_share=recall_induction_share, init_from=init_from,
                                          stage_name=stage_name)
        if not summary["finished"]:
            typer.echo(f"stopped at step {summary['steps']} of {max_steps + recall_steps} ({summary['minutes']:.1f} minutes so far); "
                       f"run the same command again to resume from {out_dir / 'checkpoint.pt'}")
            return
        typer.echo(f"trained model and card in {final}")
        if installed:
            typer.echo(f"installed into {installed}")


def register(app: typer.Typer) -> None:
    app.command("train-reference")(train_reference)
