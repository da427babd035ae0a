"""The block protocol for policy sweeps under ``streaming`` and ``prefill_evict`` (``truncsens measure
--protocol block --policy ...``): many targets per pass (docs/method.md, "Block protocol").

The blocks, the reference pass and the actual reference contexts are those of the re-encode block
protocol (:mod:`truncsens.engine.block.plan`): a block of B targets t0 .. t0+B-1 has one reference
pass over the L = N + e tokens x[r : t0+B-1] (``r = t0 + B - 1 - N - e``), and target t0 + j has the
actual context ``c_j = L - B + 1 + j`` (its query is position ``c_j - 1`` of the block row). Every
value (metric, kept keys, evicted attention mass) equals a single-target run of the same semantics
over the prefix x[r : t0+j] (c_j tokens) with the same seed (tests/test_block_policies.py):

- ``streaming`` (``--chunk 1``): **one stream per block** over the L tokens. A stream evicts as it
  goes, so its state at query q is that of a stream over x[r .. r+q]; target j reads the log-probs
  of position ``c_j - 1``. Offline policies run one forward from their eviction steps
  (:meth:`~truncsens.engine.semantics.Streaming.kept_logprobs` with ``keep=B``), online ones the
  sequential run (:func:`~truncsens.engine.streaming_pass.stream_online` with ``keep=B``). A stream
  is one realizable process with one set of draws: its seed is the block's first target's
  (:func:`truncsens.engine.kernel.policy_seeds`), so **the targets of a block share their stream's
  draws**. With ``--chunk C > 1`` a prefix run evicts at its own last prompt token, which a shared
  stream does not (its chunk ends are multiples of C): refused.
- ``prefill_evict``: the reference pass keeps the full-context cache of the first L - 1 tokens. Target
  j's kept set is the single-target one, ``policy.keep(c_j, k, [c_j - 1], seed_j, scores_j)``, with
  its own seed and the scores of the long reference restricted to keys < c_j (causal attention:
  equal to those of a c_j-token reference). One decode forward appends the B query tokens (positions
  ``c_j - 1``) to the cache with a [rows, 1, B, L - 1 + B] mask: query j reads the cache keys
  ``i <= c_j - 2`` it keeps (Hájek offsets) and its own new key (column L - 1 + j), none of the other
  decoded keys; the cache is truncated back to L - 1 afterwards.

Models with sliding-window layers run as under the exact protocol: the reference pass keeps every
key, and the kept masks apply each layer's window on original positions
(:func:`~truncsens.engine.attention_windows.kept_attention_mask`; tested on a hybrid Qwen2).

Refused (:func:`~truncsens.engine.block.plan.check_policy_blocks`, use ``--protocol exact``): ``reencode`` policy sweeps other than
suffix / sink_recent (those run as window sweeps, :mod:`truncsens.engine.block.passes`), kvpress
presses, ``--positions reindexed``, ``--granularity head`` and ``--chunk`` above 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from truncsens.engine.batching import run_in_batches
from truncsens.engine.block.passes import block_rows, reference_passes
from truncsens.engine.block.plan import actual_contexts, blocks_of, check_block_budgets
from truncsens.engine.kernel import KernelOutput, copy_deterministic, draws_measured, policy_seeds
from truncsens.engine.reference_pass import ReferencePass
from truncsens.engine.semantics.base import Semantics
from truncsens.engine.semantics.prefill_evict import decode_kept
from truncsens.policies import Policy
from truncsens.targets import TargetSet

@dataclass
class PolicyBlockOutput:
    """What :func:`measure_policy_blocks` returns (n targets).

    Attributes:
        kernel: :class:`~truncsens.engine.kernel.KernelOutput`, arrays [P, R, n, K] as from
            :func:`~truncsens.engine.kernel.measure_draws`.
        actual_context: [n] int64 tokens of each target's reference context (c_j).
        forward_tokens: tokens of every forward pass run.
    """

    kernel: KernelOutput
    actual_context: np.ndarray
    forward_tokens: int = 0


def _decode_mask_parts(kept_keep: torch.Tensor, kept_offset: torch.Tensor, j: int, L: int, B: int,
                       keep: torch.Tensor, offset: torch.Tensor) -> None:
    """Write query j's row of the block decode mask: cache keys i <= c_j - 2 as kept, its own new key
    (column L - 1 + j) as its kept set's last key. ``kept_*`` [G, c_j]; ``keep``/``offset`` [G, B, L-1+B]."""
    c = kept_keep.shape[-1]
    keep[:, j, : c - 1] = kept_keep[:, : c - 1]
    offset[:, j, : c - 1] = kept_offset[:, : c - 1]
    keep[:, j, L - 1 + j] = kept_keep[:, c - 1]
    offset[:, j, L - 1 + j] = kept_offset[:, c - 1]


