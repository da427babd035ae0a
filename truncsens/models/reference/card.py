"""The reference model's card: ``README.md`` and ``eval.json`` in its weights folder, written from the
held-out evaluations (:func:`truncsens.api.reference.context_nll`, which runs the engine) and the
training summary. This module only writes text; it imports no engine.
"""

from __future__ import annotations

import json
from pathlib import Path

CARD_CONTEXTS = (16, 64, 256, 1024)  # shorter contexts evaluated beside the model's maximum


def write_card(folder: Path, evaluations: list[dict], summary: dict) -> Path:
    """Write README.md (the model card) and eval.json into the weights folder.

    Args:
        folder: the checkpoint folder.
        evaluations: one dict per domain, as :func:`truncsens.api.reference.context_nll` returns.
        summary: ``training_summary.json`` of :func:`truncsens.models.reference.train.train`.

    Returns:
        the README.md path.
    """
    folder = Path(folder)
    (folder / "eval.json").write_text(json.dumps({"evaluations": evaluations, "training": summary}, indent=2))
    cfg = summary.get("config", {})
    lines = [
        "# truncsens reference model",
        "",
        "A small Llama-architecture causal LM (RoPE, RMSNorm, SwiGLU, tied embeddings) with a byte-level BPE",
        "tokenizer, trained by `truncsens train-reference` on the training split of the builtin corpora",
        "(`code`: CPython standard-library sources; `nl`: pydoc topics and standard-library docstrings) of",
        "CPython 3.11. It exists so truncsens can run end to end without a model hub; it is not a useful",
        "language model. Weights are stored in bfloat16 and upcast on load.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {summary.get('parameters', 0):,} |",
        f"| layers / hidden / heads / FFN | {cfg.get('num_layers')} / {cfg.get('hidden_size')} / {cfg.get('num_heads')} / {cfg.get('intermediate_size')} |",
        f"| vocabulary | {cfg.get('vocab_size')} (byte-level BPE) |",
        f"| context (max positions) | {cfg.get('context')} |",
        f"| optimizer steps | {summary.get('steps')} (batch {cfg.get('batch_size')} x {cfg.get('context')} tokens) |",
        f"| tokens seen | {summary.get('tokens_seen', 0):,} |",
        f"| training time | {summary.get('minutes', 0):.0f} minutes on 2 CPU cores (bf16 autocast), seed {cfg.get('seed')} |",
        "",
        "## Held-out NLL by context length",
        "",
        "Mean next-token NLL in nats/token on the held-out split, with the context cut to the last c tokens",
        "(standard errors over documents). The gain of the maximum context over c tokens is NLL(c) - NLL(max),",
        "paired per target (same targets, standard error over documents).",
        "",
    ]
    for ev in evaluations:
        ctx = list(ev["nll"].keys())
        lines.append(f"**{ev['domain']}** ({ev['n_docs']} documents, {ev['n_targets']} targets)")
        lines.append("")
        lines.append("| context | " + " | ".join(ctx) + " | gain 16 -> max |")
        lines.append("|---" * (len(ctx) + 2) + "|")
        cells = [f"{m:.3f} ± {s:.3f}" for m, s in ev["nll"].values()]
        g = ev["gain_shortest_to_max"]
        lines.append("| NLL | " + " | ".join(cells) + f" | {g[0]:.3f} ± {g[1]:.3f} |")
        if "gain_to_max" in ev:
            gains = [f"{m:.3f} ± {s:.3f}" for m, s in ev["gain_to_max"].values()]
            lines.append("| gain of max over c | " + " | ".join(gains) + " | 0 | |")
        lines.append("")
    lines += ["Training curve: `train_log.csv` beside this card (held-out code NLL by position in 1024-token crops).", ""]
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    return path
