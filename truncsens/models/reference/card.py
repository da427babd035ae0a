"""Held-out evaluation of the reference model and its model card.

NLL with context c at target t is -log p(x_t | x[t-c:t]) (nats/token): the ``nll_kept`` of a
suffix window of c tokens, and ``nll_ref`` for the full reference context N. Standard errors are
clustered by document (:func:`truncsens.stats.cluster_mean_se`, the estimator every report uses),
because targets of one document are dependent.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from truncsens.corpora import load_corpus
from truncsens.engine.documents import tokenize_documents
from truncsens.engine.kernel import measure_targets
from truncsens.engine.semantics import semantics_for
from truncsens.models import LoadedModel
from truncsens.policies import make_policy
from truncsens.stats import cluster_mean_se
from truncsens.targets import select_targets


def doc_clustered_mean_se(values: np.ndarray, docs: list[str]) -> tuple[float, float]:
    """Mean over targets and its standard error clustered by document. values: [n]; docs: [n] ids."""
    mean, se = cluster_mean_se(np.asarray(values, dtype=np.float64)[:, None], docs)  # [1] each
    return float(mean[0]), float(se[0])


def context_nll(loaded: LoadedModel, domain: str, contexts: list[int], targets_per_doc: int = 16,
                seed: int = 0, max_batch_tokens: int = 16384) -> dict:
    """Held-out NLL (nats/token) at each context length, and the gain of the longest over the shortest.

    Args:
        loaded: the model; its ``max_context`` is the longest context.
        domain: "code" or "nl" (builtin corpora, held-out split).
        contexts: shorter contexts (tokens), each < max_context.

    Returns:
        ``{"domain", "n_docs", "n_targets", "nll": {context: [mean, se]}, "gain_shortest_to_max": [mean, se]}``.
    """
    n_max = loaded.max_context
    corpus = load_corpus(None, domain, "heldout")
    docs = [d for d in tokenize_documents(corpus.documents, loaded.tokenizer) if d.ids.numel() > n_max]
    targets = select_targets(docs, n_max, targets_per_doc, seed)
    out = measure_targets(loaded.model, targets, [make_policy("suffix")], contexts, semantics_for("reencode"),
                          "original", seed, loaded.device, max_batch_tokens)
    metrics = {name: values[0] for name, values in out.metrics.items()}  # [n, len(contexts)] each
    out = {"domain": domain, "n_docs": len(docs), "n_targets": len(targets), "nll": {}}
    for j, c in enumerate(contexts):
        out["nll"][str(c)] = doc_clustered_mean_se(metrics["nll_kept"][:, j], targets.doc)
    out["nll"][str(n_max)] = doc_clustered_mean_se(metrics["nll_ref"][:, 0], targets.doc)
    gain = metrics["nll_kept"][:, 0] - metrics["nll_ref"][:, 0]  # [n], paired per target
    out["gain_shortest_to_max"] = doc_clustered_mean_se(gain, targets.doc)
    out["gain_to_max"] = {
        str(c): doc_clustered_mean_se(metrics["nll_kept"][:, j] - metrics["nll_ref"][:, 0], targets.doc)
        for j, c in enumerate(contexts)
    }
    return out


def write_card(folder: Path, evaluations: list[dict], summary: dict) -> Path:
    """Write README.md (the model card) and eval.json into the weights folder."""
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
