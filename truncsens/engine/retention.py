"""Retention-policy sweeps: ``truncsens measure --policy NAME[,NAME...] --budgets ... --semantics S``.

corpus -> token documents -> targets -> one full-context reference pass per batch -> for every
(policy, budget) the kept next-token distribution under the chosen semantics -> metrics per
(policy, target, budget) -> shard files -> merged results file.

Semantics (research/method.md section C):

- ``reencode``: the model reads only the kept tokens of the target's query (positions original or
  reindexed), batched with :func:`truncsens.engine.reencode.next_token_logprobs` exactly as the
  ``measure`` engine does (``suffix`` at budget k equals ``measure`` at window k);
- ``streaming``: one masked forward per (policy, budget, batch), every query row with its own kept
  set (:mod:`truncsens.engine.streaming`);
- ``prefill_evict``: a one-token decode against the full-context cache with the evicted keys masked
  out (:mod:`truncsens.engine.prefill_evict`).

Results: dims (target, budget), or (policy, target, budget) when several policies run (they share
the reference pass); the attr ``policy`` names the policies in order. Extra data vars:
``kept_tokens`` (int32, keys the target's query kept; random for ``poisson``) and, for streaming
and prefill-evict, ``evicted_attention_mass`` (float32: the attention probability mass the
full-context target query puts on the keys its policy evicted, mean over layers and heads).

Shards, resume and provenance work as in :mod:`truncsens.engine.measure`, whose helpers are reused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from truncsens import results
from truncsens.divergences import METRICS, all_metrics
from truncsens.engine.batching import run_in_batches
from truncsens.engine.distributed import current_ranks, process_device
from truncsens.engine.measure import (
    MeasureConfig, MeasureError, MeasureSummary, batch_tokens_for, check_counts, fingerprint, prepare_documents,
    provenance, resolve_reference_context, run_shards,
)
from truncsens.engine.prefill_evict import prefill_evict_logprobs
from truncsens.engine.reencode import next_token_logprobs
from truncsens.engine.reference_pass import reference_pass
from truncsens.engine.streaming import streaming_logprobs
from truncsens.models import LoadedModel, load_model
from truncsens.policies import Policy, PolicyError, make_policy, policy_params
from truncsens.targets import TargetSet, doc_seed

DEFAULT_SINKS = 4  # StreamingLLM's (arXiv 2309.17453)


@dataclass
class RetentionConfig(MeasureConfig):
    """Configuration of a policy sweep (token counts in tokens).

    Inherits every field of :class:`~truncsens.engine.measure.MeasureConfig` (model, corpus,
    targets, device, shards, ...); ``windows`` must stay None. Added or changed fields:

    Attributes:
        policies: policy names (:data:`truncsens.policies.POLICIES`), run on the same targets.
        budgets: kept tokens k per target query (None: powers of two from 16 up to N/2).
        semantics: "reencode", "streaming" or "prefill_evict".
        n_sink: sinks of ``sink_recent`` and ``poisson`` (default 4).
        score: ``poisson`` scores, "attention" or "key_norm".
        per_query: ``random`` draws per query instead of once per sequence.
        recent_fraction, top_fraction: ``poisson`` certain slices as shares of the budget.
    """

    policies: list[str] = field(default_factory=lambda: ["sink_recent"])
    budgets: list[int] | None = None
    semantics: str = "streaming"
    n_sink: int = DEFAULT_SINKS
    score: str = "attention"
    per_query: bool = False
    recent_fraction: float = 0.25
    top_fraction: float = 0.25
    out: str = "results/policies.nc"


def build_policies(cfg: RetentionConfig) -> list[Policy]:
    """The configured policies, each checked against the semantics and positions.

    Raises:
        PolicyError: unknown or repeated policy, bad parameter, or a policy the semantics cannot
            express (e.g. ``poisson`` under ``reencode``).
        MeasureError: reindexed positions with streaming / prefill-evict, or ``windows`` given.
    """
    if cfg.windows:
        raise MeasureError("--windows is for suffix truncation; with --policy give --budgets instead")
    if not cfg.policies:
        raise PolicyError("no policy given")
    if len(set(cfg.policies)) != len(cfg.policies):
        raise PolicyError(f"a policy is listed twice: {', '.join(cfg.policies)}")
    if cfg.positions not in results.POSITIONS:
        raise MeasureError(f"--positions must be one of {results.POSITIONS}, got {cfg.positions!r}")
    if cfg.semantics != "reencode" and cfg.positions != "original":
        raise MeasureError(
            f"semantics {cfg.semantics} keeps original positions (keys are computed once, at their own position); "
            "--positions reindexed works only with --semantics reencode")
    params = dict(n_sink=cfg.n_sink, score=cfg.score, per_query=cfg.per_query,
                  recent_fraction=cfg.recent_fraction, top_fraction=cfg.top_fraction)
    policies = [make_policy(name, **params) for name in cfg.policies]
    for p in policies:
        p.check_semantics(cfg.semantics)
    return policies


def default_budgets(reference_context: int, smallest: int) -> list[int]:
    """Powers of two from max(16, smallest) up to N/2 (or up to N when none fits)."""
    lo = max(16, smallest)
    out = [2**i for i in range(4, 31) if lo <= 2**i <= reference_context // 2]
    return out or [2**i for i in range(0, 31) if smallest <= 2**i <= reference_context][:1]


def check_budgets(budgets: Sequence[int], policies: Sequence[Policy], reference_context: int) -> list[int]:
    """Sorted unique budgets that every policy accepts for a context of N tokens.

    Raises:
        PolicyError: empty list, a budget above N, or below a policy's minimum.
    """
    if not budgets:
        raise PolicyError("no budgets given")
    for k in budgets:
        for p in policies:
            p.check(int(k), reference_context)
    return sorted(set(int(k) for k in budgets))


def _gather_rows(keep_last: torch.Tensor, budget: int) -> torch.Tensor:
    """[b, k] sorted kept indices of each row from keep_last [b, N] (exactly k per row)."""
    counts = keep_last.sum(-1)
    if not bool((counts == budget).all()):
        raise PolicyError(f"re-encoding needs exactly {budget} kept tokens per target, the policy kept {counts.tolist()}")
    order = torch.arange(keep_last.shape[1], device=keep_last.device).expand_as(keep_last)  # [b, N]
    return order[keep_last].view(keep_last.shape[0], budget)  # [b, k] in increasing order


@torch.no_grad()
def retention_targets(
    model, targets: TargetSet, policies: Sequence[Policy], budgets: Sequence[int], semantics: str, positions: str,
    seed: int, device: str, max_batch_tokens: int, on_tokens: Callable[[int], None] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """Metrics of every (policy, target, budget), one reference pass per batch of targets.

    Args:
        model: causal LM on ``device`` (a transformers model for streaming / prefill-evict).
        targets: n targets with contexts [n, N].
        policies: P policies; budgets: K budgets (checked, <= N).
        semantics: "reencode", "streaming" or "prefill_evict".
        positions: "original" or "reindexed" (reencode only).
        seed: run seed; each (target, policy, budget) draws with ``doc_seed(seed, "doc:position:policy:k")``.
        max_batch_tokens: token budget of one forward pass.
        on_tokens: progress callback (tokens processed).

    Returns:
        (metrics, extras, n_clamped): metrics name -> [P, n, K] (float32; top1_agree int8);
        extras ``kept_tokens`` [P, n, K] int32 and, unless reencode, ``evicted_attention_mass``
        [P, n, K] float32; the number of values clamped for rounding noise.
    """
    n, N = targets.context.shape
    P, K = len(policies), len(budgets)
    out = {m: np.zeros((P, n, K), dtype=np.int8 if m == "top1_agree" else np.float32) for m in METRICS}
    extras = {"kept_tokens": np.zeros((P, n, K), dtype=np.int32)}
    if semantics != "reencode":
        extras["evicted_attention_mass"] = np.zeros((P, n, K), dtype=np.float32)
    if n == 0:
        return out, extras, 0
    context = targets.context.to(device)  # [n, N]
    token_id = targets.token_id.to(device)  # [n]
    need_matrix = any(p.needs_scores and getattr(p, "score", "") == "attention" for p in policies)
    need_norm = any(p.needs_scores and getattr(p, "score", "") == "key_norm" for p in policies)
    last_q = torch.tensor([N - 1], device=device)
    all_q = torch.arange(N, device=device)
    clamped = [0]

    def step(sl: slice) -> None:
        ids = context[sl]  # [b, N]
        b = ids.shape[0]
        if semantics == "reencode":
            ref_lp = next_token_logprobs(model, ids, torch.arange(N, device=device).expand(b, N))  # [b, V]
            ref = None
        else:
            ref = reference_pass(model, ids, last_attention=True, attention=need_matrix, key_norm=need_norm,
                                 keep_cache=semantics == "prefill_evict")
            ref_lp = ref.logprobs  # [b, V]
        if on_tokens:
            on_tokens(ids.numel())
        queries = all_q if semantics == "streaming" else last_q  # [Q]
        for p, policy in enumerate(policies):
            scores = None
            if policy.needs_scores:
                if policy.score == "attention":
                    scores = ref.attention.cumsum(1)[:, queries, :]  # [b, Q, N] attention received up to each query
                else:
                    scores = ref.key_norm.unsqueeze(1).expand(b, queries.numel(), N)  # [b, Q, N]
            for j, k in enumerate(budgets):
                seeds = [doc_seed(seed, f"{d}:{int(t)}:{policy.name}:{k}")
                         for d, t in zip(targets.doc[sl], targets.position[sl])]
                kept = policy.keep(N, k, queries, seeds, scores)  # keep/offset [b, Q, N]
                keep_last = kept.keep[:, -1, :]  # [b, N] the target's query
                if semantics == "streaming":
                    lp = streaming_logprobs(model, ids, kept.keep, kept.offset)
                    n_tok = ids.numel()
                elif semantics == "prefill_evict":
                    lp = prefill_evict_logprobs(model, ref.cache, ids, keep_last, kept.offset[:, -1, :])
                    n_tok = b
                else:
                    index = _gather_rows(keep_last, k)  # [b, k]
                    pos = index if positions == "original" else torch.arange(k, device=device).expand(b, k)
                    lp = next_token_logprobs(model, ids.gather(1, index), pos)
                    n_tok = b * k
                metrics, nc = all_metrics(ref_lp, lp, token_id[sl])
                clamped[0] += nc
                for name, values in metrics.items():
                    out[name][p, sl, j] = values.cpu().numpy()
                extras["kept_tokens"][p, sl, j] = keep_last.sum(-1).cpu().numpy()
                if ref is not None:
                    lost = (ref.last_attention * (~keep_last).float()).sum(-1)  # [b]
                    extras["evicted_attention_mass"][p, sl, j] = lost.cpu().numpy()
                if on_tokens:
                    on_tokens(n_tok)

    run_in_batches(step, n, N, max_batch_tokens)
    return out, extras, clamped[0]


def _check_model(loaded: LoadedModel, semantics: str) -> None:
    if semantics != "reencode" and not hasattr(loaded.model, "set_attn_implementation"):
        raise MeasureError(
            f"semantics {semantics} needs a transformers model (masked attention and attention statistics); "
            f"{loaded.name!r} is not one: use --semantics reencode")


def _results_shard(metrics, extras, plan: TargetSet, budgets, names, attrs):
    single = len(names) == 1
    ds = results.make_results({m: v[0] if single else v for m, v in metrics.items()}, "budget", budgets, plan.doc,
                              plan.position, plan.token_id.numpy(), attrs, policies=None if single else names)
    dims = ("target", "budget") if single else ("policy", "target", "budget")
    for name, values in extras.items():
        ds[name] = (dims, values[0] if single else values)
    ds["kept_tokens"].attrs["units"] = "tokens"
    if "evicted_attention_mass" in ds:
        ds["evicted_attention_mass"].attrs["description"] = (
            "attention probability mass of the full-context target query on the evicted keys, mean over layers and heads")
    return ds


def run_retention(config: RetentionConfig, loaded: LoadedModel | None = None, stop_after_shards: int | None = None) -> MeasureSummary:
    """Run a policy sweep and write the results file ``config.out``.

    Args:
        config: the configuration.
        loaded: an already loaded model (else ``config.model`` is loaded).
        stop_after_shards: raise :class:`MeasureInterrupted` after writing this many new shards.

    Returns:
        :class:`~truncsens.engine.measure.MeasureSummary` with ``windows`` = the budgets and
        ``extra = {"policies": [...], "semantics": S}``.

    Raises:
        PolicyError: unknown policy, bad budget (larger than the context, below a policy's
            minimum), a policy the semantics cannot express, poisson scores all zero.
        MeasureError: a count option below 1 (or negative sinks), bad reference context, corpus too
            short, shards of another run, a model that cannot run the semantics.
        truncsens.models.ModelLoadError, truncsens.corpora.CorpusError: loading failed.
        Nothing is written before the checks pass; shards already written are kept on failure.
    """
    cfg = config
    check_counts(cfg)  # before loading anything: cheap checks first
    policies = build_policies(cfg)
    loaded = loaded or load_model(cfg.model, process_device(cfg.device, current_ranks()), cfg.dtype)
    _check_model(loaded, cfg.semantics)
    N = resolve_reference_context(cfg, loaded)
    budgets = check_budgets(cfg.budgets or default_budgets(N, max(p.min_budget() for p in policies)), policies, N)
    docs = prepare_documents(cfg, loaded, N)
    batch_tokens = batch_tokens_for(cfg, loaded)
    names = [p.name for p in policies]
    attrs = provenance(cfg, loaded, N, docs, cfg.semantics)
    attrs.update({
        "n_sink": cfg.n_sink if any(hasattr(p, "n_sink") for p in policies) else 0,
        "policy": ",".join(names), "policy_params": json.dumps({p.name: policy_params(p) for p in policies}, sort_keys=True),
        "budget_counts": "kept keys of the target's query, its own token included",
    })
    per_target = N + len(policies) * sum(N if cfg.semantics == "streaming" else (1 if cfg.semantics == "prefill_evict" else k)
                                         for k in budgets)

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        metrics, extras, n_clamped = retention_targets(
            loaded.model, plan, policies, budgets, cfg.semantics, cfg.positions, cfg.seed, loaded.device, batch_tokens, on_tokens)
        return _results_shard(metrics, extras, plan, budgets, names, {**attrs, "n_clamped": n_clamped})

    path, reused, n_targets = run_shards(
        cfg, docs, N, fingerprint(cfg, N, docs.sha256, budgets=budgets), compute_shard, per_target,
        f"measure {cfg.semantics}", stop_after_shards)
    return MeasureSummary(
        path=path, n_targets=n_targets, n_docs=len(docs.used), n_docs_checked=len(docs.checked),
        n_docs_skipped=docs.n_short, windows=budgets, reference_context=N, shards_reused=reused,
        extra={"policies": names, "semantics": cfg.semantics})
