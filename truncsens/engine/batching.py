"""Automatic batch size with out-of-memory back-off (accelerate's find_executable_batch_size)."""

from __future__ import annotations

import inspect
from typing import Callable

from accelerate.utils import find_executable_batch_size
from accelerate.utils.memory import should_reduce_batch_size

_HAS_REDUCE_FN = "reduce_batch_size_fn" in inspect.signature(find_executable_batch_size).parameters


class OutOfMemoryAtBatchSizeOne(RuntimeError):
    """Even one sequence at a time does not fit in memory."""


def _loop(step: Callable[[slice], None], n_items: int, batch_size: int) -> int:
    for i in range(0, n_items, batch_size):
        step(slice(i, min(i + batch_size, n_items)))
    return batch_size


def _oom_message(seq_len: int, unit: str = "token sequences") -> str:
    return (f"out of memory at batch size 1 with {seq_len}-{unit}: lower --reference-context, "
            "use --dtype bfloat16, or a device with more memory")


def run_in_batches(step: Callable[[slice], None], n_items: int, seq_len: int, max_batch_tokens: int,
                   unit: str = "token sequences") -> int:
    """Call ``step(slice)`` over ``range(n_items)`` in batches of at most ``max_batch_tokens`` tokens.

    The first attempt runs directly. On an out-of-memory error (as recognised by accelerate's
    ``should_reduce_batch_size``) the range is run again under ``find_executable_batch_size``
    starting from half the batch size, halving until it fits; so ``step`` must write its results
    into preallocated storage (idempotent). (The direct first attempt avoids accelerate's
    ``gc.collect()`` on every call, which costs more than a small forward pass.)

    Args:
        step: processes items ``slice.start`` .. ``slice.stop - 1``.
        n_items: number of items (sequences).
        seq_len: tokens per sequence, to turn the token budget into a batch size.
        max_batch_tokens: token budget of one forward pass (batch size x sequence length).
        unit: what ``seq_len`` counts, in the out-of-memory message ("slot streams" for streams sized
            by the cache they hold).

    Returns:
        The batch size that worked.

    Raises:
        OutOfMemoryAtBatchSizeOne: out of memory even at batch size 1.
    """
    if n_items == 0:
        return 0
    start = max(1, min(n_items, max_batch_tokens // max(1, seq_len)))
    try:
        return _loop(step, n_items, start)
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not should_reduce_batch_size(exc):
            raise
    if start == 1:
        raise OutOfMemoryAtBatchSizeOne(_oom_message(seq_len, unit)) from None

    size = [start // 2]

    def _halve() -> int:  # accelerate >= 1.x multiplies by 0.9 by default; we halve, as documented
        size[0] //= 2
        return size[0]

    kwargs = {"reduce_batch_size_fn": _halve} if _HAS_REDUCE_FN else {}  # older accelerate halves itself

    @find_executable_batch_size(starting_batch_size=start // 2, **kwargs)
    def _retry(batch_size: int) -> int:
        return _loop(step, n_items, batch_size)

    try:
        return _retry()
    except RuntimeError as exc:
        if "No executable batch size found" in str(exc):
            raise OutOfMemoryAtBatchSizeOne(_oom_message(seq_len, unit)) from None
        raise
