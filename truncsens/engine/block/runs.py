"""``truncsens measure --protocol block``: the driver's block branch (targets drawn in blocks, shards
measured by :func:`truncsens.engine.block.passes.measure_blocks`).

Results are those of a window sweep (dims ``target``, ``window``) plus the coords
``actual_window`` [target, window] (int32, tokens of window each value was measured with; sinks
not counted) and ``actual_context`` [target] (int32, tokens of each target's reference context);
a sweep of ``--policy suffix`` or ``sink_recent`` under reencode (dims ``target``, ``budget``) has
``actual_budget`` [target, budget] (sinks + actual window) instead of ``actual_window``,
and the attrs ``protocol`` ("block"), ``block_fraction``, ``block_size``, ``block_length`` (B,
targets per block) and ``attention_implementation``. A file without these coords is an exact run:
actual = nominal (how :mod:`truncsens.fits.curves` reads them).

A policy sweep under ``streaming`` or ``prefill_evict`` (:func:`policy_block_work`,
:mod:`truncsens.engine.block.policies`) has the layout of an exact policy sweep plus
``actual_context`` and the block attrs (no ``actual_budget``: budgets are exact).

This module says what is the block protocol's own (how targets are drawn, how a shard is computed,
the progress estimate) as a :class:`~truncsens.engine.run.skeleton.ShardWork`; the driver
(:func:`truncsens.engine.measure.run_measure`) runs it with :func:`~truncsens.engine.run.skeleton.run_sharded`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
import xarray as xr

from truncsens.engine.block.plan import (
    block_length, check_block_windows, extra_context, forward_tokens, policy_forward_tokens,
)
from truncsens.engine.block.passes import check_block_model, choose_attention, measure_blocks
from truncsens.engine.block.plan import check_block_budgets
from truncsens.engine.block.policies import measure_policy_blocks
from truncsens.engine.kernel import KernelOutput, draws_measured
from truncsens.engine.run.shard_results import shard_results
from truncsens.engine.run.skeleton import ShardWork
from truncsens.targets import TargetSet, select_block_targets


def block_sizes(ds: xr.Dataset) -> list[int]:
    """Targets per block of a block-protocol results dataset, in target order: a new block starts
    where the document changes or the actual reference context does not grow (the targets of a
    block are consecutive, with contexts c, c+1, ...). An exact run (no ``actual_context``) gives
    one block per target."""
    docs = [str(d) for d in ds["doc"].values]
    context = (np.asarray(ds["actual_context"].values, np.int64) if "actual_context" in ds.coords
               else np.zeros(len(docs), np.int64))  # [n]; an exact run: every target its own block
    sizes: list[int] = []
    for i in range(len(docs)):
        if i == 0 or docs[i] != docs[i - 1] or context[i] != context[i - 1] + 1:
            sizes.append(0)
        sizes[-1] += 1
    return sizes


def block_attrs(cfg, B: int, room: int) -> dict:
    """The attrs every block-protocol results file carries: ``protocol``, ``block_fraction``,
    ``block_size``, ``block_length`` (B) and ``block_extra_context`` (tokens its reference passes read
    beyond N, :func:`~truncsens.engine.block.plan.extra_context`)."""
    return {"protocol": "block", "block_fraction": float(cfg.block_fraction), "block_size": int(cfg.block_size),
            "block_length": B, "block_extra_context": extra_context(B, room)}


def _block_work(cfg, B: int, compute_shard, per_block: Callable[[int], int], label: str) -> ShardWork:
    """The shards of a block run: targets drawn in blocks of B; ``per_block(size)`` gives the forward
    tokens of one block of ``size`` targets (the progress estimate)."""
    size = min(B, cfg.targets_per_doc or B)  # a document's block: B targets, fewer when fewer are asked for
    per_target = max(1, per_block(size) // size)
    return ShardWork(compute_shard, per_target, label, select=partial(select_block_targets, block=B))


def block_work(cfg, loaded, reference_context: int, sweep, docs, attrs: dict) -> ShardWork:
    """The shards of a block-protocol run (see :func:`truncsens.engine.measure.run_measure`): a window
    sweep (or a reencode policy sweep of suffix / sink_recent) here, a policy sweep under streaming or
    prefill_evict by :func:`policy_block_work`. Checks before anything is computed.

    Raises:
        MeasureError: a window that does not fit the shortest actual reference context, or a model
            with sliding-window layers.
    """
    if not sweep.is_window_sweep and sweep.semantics.policy_blocks:
        return policy_block_work(cfg, loaded, reference_context, sweep, docs, attrs)
    N = reference_context
    B = block_length(N, cfg.block_fraction, cfg.block_size)
    room = max(0, loaded.max_context - N) if loaded.max_context else 0  # 0: no stated limit  # positions the model has beyond N
    n_sink = getattr(sweep.policies[0], "n_sink", 0) if sweep.policies else 0  # suffix: 0; sink_recent: its sinks
    windows = [k - n_sink for k in sweep.budgets]  # window w is budget n_sink + w (truncsens.engine.sweep)
    check_block_windows(windows, N, n_sink, B, room)
    check_block_model(loaded.model, loaded.name)
    attrs = {**attrs, **block_attrs(cfg, B, room), "attention_implementation": choose_attention(loaded.model, loaded.device)}
    batch_tokens = cfg.batch_tokens(loaded.device)

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        out = measure_blocks(loaded.model, plan, windows, n_sink, cfg.positions, cfg.block_fraction,
                             cfg.block_size, loaded.device, batch_tokens, on_tokens, room)
        kept = (out.actual_window + n_sink).astype(np.int32)[None, None]  # [1, 1, n, S] keys the target's query read
        kernel = KernelOutput({m: v[None, None] for m, v in out.metrics.items()}, kept, None, out.n_clamped)  # [P=1, R=1, n, S]
        ds = shard_results(kernel, plan, sweep, attrs, docs.bos_id)
        actual = out.actual_window if sweep.is_window_sweep else out.actual_window + n_sink  # [n, S]
        return ds.assign_coords({f"actual_{sweep.dim}": (("target", sweep.dim), actual.astype(np.int32)),
                                 "actual_context": ("target", out.actual_context.astype(np.int32))})

    def per_block(size: int) -> int:
        return forward_tokens([size], N, windows, n_sink, cfg.block_fraction, cfg.block_size, room)

    return _block_work(cfg, B, compute_shard, per_block, "measure (block protocol)")


STREAM_DRAW_SEEDS = ("one seed per (policy seed, doc, first position of the block, policy, draw): the targets of one "
                     "block share their stream's draws (one stream per block); common to every budget")


def policy_block_work(cfg, loaded, reference_context: int, sweep, docs, attrs: dict) -> ShardWork:
    """The shards of a policy sweep under streaming or prefill_evict by the block protocol
    (:func:`truncsens.engine.block.policies.measure_policy_blocks`).

    Results are those of an exact policy sweep (dims, ``kept_tokens``, ``evicted_attention_mass``,
    ``draw``) plus the coord ``actual_context`` [target] (int32) and the attrs of :func:`block_attrs`;
    budgets are exact (no ``actual_budget``). Under streaming ``draw_seeds`` says that a block's
    targets share their stream's draws. Progress counts forward tokens: L = N + e per block for the
    reference, L per streaming pass, B per prefill-evict decode.

    Raises:
        MeasureError: a budget above the shortest actual reference context
            (:func:`~truncsens.engine.block.policies.check_block_budgets`).
    """
    N = reference_context
    B = block_length(N, cfg.block_fraction, cfg.block_size)
    room = max(0, loaded.max_context - N) if loaded.max_context else 0  # 0: no stated limit
    check_block_budgets(sweep.budgets, N, B, room)  # the rest was checked by MeasureConfig (check_policy_blocks)
    attrs = {**attrs, **block_attrs(cfg, B, room)}
    if sweep.semantics.streams:  # one stream per block: its targets share its draws
        attrs["draw_seeds"] = STREAM_DRAW_SEEDS
    batch_tokens = cfg.batch_tokens(loaded.device)

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        out = measure_policy_blocks(loaded.model, plan, sweep.policies, sweep.budgets, sweep.semantics, cfg.draw_seed,
                                    loaded.device, batch_tokens, on_tokens, cfg.draws, room)
        ds = shard_results(out.kernel, plan, sweep, attrs, docs.bos_id)
        return ds.assign_coords(actual_context=("target", out.actual_context.astype(np.int32)))

    passes = sum(draws_measured(sweep.policies, cfg.draws)) * len(sweep.budgets)

    def per_block(size: int) -> int:
        return policy_forward_tokens([size], N, passes, sweep.semantics.streams, room)

    return _block_work(cfg, B, compute_shard, per_block, f"measure {sweep.semantics.name} (block protocol)")
