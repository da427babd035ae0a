"""The measurement kernel: metrics of every (policy, target, budget) of one set of targets.

For each batch of targets the semantics' reference pass gives p(· | full context); for each policy
and budget the policy's kept set (:class:`~truncsens.policies.Kept`) and the semantics' kept pass give
p(· | kept context); :func:`truncsens.divergences.all_metrics` compares the two at the target.

Batching follows the semantics: when the kept passes read the reference pass's state (a cache or
attention statistics: ``prefill_evict``) both run on the same batch of targets; otherwise the
reference pass is batched over N-token sequences and each kept pass apart: under ``reencode`` over
sequences of its own length, so a window sweep costs what a bare batched forward of the same
sequences costs; under ``streaming`` (``reference_apart``) each (policy, budget)'s streams in batches
of ``max_batch_tokens // stream_cost`` targets
(:meth:`~truncsens.engine.semantics.base.Semantics.stream_cost`: k + chunk cache slots for a policy
with online scores, N for a policy without scores, which runs one parallel pass), the reference
log-probabilities and target attention rows kept per target in between ([n, V], [n, N]).

Draws (:func:`measure_draws`): a randomized policy (``randomized`` class attribute true: ``random``,
``poisson``) is measured R times with independent seeds; a deterministic one once, its values copied
to every draw. Seeds never depend on the budget (common random numbers,
:func:`policy_seeds`): one priority per key serves every budget, so kept sets are nested in the
budget and one target's D(k) compares like with like across k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from truncsens.divergences import all_metrics
from truncsens.engine.batching import run_in_batches
from truncsens.engine.granularity import evicted_mass, kept_count
from truncsens.engine.reference_pass import ReferencePass
from truncsens.engine.semantics import Semantics
from truncsens.metrics import METRICS
from truncsens.policies import Kept, Policy
from truncsens.targets import TargetSet, doc_seed


def metric_arrays(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Zero arrays of ``shape`` for every metric of :data:`truncsens.metrics.METRICS`, each in its
    record's dtype (float32; ``top1_agree`` int8): the storage every measurement loop fills."""
    return {m.name: np.zeros(shape, dtype=m.dtype) for m in METRICS}


def store_metrics(metrics: dict[str, np.ndarray], index, ref_lp: torch.Tensor, lp: torch.Tensor,
                  token_id: torch.Tensor) -> int:
    """Compute every metric of b (reference, kept) pairs (:func:`~truncsens.divergences.all_metrics`,
    float64) and store them at ``metrics[name][index]``.

    Args:
        index: numpy index of the b values in each array (e.g. ``(p, r, rows, j)``).
        ref_lp, lp: [b, V] log-probs (or logits); token_id: [b] observed tokens.

    Returns:
        The number of values clamped for rounding noise.
    """
    values, n_clamped = all_metrics(ref_lp, lp, token_id)
    for name, v in values.items():
        metrics[name][index] = v.cpu().numpy()
    return n_clamped


@dataclass
class KernelOutput:
    """What :func:`measure_draws` and :func:`measure_targets` return.

    Attributes:
        metrics: name -> [P, R, n, K] from :func:`measure_draws` (R draws), [P, n, K] from
            :func:`measure_targets` (one draw); each in its record's dtype (:mod:`truncsens.metrics`:
            float32, ``top1_agree`` int8).
        kept_tokens: int32 keys the target's query kept, shaped as ``metrics``.
        evicted_attention_mass: float32 attention mass of the full-context target query on the
            evicted keys (mean over layers and heads), shaped as ``metrics``, or None when the
            semantics has no attention statistics (``reencode``).
        n_clamped: values clamped for rounding noise (over every draw measured).
    """

    metrics: dict[str, np.ndarray]
    kept_tokens: np.ndarray
    evicted_attention_mass: np.ndarray | None
    n_clamped: int

    @classmethod
    def zeros(cls, P: int, R: int, n: int, K: int, evicted_mass: bool) -> "KernelOutput":
        """Zero arrays [P, R, n, K] (``evicted_attention_mass`` None unless ``evicted_mass``)."""
        shape = (P, R, n, K)
        return cls(metric_arrays(shape), np.zeros(shape, dtype=np.int32),
                   np.zeros(shape, dtype=np.float32) if evicted_mass else None, 0)

    def record(self, p: int, r: int, rows, j: int, ref_lp: torch.Tensor, lp: torch.Tensor, token_id: torch.Tensor,
               keep_last: torch.Tensor, ref_attention: torch.Tensor | None = None) -> None:
        """Store policy p, draw r, budget j of the targets ``rows`` (a slice or b indices).

        Args:
            ref_lp, lp: [b, V] float64 reference and kept log-probs; token_id: [b] observed tokens.
            keep_last: [b, N] (or [b, Hkv, N] per head) bool keys each target's query kept.
            ref_attention: [b, N] (or per head) full-context attention of the target query, or None
                (then ``evicted_attention_mass`` is left as is).
        """
        self.n_clamped += store_metrics(self.metrics, (p, r, rows, j), ref_lp, lp, token_id)
        self.kept_tokens[p, r, rows, j] = np.rint(kept_count(keep_last).cpu().numpy())
        if self.evicted_attention_mass is not None and ref_attention is not None:
            self.evicted_attention_mass[p, r, rows, j] = evicted_mass(ref_attention, keep_last).cpu().numpy()

    def first_draw(self) -> "KernelOutput":
        """The output of draw 0 alone: arrays [P, R, n, K] -> [P, n, K]."""
        lost = None if self.evicted_attention_mass is None else self.evicted_attention_mass[:, 0]
        return KernelOutput({m: v[:, 0] for m, v in self.metrics.items()}, self.kept_tokens[:, 0], lost, self.n_clamped)


