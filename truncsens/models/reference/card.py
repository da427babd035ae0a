"""The reference model's card: ``README.md`` and ``eval.json`` in its weights folder, written from the
held-out evaluations (:func:`truncsens.api.reference.context_nll`, which runs the engine) and the
training summary. This module only writes text; it imports no engine.
"""

from __future__ import annotations

import json
from pathlib import Path

from truncsens.models.reference.start import FLOOR_LR, main_record, stage_record

CARD_CONTEXTS = (16, 64, 256, 1024)  # shorter contexts evaluated beside the model's maximum


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _recall_schedule(cfg: dict, context: int | None) -> str:
    """The crop schedule and name vocabulary of a recall stage (``; the first S steps on crops of W, 2W
    and 4W tokens (S/3 steps each), then N; names from K words``), as
    :func:`~truncsens.models.reference.train.crop_at` draws them, from the fields its record has: a
    record without the crop length says ``on shorter crops``; one from before the name vocabulary
    existed names none. ``context``: the model's context N (None: not named)."""
    text = ""
    warm = cfg.get("recall_warm_steps") or 0
    if warm and "recall_warm_context" in cfg:
        phases = (cfg.get("recall_warm_doublings") or 0) + 1
        cap = context or cfg["recall_warm_context"] * 2 ** (phases - 1)
        lengths = [min(cap, cfg["recall_warm_context"] * 2**j) for j in range(phases)]
        sizes = [sum(1 for k in range(warm) if k * phases // warm == j) for j in range(phases)]  # crop_at's phases
        each = f"{sizes[0]} steps each" if len(set(sizes)) == 1 else _and([str(n) for n in sizes]) + " steps"
        text += (f"; the first {warm} steps on crops of {_and([str(n) for n in lengths])} tokens"
                 + (f" ({each})" if phases > 1 else "") + (f", then {context}" if context else ""))
    elif warm:
        text += f"; the first {warm} steps on shorter crops"
    return text + (f"; names from {cfg['recall_name_words']} words" if "recall_name_words" in cfg else "")


def _repeats(cfg: dict) -> str:
    """The recall stage's repeats and induction sequences (data.py): their shares, and how their spans
    were drawn where not the default 4 spans from 64 tokens back; a share of 0 is named for repeats
    only where there are no induction sequences either (records before that share existed)."""
    spans, distance = cfg.get("recall_repeat_spans") or 4, cfg.get("recall_repeat_min_distance") or 64
    form = "" if (spans, distance) == (4, 64) else f"{spans} spans each, {distance} tokens back or more"
    repeat, induction = cfg["recall_repeat_share"], cfg.get("recall_induction_share") or 0
    if not repeat and induction:  # no repeats of corpus text: the span form belongs to the induction sequences
        return f"{_pct(induction)} induction sequences (repeats of frequency-drawn spans{', ' + form if form else ''})"
    text = f"{_pct(repeat)} repeats" + (f" ({form})" if form else "")
    return text + (f", {_pct(induction)} induction sequences (the same repeats of frequency-drawn spans)" if induction else "")


def _recall_data(cfg: dict, context: int | None = None) -> str:
    """A recall stage's data and crops, for its row of the recipe table (``context``: the model's, N)."""
    return (f"{_pct(cfg['recall_kv_share'])} dense key-value recall, {_repeats(cfg)}, the rest corpus text"
            f"{_recall_schedule(cfg, context)}")


def _main_data(cfg: dict) -> str:
    """The main stage's data and crops, for its row of the recipe table."""
    text = (f"{_pct(cfg['repeat_share'])} long-range repeats, {_pct(cfg['kv_share'])} key-value recall, the rest "
            "corpus text" if "kv_share" in cfg else "corpus text")
    if cfg.get("warm_steps"):
        text += f"; {cfg['warm_context']}-token crops for {cfg['warm_steps']} steps, then {cfg.get('context')}"
    return text


def training_runs(summary: dict) -> list[dict]:
    """The runs that made the model, oldest first, as rows of the card's recipe table.

    A run trained from scratch is the main stage (and, with ``recall_steps``, a recall stage in the
    same run); a run started from another model (``init_from``) is one recall stage, and its summary
    carries the runs before it (``main_stage``, ``earlier_stages``;
    :mod:`truncsens.models.reference.start`).

    Args:
        summary: ``training_summary.json`` of :func:`truncsens.models.reference.train.train`.

    Returns:
        one dict per run: ``name``, ``start`` (what it started from), ``steps``, ``tokens`` and
        ``minutes`` (None where the record lacks them), ``data``, ``lr``, ``seed``; ``start`` names the
        hash a record's ``init_sha256_of`` says it covers (absent: the checkpoint). Where the main stage
        is not recorded (a starting model whose summary predates the record) the first row says so,
        with None for its numbers.
    """
    cfg = summary.get("config", {})
    main = main_record(summary) if not cfg.get("init_from") else summary.get("main_stage")
    rows = []
    if main is None:
        rows.append({"name": "main", "start": "random initialisation", "steps": None, "tokens": None, "minutes": None,
                     "data": "not recorded in the starting model's summary", "lr": None, "seed": None})
    else:
        recall = main.get("recall_steps") or 0
        data = _main_data(main) + (f"; then, in the same run, a recall stage of {recall} steps"
                                   + (f": {_recall_data(main, cfg.get('context'))}" if "recall_kv_share" in main else "") if recall else "")
        steps = main.get("max_steps", main.get("steps"))
        rows.append({"name": main.get("stage_name") or ("main + recall" if recall else "main"),
                     "start": "random initialisation", "steps": steps + recall if steps is not None else None,
                     "tokens": main.get("tokens_seen"), "minutes": main.get("minutes"), "data": data,
                     "lr": f"{main['lr']:g}" + (f", then {main['recall_lr']:g}" if recall and "recall_lr" in main else "")
                     + _floor(main) if "lr" in main else None, "seed": main.get("seed")})
    stages = [*summary.get("earlier_stages", []), stage_record(summary)] if cfg.get("init_from") else []
    for st in stages:
        before = rows[-1]["name"] if rows[-1]["steps"] is not None or len(rows) > 1 else None
        sha = f"{st.get('init_sha256_of') or 'checkpoint'} sha256 {(st.get('init_sha256') or '?')[:16]}…"
        start = f"{before} ({sha})" if before else f"`{st.get('init_from')}` ({sha})"
        rows.append({"name": st.get("stage_name") or "recall", "start": start, "steps": st.get("recall_steps"),
                     "tokens": st.get("tokens_seen"), "minutes": st.get("minutes"), "data": _recall_data(st, cfg.get("context")),
                     "lr": f"{st['recall_lr']:g}" + _floor(st), "seed": st.get("seed")})
    return rows


def _floor(record: dict) -> str:
    """`` (floor x)`` where a run's record names a learning-rate floor ``min_lr`` other than
    :data:`~truncsens.models.reference.start.FLOOR_LR` (the card says that one once), else ``""``."""
    floor = record.get("min_lr", FLOOR_LR)
    return "" if floor == FLOOR_LR else f" (floor {floor:g})"


def _total(rows: list[dict], key: str, fmt: str = "{:,}") -> str:
    """The sum of ``key`` over the rows, formatted; ``at least …`` where a row lacks it (not every
    run recorded it)."""
    values = [r[key] for r in rows]
    return ("" if all(v is not None for v in values) else "at least ") + fmt.format(sum(v for v in values if v is not None))


def _recipe_lines(rows: list[dict], cfg: dict) -> list[str]:
    """The card's "Training recipe" section: one row per run and the totals."""
    def num(v, fmt="{:,}"):
        return "not recorded" if v is None else fmt.format(v)

    lines = ["## Training recipe", "",
             "Each run below started from the weights the run above it exported, with a fresh optimizer and its",
             "learning rate warmed up again (`truncsens train-reference --init-from`); the commands are in",
             "docs/reference-model.md (\"Training it\"); the SHA-256 beside each is the one its run recorded for",
             "its starting model (`init_sha256` of `training_summary.json`): the checkpoint SHA-256 (the `model_sha256`",
             "of results made on that model), or, where marked, that of its `model.safetensors` alone (a run from",
             "before the checkpoint SHA-256 was recorded). Batches of "
             f"{cfg.get('batch_size')} x {cfg.get('context')} tokens, or as many tokens in shorter crops; minutes on 2 CPU cores.",
             "Each run's learning rate warms up to its peak and decays by cosine to a floor of "
             f"{FLOOR_LR:g}, or to the floor its row names.", "",
             "| run | started from | optimizer steps | tokens | data and crops | peak learning rate | seed | minutes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['start']} | {num(r['steps'])} | {num(r['tokens'])} | {r['data']} | "
                     f"{num(r['lr'], '{}')} | {num(r['seed'], '{}')} | {num(r['minutes'], '{:.0f}')} |")
    hours = sum(r["minutes"] or 0 for r in rows) / 60
    lines.append(f"| all | | {_total(rows, 'steps')} | {_total(rows, 'tokens')} | | | | "
                 f"{_total(rows, 'minutes', '{:.0f}')} ({hours:.1f} hours) |")
    return lines + [""]


def wilson_interval(correct: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for a proportion (E. B. Wilson 1927, via statsmodels
    ``proportion_confint``); (nan, nan) for n = 0."""
    from statsmodels.stats.proportion import proportion_confint

    if not n:
        return float("nan"), float("nan")
    lo, hi = proportion_confint(correct, n, alpha=1 - level, method="wilson")
    return float(lo), float(hi)


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
    runs = training_runs(summary)
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
        f"| optimizer steps | {_total(runs, 'steps')} in {len(runs)} runs "
        f"(batch {cfg.get('batch_size')} x {cfg.get('context')} tokens, or as many tokens in shorter crops) |",
        f"| tokens seen | {_total(runs, 'tokens')} |",
        f"| training time | {_total(runs, 'minutes', '{:.0f}')} minutes on 2 CPU cores "
        f"({'bf16 autocast' if cfg.get('bf16_autocast') else 'float32'}); the last run {summary.get('minutes', 0):.0f} "
        f"minutes, seed {cfg.get('seed')} (\"Training recipe\", below) |",
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
                  "synthetic key-value recall documents. The interval is Wilson's 95 % score interval "
                  "(statsmodels `proportion_confint`), which treats targets as independent (the copy targets come "
                  "up to 4 from each document).", "",
                  "| task | correct | targets | accuracy [95 % interval] |", "|---|---|---|---|"]
        for kind, label in (("copy", "long-range copy"), ("kv", "key-value recall")):
            t = tasks[kind]
            lo, hi = wilson_interval(t["correct"], t["n"])
            lines.append(f"| {label} | {t['correct']} | {t['n']} | {100 * t['accuracy']:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}] |")
        lines.append("")
    lines += _recipe_lines(runs, cfg)
    numbered = f", numbered on from the main stage's {cfg.get('max_steps')}" if cfg.get("init_from") else ""
    lines += [f"Training curve: `train_log.csv` beside this card (held-out code NLL by position in "
              f"{cfg.get('context', 1024)}-token crops; the last run's steps{numbered}).", ""]
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    return path
