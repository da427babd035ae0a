"""The measurement kernel: metrics of every (policy, target, budget) of one set of targets.

For each batch of targets the semantics' reference pass gives p(· | full context); for each policy
and budget the policy's kept set (:class:`~truncsens.policies.Kept`) and the semantics' kept pass give
p(· | kept context); :func:`truncsens.divergences.all_metrics` compares the two at the target.

Batching follows the semantics: when the kept passes read the reference pass's state (a cache or
attention statistics: ``streaming``, ``prefill_evict``) both run on the same batch of targets;
otherwise (``reencode``) the reference pass is batched over N-token sequences and each kept pass over
sequences of its own length, so a window sweep costs what a bare batched forward of the same
sequences costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from truncsens.divergences import METRICS, all_metrics
from truncsens.engine.batching import run_in_batches
from truncsens.engine.granularity import evicted_mass, kept_count
from truncsens.engine.semantics import Semantics
from truncsens.policies import Kept, Policy
from truncsens.targets import TargetSet, doc_seed


@dataclass
class KernelOutput:
    """What :func:`measure_targets` returns.

    Attributes:
        metrics: name -> [P, n, K] (float32; ``top1_agree`` int8).
        kept_tokens: [P, n, K] int32 keys the target's query kept.
        evicted_attention_mass: [P, n, K] float32 attention mass of the full-context target query on
            the evicted keys (mean over layers and heads), or None when the semantics has no
            attention statistics (``reencode``).
        n_clamped: values clamped for rounding noise.
    """

    metrics: dict[str, np.ndarray]
    kept_tokens: np.ndarray
    evicted_attention_mass: np.ndarray | None
    n_clamped: int


def policy_seeds(targets: TargetSet, sl: slice, seed: int, policy: str, budget: int) -> list[int]:
    """One seed per target of ``targets[sl]``: ``doc_seed(seed, "doc:position:policy:budget")``, so a
    draw depends neither on batching nor on sharding nor on resuming."""
    return [doc_seed(seed, f"{d}:{int(t)}:{policy}:{budget}") for d, t in zip(targets.doc[sl], targets.position[sl])]


@torch.no_grad()
def measure_targets(
    model, targets: TargetSet, policies: Sequence[Policy], budgets: Sequence[int], semantics: Semantics,
    positions: str, seed: int, device: str, max_batch_tokens: int, on_tokens: Callable[[int], None] | None = None,
    chunk: int = 1, granularity: str = "token",
) -> KernelOutput:
    """Metrics of every (policy, target, budget).

    Args:
        model: causal LM on ``device``.
        targets: n targets with contexts [n, N].
        policies: P policies, each checked against ``semantics``; budgets: K budgets (checked, <= N).
        semantics: the semantics object (:mod:`truncsens.engine.semantics`).
        positions: "original" or "reindexed" (checked against the semantics).
        seed: run seed (see :func:`policy_seeds`).
        max_batch_tokens: token budget of one forward pass.
        on_tokens: progress callback (forward tokens processed).
        chunk: streaming decisions every ``chunk`` tokens (:mod:`truncsens.policies.streaming`).
        granularity: "token" or "head" (:mod:`truncsens.engine.granularity`); under "head"
            ``kept_tokens`` is the mean kept per key/value head, rounded to a whole token.

    Returns:
        :class:`KernelOutput`.
    """
    semantics.check_granularity(granularity)  # head granularity needs per-head caches (not reencode)
    n, N = targets.context.shape
    P, K = len(policies), len(budgets)
    metrics = {m: np.zeros((P, n, K), dtype=np.int8 if m == "top1_agree" else np.float32) for m in METRICS}
    kept_tokens = np.zeros((P, n, K), dtype=np.int32)
    lost = np.zeros((P, n, K), dtype=np.float32) if semantics.reference_state else None
    out = KernelOutput(metrics, kept_tokens, lost, 0)
    if n == 0:
        return out
    context = targets.context.to(device)  # [n, N]
    token_id = targets.token_id.to(device)  # [n]
    queries = semantics.queries(N, device)  # [Q]

    def record(p: int, j: int, sl: slice, ref_lp: torch.Tensor, lp: torch.Tensor, keep_last: torch.Tensor) -> None:
        values, n_clamped = all_metrics(ref_lp, lp, token_id[sl])
        out.n_clamped += n_clamped
        for name, v in values.items():
            metrics[name][p, sl, j] = v.cpu().numpy()
        kept_tokens[p, sl, j] = np.rint(kept_count(keep_last).cpu().numpy())

    def progress(tokens: int) -> None:
        if on_tokens:
            on_tokens(tokens)

    if semantics.reference_state:
        def step(sl: slice) -> None:
            ids = context[sl]  # [b, N]
            ref = semantics.reference(model, ids, policies, granularity)
            progress(ids.numel())
            for p, policy in enumerate(policies):
                for j, k in enumerate(budgets):
                    lp, keep_last = semantics.policy_logprobs(  # [b, V], [b, N]
                        model, ids, policy, k, policy_seeds(targets, sl, seed, policy.name, k), ref, positions, chunk, granularity)
                    record(p, j, sl, ref.logprobs, lp, keep_last)
                    if lost is not None and ref.last_attention is not None:
                        lost[p, sl, j] = evicted_mass(ref.last_attention, keep_last).cpu().numpy()
                    progress(ids.shape[0] * semantics.cost(N, k))

        run_in_batches(step, n, N, max_batch_tokens)
        return out

    store: dict[str, torch.Tensor] = {}

    def ref_step(sl: slice) -> None:
        lp = semantics.reference(model, context[sl], policies).logprobs  # [b, V]
        if "ref" not in store:
            store["ref"] = torch.empty(n, lp.shape[-1], dtype=lp.dtype, device=device)
        store["ref"][sl] = lp
        progress(context[sl].numel())

    run_in_batches(ref_step, n, N, max_batch_tokens)
    ref_lp = store["ref"]  # [n, V]
    everyone = slice(0, n)
    for p, policy in enumerate(policies):
        for j, k in enumerate(budgets):
            kept = policy.keep(N, k, queries, policy_seeds(targets, everyone, seed, policy.name, k))  # [n, Q, N]

            def kept_step(sl: slice, p=p, j=j, k=k, kept=kept) -> None:
                rows = Kept(kept.keep[sl], kept.offset[sl], kept.queries)
                lp = semantics.kept_logprobs(model, context[sl], rows, None, positions)
                record(p, j, sl, ref_lp[sl], lp, rows.keep[:, -1, :])
                progress(lp.shape[0] * semantics.cost(N, k))

            run_in_batches(kept_step, n, semantics.cost(N, k), max_batch_tokens)
    return out