def policy_seeds(targets: TargetSet, sl: slice | Sequence[int], seed: int, policy: str, *, draw: int = 0) -> list[int]:
    """One seed per target of ``targets[sl]``: ``doc_seed(seed, "doc:position:policy:draw")`` (SHA-256,
    :func:`truncsens.targets.doc_seed`), so a draw depends neither on batching nor on sharding nor on
    resuming, and **not on the budget**: every budget of a target reads the same priorities (common
    random numbers), which makes the kept sets of ``random`` and ``poisson`` nested in the budget.

    Args:
        targets: the targets; sl: which of them (a slice, or target indices).
        seed: the policy seed (``--policy-seed``, by default the run's ``--seed``).
        policy: the policy's name.
        draw: the draw index r in 0..R-1 (``--draws R``).
    """
    index = range(len(targets))[sl] if isinstance(sl, slice) else sl
    return [doc_seed(seed, f"{targets.doc[i]}:{int(targets.position[i])}:{policy}:{draw}") for i in index]


def measure_targets(
    model, targets: TargetSet, policies: Sequence[Policy], budgets: Sequence[int], semantics: Semantics,
    positions: str, seed: int, device: str, max_batch_tokens: int, on_tokens: Callable[[int], None] | None = None,
    chunk: int = 1, granularity: str = "token",
) -> KernelOutput:
    """Metrics of every (policy, target, budget), draw 0 of :func:`measure_draws` (arrays [P, n, K])."""
    return measure_draws(model, targets, policies, budgets, semantics, positions, seed, device, max_batch_tokens,
                         on_tokens, chunk, draws=1, granularity=granularity).first_draw()


def draws_measured(policies: Sequence[Policy], draws: int) -> list[int]:
    """How many draws of each policy are measured: R for a randomized policy, 1 for a deterministic one."""
    return [draws if p.randomized else 1 for p in policies]


