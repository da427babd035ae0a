"""The reference model's card: ``README.md`` and ``eval.json`` in its weights folder, written from the
held-out evaluations (:func:`truncsens.api.reference.context_nll`, which runs the engine) and the
training summary. This module only writes text; it imports no engine.
"""

from __future__ import annotations

import json
from pathlib import Path

CARD_CONTEXTS = (16, 64, 256, 1024)  # shorter contexts evaluated beside the model's maximum


def _recall_schedule(cfg: dict) -> str:
    """The crop schedule and name vocabulary of a recall stage for its card row (``; the first S on
    W-token crops doubling in n phases; names from K words``), from the fields its config has (a
    config from before them: an empty string)."""
    if not cfg.get("recall_warm_steps"):
        return ""
    growth = f" doubling in {cfg['recall_warm_doublings'] + 1} phases" if cfg.get("recall_warm_doublings") else ""
    names = f"; names from {cfg['recall_name_words']} words" if "recall_name_words" in cfg else ""
    return f"; the first {cfg['recall_warm_steps']} on {cfg['recall_warm_context']}-token crops{growth}{names}"


def _repeat_form(cfg: dict) -> str:
    """How the recall stage's repeats were drawn, where not the default 4 spans from 64 tokens back, and
    its share of induction sequences (data.py), where it has any."""
    spans, distance = cfg.get("recall_repeat_spans") or 4, cfg.get("recall_repeat_min_distance") or 64
    form = "" if (spans, distance) == (4, 64) else f" ({spans} spans each, {distance} tokens back or more)"
    share = cfg.get("recall_induction_share") or 0
    return form + (f", {100 * share:.0f} % induction sequences (the same repeats of frequency-drawn spans)" if share else "")


def _earlier(stages: list[dict]) -> str:
    """The card row of the recall stages the starting model was trained with (oldest first)."""
    return "; then ".join(
        f"{st['recall_steps']} steps from `{st['init_from']}` (sha256 {(st.get('init_sha256') or '?')[:16]}…): "
        f"{100 * st['recall_kv_share']:.0f} % dense key-value recall, {100 * st['recall_repeat_share']:.0f} % repeats"
        f"{_repeat_form(st)}, "
        f"learning rate up to {st['recall_lr']:g}, the first {st['recall_warm_steps']} on shorter crops, seed {st['seed']}, "
        f"{st['minutes']:.0f} minutes" for st in stages)


def write_card(folder: Path, evaluations: list[dict], summary: dict, tasks: dict | None = None) -> Path:
    """Write README.md (the model card) and eval.json into the weights folder.

    Args:
        folder: the checkpoint folder.
        evaluations: one dict per domain, as :func:`truncsens.api.reference.context_nll` returns.
        summary: ``training_summary.json`` of :func:`truncsens.models.reference.train.train`.
        tasks: full-cache accuracy on the certify-attribution tasks
            (:func:`truncsens.api.reference.task_accuracy`), or None.

    Returns:
        the README.md path.
    """
    folder = Path(folder)
    (folder / "eval.json").write_text(json.dumps({"evaluations": evaluations, "training": summary, "tasks": tasks},
                                                 indent=2))
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
        f"| tokens seen | {summary.get('tokens_seen', 0):,}{' (the recall stage)' if cfg.get('init_from') else ''} |",
        f"| training time | {summary.get('minutes', 0):.0f} minutes on 2 CPU cores "
        f"({'bf16 autocast' if cfg.get('bf16_autocast') else 'float32'}), seed {cfg.get('seed')}"
        f"{' (the recall stage; the main stage is that of the model it started from)' if cfg.get('init_from') else ''} |",
        *([f"| started from | `{cfg['init_from']}` (checkpoint sha256 {summary.get('init_sha256', '?')[:16]}…, the `model_sha256` of its results) at step "
           f"{cfg.get('max_steps')}, fresh optimizer: the main stage's steps are that model's |"] if cfg.get("init_from") else []),
        *([f"| earlier recall stages | {_earlier(summary['earlier_stages'])} |"] if summary.get("earlier_stages") else []),
        *([f"| context schedule | {cfg['warm_context']}-token crops for {cfg['warm_steps']} steps, then {cfg['context']} |"]
          if cfg.get("warm_steps") else []),
        *([f"| synthetic share | {100 * cfg['repeat_share']:.0f} % long-range repeats, {100 * cfg['kv_share']:.0f} % "
           "key-value recall (truncsens/models/reference/data.py) |"] if "kv_share" in cfg else []),
        *([f"| recall stage | the last {cfg['recall_steps']} steps: {100 * cfg['recall_kv_share']:.0f} % dense key-value "
           f"recall, {100 * cfg['recall_repeat_share']:.0f} % repeats{_repeat_form(cfg)}, learning rate up to "
           f"{cfg['recall_lr']:g} again"
           f"{_recall_schedule(cfg)} |"]
          if cfg.get("recall_steps") else []),
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
    if tasks:
        lines += ["## Full-cache accuracy on the certify-attribution tasks", "",
                  f"Top-1 accuracy with the whole reference context (N = {tasks['reference_context']}) on the targets of "
                  "`truncsens certify-attribution` with its defaults: long-range copy targets of held-out code and "
                  "synthetic key-value recall documents.", "",
                  "| task | correct | targets | accuracy |", "|---|---|---|---|"]
        for kind, label in (("copy", "long-range copy"), ("kv", "key-value recall")):
            t = tasks[kind]
            lines.append(f"| {label} | {t['correct']} | {t['n']} | {100 * t['accuracy']:.1f} % |")
        lines.append("")
    lines += [f"Training curve: `train_log.csv` beside this card (held-out code NLL by position in "
              f"{cfg.get('context', 1024)}-token crops).", ""]
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    return path
