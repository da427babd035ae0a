"""``truncsens measure``: truncation sensitivity with re-encode semantics, end to end.

corpus -> token documents -> targets -> reference pass + one re-encode pass per window ->
metrics per (target, window) -> shard files -> merged results file (see :mod:`truncsens.results`).

Shards: documents are processed in groups of ``docs_per_shard``; each group is written to
``<out>.shards/shard-00000.nc`` as soon as it is done. An interrupted run loses at most the shard in
flight; ``resume=True`` skips shards already written (after checking they come from the same
configuration). On completion the shards are merged into ``out`` and the folder is removed.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import truncsens
from truncsens import results
from truncsens.corpora import load_corpus
from truncsens.corpora.document import SPLITS
from truncsens.divergences import METRICS, all_metrics
from truncsens.engine.batching import run_in_batches
from truncsens.engine.distributed import current_ranks, process_device
from truncsens.engine.reencode import kept_index, kept_position_ids, next_token_logprobs
from truncsens.models import LoadedModel, load_model
from truncsens.targets import TargetSet, TokenDoc, select_targets

DEFAULT_BATCH_TOKENS = {"cpu": 16384, "cuda": 262144}


class MeasureError(ValueError):
    """A measurement cannot run as configured; the message names the problem and the fix."""


class MeasureInterrupted(RuntimeError):
    """The run stopped before all shards were written (used by tests to simulate a crash)."""


@dataclass
class MeasureConfig:
    """Configuration of one ``truncsens measure`` run (token counts in tokens)."""

    model: str = "reference"
    domain: str = "code"
    corpus: str | None = None
    split: str = "auto"
    text_field: str = "text"
    reference_context: int | None = None  # None: the model's maximum context
    windows: list[int] | None = None  # None: powers of two from 1 to N/2
    n_sink: int = 0
    positions: str = "original"
    targets_per_doc: int | None = 8
    max_docs: int | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_tokens: int | None = None  # None: by device
    docs_per_shard: int = 8
    out: str = "results/measure.nc"
    resume: bool = False
    progress: bool = True
    command: str = ""


@dataclass
class MeasureSummary:
    """What a finished run did."""

    path: Path
    n_targets: int
    n_docs: int
    n_docs_checked: int
    n_docs_skipped: int
    windows: list[int]
    reference_context: int
    shards_reused: int = 0
    extra: dict = field(default_factory=dict)


def default_windows(reference_context: int) -> list[int]:
    """Powers of two from 1 up to reference_context / 2."""
    return [2**i for i in range(int(math.log2(max(1, reference_context // 2))) + 1)]


def check_windows(windows: list[int], reference_context: int, n_sink: int) -> list[int]:
    """Sorted unique windows, each 1 <= w < N with w + sinks <= N.

    Raises:
        MeasureError: empty list or a window out of range.
    """
    if not windows:
        raise MeasureError("no windows given")
    for w in windows:
        if w >= reference_context:
            raise MeasureError(
                f"window {w} >= reference context {reference_context}: the kept context would be the whole reference "
                "context; use windows below it")
        try:
            kept_index(reference_context, w, n_sink)
        except ValueError as exc:
            raise MeasureError(str(exc)) from None
    return sorted(set(int(w) for w in windows))


def check_counts(cfg: MeasureConfig) -> None:
    """Counts that must be positive when given, sinks >= 0, and the split name (checked before
    anything is loaded; a synthetic corpus has no split but the name is still checked).

    Raises:
        MeasureError: naming the option.
    """
    if cfg.split not in ("auto", *SPLITS):
        raise MeasureError(f"--split must be one of auto, {', '.join(SPLITS)}; got {cfg.split!r}")
    for option, value in (("--docs-per-shard", cfg.docs_per_shard), ("--max-docs", cfg.max_docs),
                          ("--targets-per-doc", cfg.targets_per_doc), ("--batch-tokens", cfg.max_batch_tokens),
                          ("--reference-context", cfg.reference_context)):
        if value is not None and value < 1:
            raise MeasureError(f"{option} must be at least 1, got {value}")
    if cfg.n_sink < 0:
        raise MeasureError(f"--sinks must be >= 0, got {cfg.n_sink}")


def tokenize_documents(docs, tokenizer) -> list[TokenDoc]:
    """Token ids of each document (no special tokens added): list of :class:`TokenDoc`."""
    out = []
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        out.append(TokenDoc(d.id, torch.tensor(ids, dtype=torch.long)))
    return out


@torch.no_grad()
def measure_targets(
    model, targets: TargetSet, windows: list[int], n_sink: int, positions: str, device: str,
    max_batch_tokens: int, on_tokens: Callable[[int], None] | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """Metrics of every (target, window) pair, re-encode semantics.

    Args:
        model: causal LM on ``device``.
        targets: n targets with contexts [n, N].
        windows: W window lengths, each with ``n_sink + w <= N``.
        n_sink: sinks kept in front of every window.
        positions: "original" or "reindexed".
        max_batch_tokens: token budget of one forward pass.
        on_tokens: called with the number of tokens of each finished batch (progress).

    Returns:
        (metrics, n_clamped): name -> array [n, W] (float32; top1_agree int8), and how many
        values were clamped for rounding noise.
    """
    n, N = targets.context.shape
    W = len(windows)
    out = {m: np.zeros((n, W), dtype=np.int8 if m == "top1_agree" else np.float32) for m in METRICS}
    if n == 0:
        return out, 0
    context = targets.context.to(device)  # [n, N]
    token_id = targets.token_id.to(device)  # [n]
    ref_pos = torch.arange(N, device=device)  # [N]
    store: dict[str, torch.Tensor] = {}

    def ref_step(sl: slice) -> None:
        ids = context[sl]  # [b, N]
        lp = next_token_logprobs(model, ids, ref_pos.expand(ids.shape[0], N))  # [b, V]
        if "ref" not in store:
            store["ref"] = torch.empty(n, lp.shape[-1], dtype=torch.float32, device=device)
        store["ref"][sl] = lp
        if on_tokens:
            on_tokens(ids.numel())

    run_in_batches(ref_step, n, N, max_batch_tokens)
    ref = store["ref"]  # [n, V]
    clamped = [0]
    for j, w in enumerate(windows):
        index = kept_index(N, w, n_sink).to(device)  # [k]
        pos = kept_position_ids(N, w, n_sink, positions).to(device)  # [k]
        kept = context[:, index]  # [n, k]

        def step(sl: slice, j=j, kept=kept, pos=pos) -> None:
            ids = kept[sl]  # [b, k]
            lp = next_token_logprobs(model, ids, pos.expand(ids.shape[0], -1))  # [b, V]
            metrics, nc = all_metrics(ref[sl], lp, token_id[sl])
            clamped[0] += nc
            for name, values in metrics.items():
                out[name][sl, j] = values.cpu().numpy()
            if on_tokens:
                on_tokens(ids.numel())

        run_in_batches(step, n, kept.shape[1], max_batch_tokens)
    return out, clamped[0]


def fingerprint(cfg: MeasureConfig, reference_context: int, corpus_sha: str, **sweep: list[int]) -> dict:
    """What must match for ``--resume`` to reuse shards: every field of the configuration (of
    :class:`MeasureConfig` or a subclass) except where and how it runs (out, resume, progress,
    command, device, batch tokens), plus the resolved N, corpus hash and sweep (``windows=`` or
    ``budgets=``)."""
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("out", "resume", "progress", "command", "device", "max_batch_tokens")}
    keep.update(reference_context=reference_context, corpus_sha256=corpus_sha, **sweep)
    return keep


def batch_tokens_for(cfg: MeasureConfig, loaded: LoadedModel) -> int:
    """Token budget of one forward pass: ``--batch-tokens`` or :data:`DEFAULT_BATCH_TOKENS` of the device type."""
    return cfg.max_batch_tokens or DEFAULT_BATCH_TOKENS.get(torch.device(loaded.device).type, 16384)


def _prepare_shard_dir(shard_dir: Path, fingerprint: dict, resume: bool, write: bool = True) -> None:
    """Check that ``shard_dir`` holds no shards, or (``resume``) shards of this very configuration;
    then (``write``) create it and record the configuration in ``run.json``.

    Raises:
        MeasureError: shards without ``resume``, or shards of another configuration.
    """
    spec = shard_dir / "run.json"
    if shard_dir.exists() and any(shard_dir.glob("shard-*.nc")):
        if not resume:
            raise MeasureError(
                f"an earlier run left shards in {shard_dir}: pass --resume to continue it, or delete the folder to start over")
        old = json.loads(spec.read_text()) if spec.is_file() else None
        if old != fingerprint:
            diff = sorted(k for k in set(fingerprint) | set(old or {}) if (old or {}).get(k) != fingerprint.get(k))
            raise MeasureError(
                f"cannot resume: the shards in {shard_dir} come from a different configuration ({', '.join(diff)} differ); "
                "rerun with the same options or delete the folder")
    if write:
        shard_dir.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps(fingerprint, indent=2, sort_keys=True))


def load_documents(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int):
    """Token documents and provenance (corpus name, domain, sha256) for a run.

    ``--corpus synthetic`` (the default with a ``synthetic:...`` model) samples ``max_docs`` (64)
    sequences of 2N tokens from the synthetic process of the model spec.

    Raises:
        MeasureError: ``--corpus synthetic`` with a model that is not synthetic, or a text corpus
            with a model that has no tokenizer.
        truncsens.corpora.CorpusError: the corpus cannot be read.
    """
    if cfg.corpus == "synthetic" or (cfg.corpus is None and cfg.model.startswith("synthetic")):
        from truncsens.synthetic import synthetic_documents

        if not cfg.model.startswith("synthetic"):
            raise MeasureError(f"--corpus synthetic is sampled from a synthetic source: it needs --model synthetic:ALPHA "
                               f"(or synthetic-geometric:RATE), not {cfg.model!r}")

        docs = synthetic_documents(cfg.model, n_docs=cfg.max_docs or 64, length=2 * reference_context, seed=cfg.seed)
        token_docs = [TokenDoc(doc_id, ids) for doc_id, ids in docs]
        h = hashlib.sha256()
        for d in token_docs:
            h.update(d.id.encode())
            h.update(d.ids.numpy().astype(np.int64).tobytes())
        return token_docs, "synthetic", "synthetic", h.hexdigest()
    if loaded.tokenizer is None:
        raise MeasureError(f"model {loaded.name!r} has no tokenizer: it only reads --corpus synthetic")
    corpus = load_corpus(cfg.corpus, cfg.domain, cfg.split, cfg.text_field)
    return tokenize_documents(corpus.documents, loaded.tokenizer), corpus.name, corpus.domain, corpus.sha256


def resolve_reference_context(cfg: MeasureConfig, loaded: LoadedModel) -> int:
    """N: ``cfg.reference_context`` or the model's maximum context.

    Raises:
        MeasureError: N beyond the model's position limit, or below 2.
    """
    N = cfg.reference_context or loaded.max_context
    if N > loaded.max_context:
        raise MeasureError(
            f"reference context {N} is beyond the model's position limit of {loaded.max_context} tokens; "
            f"use --reference-context {loaded.max_context} or less")
    if N < 2:
        raise MeasureError(f"reference context must be at least 2 tokens, got {N}")
    return N


@dataclass
class RunDocuments:
    """Documents of a run: all that were checked, and those used (long enough, capped by max_docs)."""

    checked: list[TokenDoc]
    used: list[TokenDoc]
    n_short: int
    corpus: str
    domain: str
    sha256: str


def prepare_documents(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int) -> RunDocuments:
    """Tokenized documents long enough for ``N + 1`` tokens, capped at ``cfg.max_docs``.

    Raises:
        MeasureError: no document is long enough (says how many were checked and the longest).
    """
    N = reference_context
    token_docs, corpus_name, domain, corpus_sha = load_documents(cfg, loaded, N)
    long_enough = [d for d in token_docs if d.ids.numel() >= N + 1]
    if not long_enough:
        longest = max((d.ids.numel() for d in token_docs), default=0)
        raise MeasureError(
            f"no document is long enough: checked {len(token_docs)} documents, the longest has {longest} tokens, "
            f"and a target needs {N + 1}; lower --reference-context or use a corpus with longer documents")
    used = long_enough[: cfg.max_docs] if cfg.max_docs else long_enough
    return RunDocuments(token_docs, used, len(token_docs) - len(long_enough), corpus_name, domain, corpus_sha)


def provenance(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int, docs: RunDocuments, semantics: str) -> dict:
    """The results attrs of design.md (``created`` is filled in at merge time)."""
    return {
        "truncsens_version": truncsens.__version__, "model": loaded.name, "model_revision": loaded.revision,
        "tokenizer": loaded.tokenizer_name, "dtype": loaded.dtype, "device": loaded.device, "semantics": semantics,
        "positions": cfg.positions, "n_sink": cfg.n_sink, "reference_context": reference_context,
        "corpus": docs.corpus, "corpus_sha256": docs.sha256, "domain": docs.domain, "seed": cfg.seed, "created": "",
        "command": cfg.command, "split": cfg.split, "targets_per_doc": cfg.targets_per_doc or 0,
        "max_context": loaded.max_context, "n_docs_checked": len(docs.checked), "n_docs_skipped_short": docs.n_short,
    }


def run_shards(
    cfg: MeasureConfig, docs: RunDocuments, reference_context: int, fingerprint: dict,
    compute_shard: Callable[[TargetSet, Callable[[int], None]], "results.xr.Dataset"],
    tokens_per_target: int, desc: str, stop_after_shards: int | None = None,
) -> tuple[Path, int, int]:
    """Process documents in shards, write each shard file, merge them into ``cfg.out``.

    Args:
        cfg: run configuration (``out``, ``resume``, ``docs_per_shard``, ``targets_per_doc``, ``seed``).
        docs: the documents of the run.
        reference_context: N.
        fingerprint: what must match for ``--resume`` to reuse shards.
        compute_shard: ``(targets, on_tokens) -> results Dataset`` of one shard; its attr
            ``n_clamped`` is summed over shards.
        tokens_per_target: tokens read per target (progress bar total).
        desc: progress bar label.
        stop_after_shards: raise :class:`MeasureInterrupted` after this many new shards (tests).

    Under ``accelerate launch`` with several processes each process computes the shards it owns
    (round robin) and rank 0 merges; the other ranks return a target count of -1.

    Returns:
        (path of the merged file, shards reused, number of targets).

    Raises:
        MeasureError: ``cfg.out`` is a folder, or shards of another run / without ``resume``.
    """
    out = Path(cfg.out)
    if out.is_dir():  # found now, not at the merge after every shard has been computed
        raise MeasureError(f"--out {out} is a folder; give a results file path such as {out / 'results.nc'}")
    shard_dir = Path(str(out) + ".shards")
    ranks = current_ranks()
    _prepare_shard_dir(shard_dir, fingerprint, cfg.resume, write=False)
    ranks.barrier()  # every rank has checked before rank 0 writes
    if ranks.is_main:
        _prepare_shard_dir(shard_dir, fingerprint, cfg.resume)
    ranks.barrier()
    groups = [docs.used[i : i + cfg.docs_per_shard] for i in range(0, len(docs.used), cfg.docs_per_shard)]
    plans = [select_targets(g, reference_context, cfg.targets_per_doc, cfg.seed) for g in groups]
    reused, written = 0, 0
    from tqdm.auto import tqdm

    mine = [i for i in range(len(plans)) if ranks.owns(i)]
    total = sum(len(plans[i]) for i in mine) * tokens_per_target
    with tqdm(total=total, unit="tok", unit_scale=True, desc=desc, disable=not (cfg.progress and ranks.is_main)) as bar:
        for i in mine:
            plan = plans[i]
            path = shard_dir / f"shard-{i:05d}.nc"
            if path.is_file():
                reused += 1
                bar.update(len(plan) * tokens_per_target)
                continue
            results.save(compute_shard(plan, bar.update), path)
            written += 1
            if stop_after_shards is not None and written >= stop_after_shards and i + 1 < len(plans):
                raise MeasureInterrupted(f"stopped after {written} shards; resume with --resume")
    ranks.barrier()
    if not ranks.is_main:
        return out, reused, -1
    parts = [results.load(shard_dir / f"shard-{i:05d}.nc") for i in range(len(plans))]
    merged = results.merge(parts)
    merged.attrs["n_clamped"] = int(sum(int(p.attrs.get("n_clamped", 0)) for p in parts))
    merged.attrs["created"] = results.utc_now()
    merged.attrs["n_docs"] = len(docs.used)
    results.save(merged, out)
    shutil.rmtree(shard_dir, ignore_errors=True)
    return out, reused, int(merged.sizes["target"])


def run_measure(cfg: MeasureConfig, loaded: LoadedModel | None = None, stop_after_shards: int | None = None) -> MeasureSummary:
    """Run a measurement and write the results file ``cfg.out``.

    Args:
        cfg: the configuration.
        loaded: an already loaded model (else ``cfg.model`` is loaded).
        stop_after_shards: raise :class:`MeasureInterrupted` after writing this many new shards
            (to test resuming).

    Raises:
        MeasureError: bad windows / reference context / corpus, or shards of another run.
        truncsens.models.ModelLoadError, truncsens.corpora.CorpusError: loading failed.
        truncsens.engine.batching.OutOfMemoryAtBatchSizeOne, NonFiniteLogitsError: the pass failed
            (shards already written are kept).
    """
    check_counts(cfg)
    loaded = loaded or load_model(cfg.model, process_device(cfg.device, current_ranks()), cfg.dtype)
    N = resolve_reference_context(cfg, loaded)
    windows = check_windows(cfg.windows or default_windows(N), N, cfg.n_sink)
    if cfg.positions not in results.POSITIONS:
        raise MeasureError(f"--positions must be one of {results.POSITIONS}, got {cfg.positions!r}")
    docs = prepare_documents(cfg, loaded, N)
    batch_tokens = batch_tokens_for(cfg, loaded)
    attrs = provenance(cfg, loaded, N, docs, "reencode")

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        metrics, n_clamped = measure_targets(
            loaded.model, plan, windows, cfg.n_sink, cfg.positions, loaded.device, batch_tokens, on_tokens)
        return results.make_results(metrics, "window", windows, plan.doc, plan.position, plan.token_id.numpy(),
                                    {**attrs, "n_clamped": n_clamped})

    path, reused, n_targets = run_shards(
        cfg, docs, N, fingerprint(cfg, N, docs.sha256, windows=windows), compute_shard,
        N + sum(cfg.n_sink + w for w in windows), "measure", stop_after_shards)
    return MeasureSummary(
        path=path, n_targets=n_targets, n_docs=len(docs.used), n_docs_checked=len(docs.checked),
        n_docs_skipped=docs.n_short, windows=windows, reference_context=N, shards_reused=reused)