@torch.no_grad()
def measure_draws(
    model, targets: TargetSet, policies: Sequence[Policy], budgets: Sequence[int], semantics: Semantics,
    positions: str, seed: int, device: str, max_batch_tokens: int, on_tokens: Callable[[int], None] | None = None,
    chunk: int = 1, draws: int = 1, granularity: str = "token",
) -> KernelOutput:
    """Metrics of every (policy, draw, target, budget).

    Args:
        model: causal LM on ``device``.
        targets: n targets with contexts [n, N].
        policies: P policies, each checked against ``semantics``; budgets: K budgets (checked, <= N).
        semantics: the semantics object (:mod:`truncsens.engine.semantics`).
        positions: "original" or "reindexed" (checked against the semantics).
        seed: policy seed (see :func:`policy_seeds`).
        max_batch_tokens: token budget of one forward pass.
        on_tokens: progress callback (forward tokens processed).
        chunk: streaming decisions every ``chunk`` tokens (:mod:`truncsens.policies.streaming`).
        granularity: "token" or "head" (:mod:`truncsens.engine.granularity`); under "head"
            ``kept_tokens`` is the mean kept per key/value head, rounded to a whole token.
        draws: R >= 1 draws of each randomized policy (draw r seeded with ``draw=r``); a
            deterministic policy is measured once and its values copied to every draw.

    Returns:
        :class:`KernelOutput` with arrays [P, R, n, K].

    Raises:
        ValueError: ``draws`` below 1.
        truncsens.engine.semantics.SemanticsError: a policy whose kept sets cannot run on ``model``
            (:meth:`~truncsens.engine.semantics.base.Semantics.check_policy_model`), before any pass.
    """
    semantics.check_granularity(granularity)  # head granularity needs per-head caches (not reencode)
    for policy in policies:  # before any pass (snapkv on sliding-window layers)
        semantics.check_policy_model(policy, model)
    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    n, N = targets.context.shape
    P, K, R = len(policies), len(budgets), draws
    per_policy = draws_measured(policies, R)
    out = KernelOutput.zeros(P, R, n, K, semantics.reference_state)
    if n == 0:
        return out
    context = targets.context.to(device)  # [n, N]
    token_id = targets.token_id.to(device)  # [n]
    queries = semantics.queries(N, device)  # [Q]

    def progress(tokens: int) -> None:
        if on_tokens:
            on_tokens(tokens)

    if semantics.reference_apart:  # streams: the reference pass by N tokens, each stream by what it holds
        ref_lp, ref_att = reference_outputs(model, context, policies, semantics, granularity, max_batch_tokens, progress)
        for p, policy in enumerate(policies):
            for j, k in enumerate(budgets):
                def stream_step(sl: slice, p=p, policy=policy, j=j, k=k) -> None:
                    ids = context[sl]  # [b, N]
                    att = None if ref_att is None else ref_att[sl]  # [b, N] or [b, Hkv, N]
                    ref = ReferencePass(ref_lp[sl], att)
                    for r in range(per_policy[p]):
                        seeds = policy_seeds(targets, sl, seed, policy.name, draw=r)
                        lp, keep_last = semantics.policy_logprobs(  # [b, V], [b, N]
                            model, ids, policy, k, seeds, ref, positions, chunk, granularity)
                        out.record(p, r, sl, j, ref.logprobs, lp, token_id[sl], keep_last, att)
                        progress(ids.shape[0] * semantics.cost(N, k))

                held = semantics.stream_cost(N, k, chunk, policy, model, granularity)
                run_in_batches(stream_step, n, held, max_batch_tokens,  # what one stream holds
                               "token sequences" if held == N else "slot streams (the cache one stream holds)")
        return copy_deterministic(out, per_policy)

    if semantics.reference_state:
        def step(sl: slice) -> None:
            ids = context[sl]  # [b, N]
            ref = semantics.reference(model, ids, policies, granularity)
            progress(ids.numel())
            for p, policy in enumerate(policies):
                for r in range(per_policy[p]):
                    seeds = policy_seeds(targets, sl, seed, policy.name, draw=r)
                    for j, k in enumerate(budgets):
                        lp, keep_last = semantics.policy_logprobs(  # [b, V], [b, N]
                            model, ids, policy, k, seeds, ref, positions, chunk, granularity)
                        out.record(p, r, sl, j, ref.logprobs, lp, token_id[sl], keep_last, ref.last_attention)
                        progress(ids.shape[0] * semantics.cost(N, k))

        run_in_batches(step, n, N, max_batch_tokens)
        return copy_deterministic(out, per_policy)

    ref_lp, _ = reference_outputs(model, context, policies, semantics, granularity, max_batch_tokens, progress)  # [n, V]
    everyone = slice(0, n)
    for p, policy in enumerate(policies):
        for r in range(per_policy[p]):
            seeds = policy_seeds(targets, everyone, seed, policy.name, draw=r)
            for j, k in enumerate(budgets):
                kept = policy.keep(N, k, queries, seeds)  # [n, Q, N]

                def kept_step(sl: slice, p=p, r=r, j=j, k=k, kept=kept) -> None:
                    rows = Kept(kept.keep[sl], kept.offset[sl], kept.queries)
                    lp = semantics.kept_logprobs(model, context[sl], rows, None, positions)
                    out.record(p, r, sl, j, ref_lp[sl], lp, token_id[sl], rows.keep[:, -1, :])
                    progress(lp.shape[0] * semantics.cost(N, k))

                run_in_batches(kept_step, n, semantics.cost(N, k), max_batch_tokens)
    return copy_deterministic(out, per_policy)


def reference_outputs(model, context: torch.Tensor, policies: Sequence[Policy], semantics: Semantics,
                      granularity: str, max_batch_tokens: int,
                      progress: Callable[[int], None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference pass of every target of ``context`` [n, N], batched by N tokens apart from the kept
    passes (``reencode``, ``streaming``), and what the results record of it: (log-probabilities [n, V]
    float64, the target query's attention row [n, N] float32 ([n, Hkv, N] under head granularity), or
    None where the semantics computes none)."""
    n, N = context.shape
    store: dict[str, torch.Tensor] = {}

    def ref_step(sl: slice) -> None:
        ref = semantics.reference(model, context[sl], policies, granularity)
        for name, value in (("lp", ref.logprobs), ("att", ref.last_attention)):
            if value is None:
                continue
            if name not in store:  # allocated at the first batch, when the shapes are known
                store[name] = torch.empty(n, *value.shape[1:], dtype=value.dtype, device=value.device)
            store[name][sl] = value
        progress(context[sl].numel())

    run_in_batches(ref_step, n, N, max_batch_tokens)
    return store["lp"], store.get("att")


def copy_deterministic(out: KernelOutput, per_policy: list[int]) -> KernelOutput:
    """Fill draws 1..R-1 of the policies measured once with the values of their draw 0."""
    arrays = [*out.metrics.values(), out.kept_tokens] + ([out.evicted_attention_mass] if out.evicted_attention_mass is not None else [])
    for p, measured in enumerate(per_policy):
        if measured == 1:
            for a in arrays:  # [P, R, n, K]
                a[p, 1:] = a[p, :1]
    return out
