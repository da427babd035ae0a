"""Block protocol plans: which forward passes measure which targets, with which actual windows and
reference contexts (pure functions; the passes run in :mod:`truncsens.engine.block.passes`).

The exact protocol runs, per target t, one N-token reference pass and one pass per window w: about
2N forward tokens per target for the default windows (powers of two up to N/2). Under re-encoding a
causal model's output at every position of one pass is the re-encode distribution of that
position's own prefix, so one pass measures several consecutive targets (docs/method.md, "Block
protocol"):

- a **block** is B consecutive targets t0 .. t0+B-1 of one document,
  ``B = block_length(N) = K(N)`` with ``K(x) = max(1, min(block_size, floor(x * block_fraction)))``;
- its **reference pass** reads the N + e tokens x[r : t0+B-1], r = t0 + B - 1 - N - e, with
  ``e = min(B - 1, max_context - N)`` (room left by the model's positions), and gives target t0 + j
  the reference distribution with context ``N + e - B + 1 + j`` (positions 0 .. N+e-1): N .. N+B-1
  when the model has room for B - 1 more positions, N - B + 1 .. N when N is its maximum context;
- for window w the block is cut into **chunks** of K(w) targets (the last may be shorter); one pass
  per chunk reads the S sinks x[r : r+S] and x[tc - w : tc + k - 1] (tc its first target, k its
  size), and gives target tc + i the re-encode distribution of window ``w + i`` with those sinks.

Every measurement is exactly a single-target re-encode (a test checks it to 1e-5): target t with
actual reference context c = t - r and actual window a reads x[r : r+S] and x[t-a : t], at positions
0 .. S-1 and c-a .. c-1 (``original``) or 0 .. S+a-1 (``reindexed``); its reference reads x[t-c : t]
at positions 0 .. c-1. Windows within one pass differ by at most ``K(w) - 1 <= block_fraction * w``.

The checks of what a block run can measure exactly also live here (:func:`check_block_windows`,
:func:`check_policy_blocks`, :func:`check_block_budgets`): :class:`~truncsens.engine.config.MeasureConfig`
imports them, and this module imports no configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from truncsens.engine.errors import MeasureError
from truncsens.policies.kvpress_adapter import PREFILL_LAYERS


def targets_per_pass(x: int, block_fraction: float, block_size: int) -> int:
    """K(x) = max(1, min(block_size, floor(x * block_fraction))): targets of one pass of window (or
    reference context) x tokens. A small rounding tolerance keeps ``floor(64 * 0.125) == 8``."""
    return max(1, min(int(block_size), int(math.floor(x * block_fraction + 1e-9))))


def block_length(reference_context: int, block_fraction: float, block_size: int) -> int:
    """B = K(N): targets per block (one reference pass each)."""
    return targets_per_pass(reference_context, block_fraction, block_size)


def extra_context(size: int, room: int) -> int:
    """e = min(size - 1, room): tokens the reference pass of a block of ``size`` targets reads beyond
    N (``room`` = the model's maximum context - N, >= 0)."""
    return min(size - 1, max(0, room))


def shortest_context(reference_context: int, block: int, room: int) -> int:
    """The shortest actual reference context of any block: N - B + 1 + min(B - 1, room)."""
    return reference_context - block + 1 + extra_context(block, room)


def check_block_windows(windows: list[int], reference_context: int, n_sink: int, block: int, room: int = 0) -> None:
    """Every window fits inside the shortest actual reference context c (:func:`shortest_context`):
    ``w <= c - 1`` and ``n_sink + w <= c`` (as ``w < N`` and ``n_sink + w <= N`` for the exact protocol).

    Raises:
        MeasureError: a window that does not fit (naming the largest that does).
    """
    shortest = shortest_context(reference_context, block, room)
    for w in windows:
        if w > shortest - 1 or n_sink + w > shortest:
            raise MeasureError(
                f"window {w} does not fit the block protocol's shortest reference context {shortest} "
                f"(N {reference_context}, block {block}{f', {n_sink} sinks' if n_sink else ''}): use windows up to "
                f"{min(shortest - 1, shortest - n_sink)}, a smaller --block-size, or --protocol exact")


def check_policy_blocks(semantics, policies: Sequence, positions: str, granularity: str, chunk: int) -> None:
    """What the block protocol of a policy sweep (:mod:`truncsens.engine.block.policies`) cannot run
    exactly; checked once, by :class:`~truncsens.engine.config.MeasureConfig` (the budgets, which need
    N, by :func:`check_block_budgets`).

    Args:
        semantics: the :class:`~truncsens.engine.semantics.base.Semantics` object, or its name (looked
            up in :data:`truncsens.engine.semantics.SEMANTICS`); policies: the run's policies.

    Raises:
        MeasureError: a semantics without ``policy_blocks`` (reencode), a kvpress press or another policy
            with kept sets per layer and head (``snapkv``), a merging policy (no kept sets), reindexed
            positions, head granularity or a chunk above 1; each message names the fix
            (``--protocol exact``).
    """
    if isinstance(semantics, str):
        from truncsens.engine.semantics import semantics_for  # (the registry imports no block module)

        semantics = semantics_for(semantics)
    fix = "use protocol='exact' (--protocol exact)"
    block = "protocol='block' (--protocol block)"
    if not semantics.policy_blocks:
        able = " or ".join(semantics.names_where(lambda s: s.policy_blocks))
        windows = " or ".join(semantics.names_where(lambda s: not s.policy_blocks))
        raise MeasureError(f"{block} runs policy sweeps under semantics (--semantics) {able} "
                           f"(under {windows} only --policy suffix or sink_recent, as window sweeps); {fix}")
    for p in policies:
        if PREFILL_LAYERS in p.requirements():
            raise MeasureError(f"{block} does not run kvpress presses ({p.name}: per-layer kept sets); {fix}")
        if p.merges:
            raise MeasureError(f"{block} measures kept sets; {p.name} merges evicted keys into kept slots; {fix}")
        if p.layer_heads:
            raise MeasureError(f"{block} measures one kept set per target; {p.name} keeps one per layer and "
                               f"key/value head; {fix} (or snapkv_shared, one set for all layers and heads)")
    if positions != "original":
        raise MeasureError(f"{block} keeps original positions (positions={positions!r}, --positions {positions}, re-rotates each "
                           f"target's keys); {fix}")
    if granularity != "token":
        raise MeasureError(f"{block} measures one kept set per target (granularity='token', --granularity token); {fix}")
    if chunk != 1:
        raise MeasureError(f"{block} under streaming needs chunk=1 (--chunk 1): with chunks of {chunk} tokens a "
                           "target's own stream evicts at its last prompt token, which a stream shared by a block "
                           f"does not; {fix} or chunk=1")


def check_block_budgets(budgets: Sequence[int], reference_context: int, block: int, room: int = 0) -> None:
    """Every budget fits the block protocol's shortest actual reference context (:func:`shortest_context`).

    Raises:
        MeasureError: a budget above it (the message names the largest that fits and ``--protocol exact``).
    """
    shortest = shortest_context(reference_context, block, room)
    for k in budgets:
        if k > shortest:
            raise MeasureError(f"budget {k} is larger than the block protocol's shortest reference context "
                               f"{shortest} (N {reference_context}, block {block}): use budgets up to {shortest}, "
                               "a smaller --block-size, or use --protocol exact")


def chunks(size: int, per_pass: int) -> list[tuple[int, int]]:
    """(start, stop) offsets of the passes that cover a block of ``size`` targets, ``per_pass`` each
    (the last pass takes the rest). Example: ``chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]``."""
    return [(a, min(a + per_pass, size)) for a in range(0, size, per_pass)]


@dataclass(frozen=True)
class Blocks:
    """The blocks of a target set (targets of a block are consecutive, in order).

    Attributes:
        start: [b] int64 index of each block's first target in the target set.
        size: [b] int64 targets per block.
    """

    start: np.ndarray
    size: np.ndarray


def blocks_of(doc: list[str], position: np.ndarray, block: np.ndarray) -> Blocks:
    """Group targets into blocks by (document, first position of the block).

    Args:
        doc: [n] document ids; position: [n] int64 target positions; block: [n] int64 first
            position of each target's block.

    Raises:
        ValueError: a block whose targets are not consecutive positions starting at its first one.
    """
    n = len(doc)
    starts = [i for i in range(n) if i == 0 or doc[i] != doc[i - 1] or block[i] != block[i - 1]]
    sizes = np.diff([*starts, n]).astype(np.int64)
    for s, k in zip(starts, sizes):
        expected = block[s] + np.arange(k)
        if not np.array_equal(position[s : s + k], expected):
            raise ValueError(f"targets of the block at {doc[s]}:{int(block[s])} are not consecutive positions")
    return Blocks(np.asarray(starts, np.int64), sizes)


def actual_contexts(blocks: Blocks, reference_context: int, room: int = 0) -> np.ndarray:
    """[n] int64 actual reference context of every target: ``N + e - size + 1 + j`` for the j-th
    target of a block of ``size`` targets (e = :func:`extra_context`)."""
    parts = [reference_context + extra_context(int(k), room) - k + 1 + np.arange(k) for k in blocks.size]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def actual_windows(blocks: Blocks, window: int, per_pass: int) -> np.ndarray:
    """[n] int64 actual window of every target at nominal window ``window``: ``window + i`` for the
    i-th target of its pass of ``per_pass`` targets."""
    out = [window + np.arange(b - a) for k in blocks.size for a, b in chunks(int(k), per_pass)]
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def block_passes(size: int, reference_context: int, windows: list[int], n_sink: int, block_fraction: float,
                 block_size: int, room: int = 0) -> list[tuple[int, int]]:
    """(tokens, targets) of every forward pass of one block of ``size`` targets: the reference pass
    (N + e tokens, all ``size`` targets), then per window w the passes of k targets each
    (``n_sink + w + k - 1`` tokens, :func:`targets_per_pass`)."""
    out = [(reference_context + extra_context(size, room), size)]
    for w in windows:
        out += [(n_sink + w + (b - a) - 1, b - a) for a, b in chunks(size, targets_per_pass(w, block_fraction, block_size))]
    return out


def forward_tokens(block_sizes: list[int], reference_context: int, windows: list[int], n_sink: int,
                   block_fraction: float, block_size: int, room: int = 0) -> int:
    """Forward tokens of the block protocol for blocks of the given sizes: N + e per block
    (reference) plus ``n_sink + w + k - 1`` per pass of k targets at window w (:func:`block_passes`)."""
    return sum(tokens for size in block_sizes
               for tokens, _ in block_passes(size, reference_context, windows, n_sink, block_fraction, block_size, room))


def policy_forward_tokens(block_sizes: list[int], reference_context: int, passes: int, streaming: bool,
                          room: int = 0) -> int:
    """Forward tokens of the block protocol for a policy sweep (:mod:`truncsens.engine.block.policies`):
    per block of ``size`` targets, the reference pass of L = N + e tokens, then ``passes`` kept passes
    (budgets x draws measured, summed over policies) of L tokens each under ``streaming`` (one stream
    per block) or ``size`` tokens under prefill_evict (one decode of the block's queries)."""
    total = 0
    for size in block_sizes:
        L = reference_context + extra_context(size, room)
        total += L + passes * (L if streaming else size)
    return total


def exact_forward_tokens(n_targets: int, reference_context: int, windows: list[int], n_sink: int) -> int:
    """Forward tokens of the exact protocol: ``N + sum(n_sink + w)`` per target."""
    return n_targets * (reference_context + sum(n_sink + w for w in windows))


def block_saving(targets_per_doc: int, reference_context: int, windows: list[int], n_sink: int,
                 block_fraction: float, block_size: int) -> float:
    """Forward tokens of the exact protocol over those of the block protocol for one document's
    ``targets_per_doc`` consecutive targets of a window sweep (:func:`exact_forward_tokens` /
    :func:`forward_tokens`; blocks of at most B = :func:`block_length` targets, no extra context)."""
    B = block_length(reference_context, block_fraction, block_size)
    sizes = [b - a for a, b in chunks(targets_per_doc, B)]
    return (exact_forward_tokens(targets_per_doc, reference_context, windows, n_sink)
            / forward_tokens(sizes, reference_context, windows, n_sink, block_fraction, block_size))


def larger_blocks_note(targets_per_doc: int, reference_context: int, windows: list[int], n_sink: int,
                       block_fraction: float, block_size: int) -> str | None:
    """A note when fewer targets per document than a full block (B) leave the block protocol's saving
    unused: the saving now and with B targets per document (the trade-off: docs/protocols.md); None
    when the blocks are full already."""
    B = block_length(reference_context, block_fraction, block_size)
    if targets_per_doc >= B:
        return None
    now = block_saving(targets_per_doc, reference_context, windows, n_sink, block_fraction, block_size)
    full = block_saving(B, reference_context, windows, n_sink, block_fraction, block_size)
    return (f"the block protocol with {targets_per_doc} targets per document reads {now:.1f}x fewer forward tokens "
            f"than the exact one; --targets-per-doc {B} (full blocks) would read {full:.1f}x fewer "
            "(consecutive targets: docs/protocols.md)")