def target_scores(semantics: Semantics, policy: Policy, ref: ReferencePass, L: int, B: int) -> list:
    """The scores ``policy`` reads for each of the B targets of G blocks under ``prefill_evict``: those
    of a c_j-token reference (the long reference's statistics cut to keys < c_j, c_j = L - B + 1 + j),
    computed once per policy and batch (they depend on neither the budget nor the draw).

    Returns:
        B entries, each [G, 1, c_j] scores or None (a policy that reads none).
    """
    out = []
    for j in range(B):
        c = L - B + 1 + j  # target j's actual context
        prefix = ReferencePass(None, attention=None if ref.attention is None else ref.attention[:, :c, :c],
                               key_norm=None if ref.key_norm is None else ref.key_norm[:, :c],
                               rows=None if ref.rows is None else ref.rows.prefix(c))  # a c-token reference
        out.append(semantics.scores(policy, prefix, torch.tensor([c - 1], device=ref.logprobs.device)))
    return out


def prefill_evict_block(model, ids: torch.Tensor, ref: ReferencePass, policy: Policy, budget: int,
                        seeds: list[list[int]], scores: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept log-probs of the B targets of G blocks under ``prefill_evict`` (module docstring).

    Args:
        ids: [G, L] block rows; ref: their reference pass with ``queries=B`` and the cache kept;
        seeds: B lists of G seeds (target j's seeds per block); scores: :func:`target_scores`.

    Returns:
        ([G, B, V] float64 log-probs, [G, B, L] bool keys each target's query read).
    """
    G, L = ids.shape
    B = len(seeds)
    keep = torch.zeros(G, B, L - 1 + B, dtype=torch.bool, device=ids.device)
    offset = torch.zeros(G, B, L - 1 + B, dtype=torch.float32, device=ids.device)
    read = torch.zeros(G, B, L, dtype=torch.bool, device=ids.device)
    for j in range(B):
        c = L - B + 1 + j  # target j's actual context
        kept = policy.keep(c, budget, torch.tensor([c - 1], device=ids.device), seeds[j], scores[j])  # [G, 1, c]
        _decode_mask_parts(kept.keep[:, 0], kept.offset[:, 0], j, L, B, keep, offset)
        read[:, j, :c] = kept.keep[:, 0]
    return decode_kept(model, ids, ref.cache, keep, offset), read


def streaming_block(model, ids: torch.Tensor, policy: Policy, budget: int, seeds: list[int], B: int,
                    semantics: Semantics) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept log-probs of the last B positions of one stream per block (``--chunk 1``, module docstring;
    :meth:`~truncsens.engine.semantics.Streaming.stream` keeping B rows).

    Returns:
        ([G, B, V] float64 log-probs, [G, B, L] bool keys the query at each of the last B positions read).
    """
    lp, ev = semantics.stream(model, ids, policy, budget, seeds, 1, keep=B)
    return lp.view(ids.shape[0], B, -1), ev.last_rows(B)  # [G, B, V] ([G, V] when B = 1), [G, B, L]


@torch.no_grad()
def measure_policy_blocks(
    model, targets: TargetSet, policies: Sequence[Policy], budgets: Sequence[int], semantics: Semantics, seed: int,
    device: str, max_batch_tokens: int, on_tokens: Callable[[int], None] | None = None, draws: int = 1,
    room: int = 0,
) -> PolicyBlockOutput:
    """Metrics of every (policy, draw, target, budget) by the block protocol (module docstring).

    Args:
        model: transformers causal LM on ``device``.
        targets: n targets in blocks (:func:`truncsens.targets.select_block_targets`), contexts [n, N].
        policies: P policies; budgets: K budgets (each <= the shortest actual context, see
            :func:`check_policy_blocks`); semantics: streaming or prefill_evict.
        seed: policy seed; draws: R draws of each randomized policy (a deterministic one is run once).
        max_batch_tokens: token budget of one forward pass; on_tokens: progress (forward tokens).
        room: positions the model has beyond N (reference passes read ``min(B - 1, room)`` more tokens).

    Returns:
        :class:`PolicyBlockOutput`.

    Raises:
        ValueError: targets without blocks, or a block that is not consecutive.
        MeasureError: a budget above the shortest actual reference context (:func:`check_block_budgets`).
        NonFiniteLogitsError: NaN or infinite logits.
    """
    n, N = targets.context.shape
    P, K, R = len(policies), len(budgets), draws
    if targets.block is None:
        raise ValueError("the block protocol needs targets drawn in blocks (select_block_targets)")
    blocks = blocks_of(targets.doc, targets.position, targets.block)
    out = PolicyBlockOutput(KernelOutput.zeros(P, R, n, K, evicted_mass=True), actual_contexts(blocks, N, room))
    if n == 0:
        return out
    check_block_budgets(budgets, N, int(blocks.size.max()), room)
    per_policy = draws_measured(policies, R)
    rows = block_rows(targets.context, targets.token_id, blocks).to(device)  # [b, N + B - 1]
    token_id = targets.token_id.to(device)  # [n]
    streaming = semantics.streams  # one stream per block, else one prefill-evict decode per target

    def progress(tokens: int) -> None:
        out.forward_tokens += tokens
        if on_tokens:
            on_tokens(tokens)

    for group in reference_passes(blocks, N, room):
        B = group.targets.shape[1]

        def step(sl: slice, group=group, B=B) -> None:
            ids = rows[group.row[sl].to(device)].gather(1, group.cols[sl].to(device))  # [G, L]
            G, L = ids.shape
            tgt = group.targets[sl]  # [G, B] target indices
            flat = tgt.reshape(-1).to(device)  # [G*B]
            idx = flat.cpu().numpy()  # [G*B]
            ref = semantics.reference(model, ids, policies, queries=B)
            ref_lp = ref.logprobs.view(G * B, -1)  # [G*B, V]
            ref_att = ref.last_attention.reshape(G * B, L)  # [G*B, L] rows of the queries c_j - 1
            progress(ids.numel())
            for p, policy in enumerate(policies):
                scores = None if streaming else target_scores(semantics, policy, ref, L, B)
                for r in range(per_policy[p]):
                    if streaming:  # one stream per block: the block's first target's seed
                        seeds = policy_seeds(targets, tgt[:, 0].tolist(), seed, policy.name, draw=r)
                    else:  # every target its own prefill-evict-decode, its own seed
                        seeds = [policy_seeds(targets, tgt[:, j].tolist(), seed, policy.name, draw=r) for j in range(B)]
                    for jk, k in enumerate(budgets):
                        if streaming:
                            lp, read = streaming_block(model, ids, policy, k, seeds, B, semantics)
                            progress(ids.numel())
                        else:
                            lp, read = prefill_evict_block(model, ids, ref, policy, k, seeds, scores)
                            progress(G * B)
                        out.kernel.record(p, r, idx, jk, ref_lp, lp.reshape(G * B, -1), token_id[flat],
                                          read.reshape(G * B, L), ref_att)  # [G*B, V], [G*B, L]

        run_in_batches(step, group.row.shape[0], group.cols.shape[1], max_batch_tokens)
    copy_deterministic(out.kernel, per_policy)  # deterministic policies: draw 0 copied to every draw
    return out
