"""Automatic batch size with out-of-memory back-off (accelerate's find_executable_batch_size)."""

from __future__ import annotations

from typing import Callable

from accelerate.utils import find_executable_batch_size


class OutOfMemoryAtBatchSizeOne(RuntimeError):
    """Even one sequence at a time does not fit in memory."""


def run_in_batches(step: Callable[[slice], None], n_items: int, seq_len: int, max_batch_tokens: int) -> int:
    """Call ``step(slice)`` over ``range(n_items)`` in batches of at most ``max_batch_tokens`` tokens.

    On an out-of-memory error the batch size is halved and the whole range is run again, so
    ``step`` must write its results into preallocated storage (idempotent).

    Args:
        step: processes items ``slice.start`` .. ``slice.stop - 1``.
        n_items: number of items (sequences).
        seq_len: tokens per sequence, to turn the token budget into a batch size.
        max_batch_tokens: token budget of one forward pass (batch size x sequence length).

    Returns:
        The batch size that worked.

    Raises:
        OutOfMemoryAtBatchSizeOne: out of memory even at batch size 1.
    """
    if n_items == 0:
        return 0
    start = max(1, min(n_items, max_batch_tokens // max(1, seq_len)))

    @find_executable_batch_size(starting_batch_size=start)
    def _run(batch_size: int) -> int:
        for i in range(0, n_items, batch_size):
            step(slice(i, min(i + batch_size, n_items)))
        return batch_size

    try:
        return _run()
    except RuntimeError as exc:
        if "No executable batch size found" in str(exc):
            raise OutOfMemoryAtBatchSizeOne(
                f"out of memory at batch size 1 with {seq_len}-token sequences: lower --reference-context, "
                "use --dtype bfloat16, or a device with more memory") from None
        raise
