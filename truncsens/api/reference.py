"""``truncsens train-reference`` as a function: train the bundled reference model, evaluate it on
held-out text, write its model card and, optionally, install it into the package.

Held-out NLL with context c at target t is -log p(x_t | x[t-c:t]) (nats/token): the ``nll_kept`` of a
suffix window of c tokens, and ``nll_ref`` for the full reference context N (the model's maximum),
measured by the engine's kernel (:func:`truncsens.engine.kernel.measure_targets`) on the builtin
corpora's held-out split. Standard errors are clustered by document
(:func:`truncsens.stats.cluster_mean_se`, the estimator every report uses), because targets of one
document are dependent. Training is :mod:`truncsens.models.reference.train`; the card's text
:mod:`truncsens.models.reference.card`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from truncsens.corpora import load_corpus
from truncsens.engine.documents import tokenize_documents
from truncsens.engine.kernel import measure_targets
from truncsens.engine.semantics import semantics_for
from truncsens.models import LoadedModel, load_model
from truncsens.models.reference.build import install_reference
from truncsens.models.reference.card import CARD_CONTEXTS, write_card
from truncsens.models.reference.train import TrainConfig, train
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
        ``{"domain", "n_docs", "n_targets", "nll": {context: [mean, se]}, "gain_shortest_to_max": [mean, se],
        "gain_to_max": {context: [mean, se]}}``.
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


def attribution_tasks(loaded: LoadedModel, reference_context: int | None = None, max_docs: int = 16,
                      copy_per_doc: int = 4, kv_docs: int = 8, seed: int = 0, copy_rule: str = "induction"):
    """The targets of ``truncsens certify-attribution`` with its defaults, for ``loaded``: long-range
    copy targets of held-out code (``copy_rule``, default induction; distance at least N/4) and
    synthetic key–value recall documents (:mod:`truncsens.certificates.tasks`), each with its whole
    N-token reference context.

    Raises:
        truncsens.certificates.config.CertifyError: an unknown ``copy_rule`` or another bad option.

    Returns:
        :class:`truncsens.certificates.tasks.TaskSet` (``targets.context`` [n, N], ``targets.token_id``
        [n], ``kind`` "copy" / "kv" per target).
    """
    from truncsens.certificates.attribution_driver import AttributionConfig
    from truncsens.certificates.tasks import COPY_RULES, build_task_set, copy_vocabulary, default_min_distance
    from truncsens.engine.documents import prepare_documents

    N = reference_context or loaded.max_context
    acfg = AttributionConfig(model=loaded.name, reference_context=N, max_docs=max_docs, copy_per_doc=copy_per_doc,
                             copy_rule=copy_rule, kv_docs=kv_docs, seed=seed, progress=False, out="unused.nc")
    docs = prepare_documents(acfg.certify_config().measure_config(), loaded, N)
    tok = loaded.tokenizer
    eligible = copy_vocabulary(tok.convert_ids_to_tokens(list(range(len(tok)))))
    return build_task_set(docs.used, eligible, lambda s: tok(s, add_special_tokens=False)["input_ids"], N,
                          default_min_distance(N), copy_per_doc, kv_docs, seed, COPY_RULES[copy_rule])


def task_accuracy(loaded: LoadedModel, reference_context: int | None = None, max_docs: int = 16,
                  copy_per_doc: int = 4, kv_docs: int = 8, seed: int = 0, batch: int = 2, tasks=None,
                  copy_rule: str = "induction") -> dict:
    """Full-cache top-1 accuracy on the targets of ``truncsens certify-attribution`` with its defaults
    (:func:`attribution_tasks`, or ``tasks`` already built by it), each read with its whole N-token
    reference context.

    Returns:
        ``{"reference_context": N, "copy": {"correct", "n", "accuracy"}, "kv": {...}}``.
    """
    import torch

    N = reference_context or loaded.max_context
    tasks = tasks or attribution_tasks(loaded, N, max_docs, copy_per_doc, kv_docs, seed, copy_rule)
    context, token = tasks.targets.context, tasks.targets.token_id  # [n, N], [n]
    hits = torch.zeros(len(token), dtype=torch.bool)
    with torch.no_grad():
        for i in range(0, len(token), batch):
            ids = context[i : i + batch].to(loaded.device)
            logits = loaded.model(input_ids=ids, logits_to_keep=1).logits[:, -1]  # [b, V]
            hits[i : i + batch] = logits.argmax(-1).cpu() == token[i : i + batch]
    kinds = np.asarray(tasks.kind)
    out: dict = {"reference_context": N}
    for kind in ("copy", "kv"):
        sel = torch.from_numpy(kinds == kind)
        n, correct = int(sel.sum()), int(hits[sel].sum())
        out[kind] = {"correct": correct, "n": n, "accuracy": correct / n if n else float("nan")}
    return out


def build_reference(cfg: TrainConfig, install: bool = False) -> tuple[Path, Path | None, dict]:
    """Train (or resume) with ``cfg``; once all ``total_steps`` are done, evaluate (:func:`context_nll` on
    both builtin domains at :data:`~truncsens.models.reference.card.CARD_CONTEXTS`), write the card into
    the final checkpoint folder and, with ``install``, copy that folder into the package's weights folder.

    Returns:
        (final checkpoint folder, install folder or None, the training summary: ``steps``,
        ``finished``, ``minutes``, ...). An unfinished run is neither evaluated nor installed.
    """
    final = train(cfg)
    summary = json.loads((final / "training_summary.json").read_text())
    if not summary["finished"]:
        return final, None, summary
    shutil.copy(Path(cfg.out_dir) / "train_log.csv", final / "train_log.csv")
    loaded = load_model(str(final))
    contexts = [c for c in CARD_CONTEXTS if c < loaded.max_context]
    evals = [context_nll(loaded, domain, contexts) for domain in ("code", "nl")]
    write_card(final, evals, summary, task_accuracy(loaded))
    return final, install_reference(final) if install else None, summary


def train_reference(out_dir: str | Path = "runs/reference", *, minutes: float = 170.0, max_steps: int = 2000,
                    recall_steps: int = 0, seed: int = 0, install: bool = False, threads: int = 0,
                    recall_warm_context: int = TrainConfig.recall_warm_context,
                    recall_warm_steps: int = TrainConfig.recall_warm_steps,
                    recall_warm_doublings: int = TrainConfig.recall_warm_doublings,
                    recall_name_words: int = TrainConfig.recall_name_words,
                    recall_kv_share: float = TrainConfig.recall_kv_share,
                    recall_repeat_share: float = TrainConfig.recall_repeat_share,
                    recall_lr: float = TrainConfig.recall_lr, min_lr: float = TrainConfig.min_lr,
                    recall_repeat_spans: int = TrainConfig.recall_repeat_spans,
                    recall_repeat_min_distance: int = TrainConfig.recall_repeat_min_distance,
                    recall_induction_share: float = TrainConfig.recall_induction_share,
                    init_from: str = "", stage_name: str = "") -> tuple[Path, Path | None, dict]:
    """``truncsens train-reference``: :func:`build_reference` with the command's options. On 2 CPU cores
    the default recipe takes several sessions of ``minutes``; each call resumes from the checkpoint
    in ``out_dir`` (the result does not depend on where a run was stopped).

    Args:
        out_dir: working folder (checkpoint, training log, exported model).
        minutes: wall-clock budget of this call; the run checkpoints and stops when it is spent.
        max_steps: optimizer steps of the main stage (part of the recipe: its learning-rate schedule ends there).
        recall_steps: optimizer steps of the recall stage that follows (dense key–value recall;
            :class:`~truncsens.models.reference.train.TrainConfig`).
        seed: seed of initialisation and batch sampling.
        install: copy the finished result into ``truncsens/models/reference/weights``.
        threads: torch CPU threads (0: torch's default).
        recall_warm_context, recall_warm_steps, recall_warm_doublings, recall_name_words: the recall
            stage's crop schedule and name vocabulary (:class:`~truncsens.models.reference.train.TrainConfig`).
        recall_kv_share, recall_repeat_share: shares of the recall stage's sequences in the dense
            key–value format and with long-range repeats (the rest is corpus text); each in [0, 1], sum ≤ 1.
        recall_lr: the recall stage's peak learning rate (> 0).
        min_lr: the floor to which each stage's learning rate decays by cosine (> 0, at most each
            peak; 2e-4 for every run of the installed model). A floor well below the peak in a
            short recall stage anneals the model (CHANGELOG.md, 0.1.0, "Changed: the reference model's
            lineage": the anneals tried and not installed).
        recall_repeat_spans, recall_repeat_min_distance: spans copied forward in each of the recall
            stage's repeat sequences, and their shortest distance in tokens (each ≥ 1; the distances
            are log-uniform up to the crop length).
        recall_induction_share: share of the recall stage's induction sequences (repeats as
            above whose source spans are first replaced by tokens drawn by their frequency in the
            training stream; :mod:`truncsens.models.reference.data`); in [0, 1], with the other shares summing to ≤ 1.
        init_from: ``""`` (train the main stage), ``"reference"`` (the bundled weights) or an exported model
            folder: start at the recall stage from those weights and tokenizer (``TrainConfig.init_from``).
        stage_name: what the model card calls this run (``""``: "main", "main + recall" with recall
            steps, or "recall" with ``init_from``); a label only, not part of the recipe.

    Returns:
        (final checkpoint folder, install folder or None, training summary).

    Raises:
        TrainError: ``out_dir`` holds a checkpoint of a different recipe; ``init_from`` without recall
            steps, without its files, or with weights of another shape.
    """
    cfg = TrainConfig(out_dir=str(out_dir), max_minutes=minutes, max_steps=max_steps, recall_steps=recall_steps,
                      seed=seed, threads=threads, recall_warm_context=recall_warm_context,
                      recall_warm_steps=recall_warm_steps, recall_warm_doublings=recall_warm_doublings,
                      recall_name_words=recall_name_words, recall_kv_share=recall_kv_share,
                      recall_repeat_share=recall_repeat_share, recall_lr=recall_lr, min_lr=min_lr,
                      recall_repeat_spans=recall_repeat_spans, recall_repeat_min_distance=recall_repeat_min_distance,
                      recall_induction_share=recall_induction_share, init_from=init_from, stage_name=stage_name)
    return build_reference(cfg, install)


def rewrite_card(folder: str | Path) -> Path:
    """Write the model card (``README.md``) of an exported reference-model folder again from the
    evaluations in its ``eval.json`` and its ``training_summary.json``, with the card writer of this
    version (:func:`~truncsens.models.reference.card.write_card`); nothing is trained or evaluated, and
    ``eval.json`` keeps its evaluations and task accuracies (its training summary is the folder's).

    Raises:
        FileNotFoundError: the folder lacks ``eval.json`` or ``training_summary.json`` (a run that has
            not finished, or a folder that is no reference model's).
        ValueError: either file lacks what the card is written from (``evaluations``; ``config``), or
            is not JSON.
    """
    folder = Path(folder)
    for name in ("eval.json", "training_summary.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} does not exist: --rewrite-card needs the folder of a finished "
                                    "train-reference run (its final/ folder) or the installed weights")
    evaluated = json.loads((folder / "eval.json").read_text())
    summary = json.loads((folder / "training_summary.json").read_text())
    if not isinstance(evaluated, dict) or not isinstance(evaluated.get("evaluations"), list):
        raise ValueError(f"{folder / 'eval.json'} has no list 'evaluations' (held-out NLL by context), which "
                         "train-reference writes there; the card cannot be written from it")
    if not isinstance(summary, dict) or not isinstance(summary.get("config"), dict):
        raise ValueError(f"{folder / 'training_summary.json'} has no 'config' (the run's options), which "
                         "train-reference writes there; the card cannot be written from it")
    return write_card(folder, evaluated["evaluations"], summary, evaluated.get("tasks"))
