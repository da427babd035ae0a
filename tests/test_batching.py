"""run_in_batches: token-budget batch size, out-of-memory back-off, errors."""

from __future__ import annotations

import numpy as np
import pytest

from truncsens.engine.batching import OutOfMemoryAtBatchSizeOne, run_in_batches


class Recorder:
    """A step that fails with a CUDA-style OOM when a slice holds more than ``fits`` items."""

    def __init__(self, n: int, fits: int | None = None, error: Exception | None = None):
        self.fits, self.error = fits, error
        self.calls: list[tuple[int, int]] = []
        self.out = np.full(n, -1)

    def __call__(self, sl: slice) -> None:
        self.calls.append((sl.start, sl.stop))
        if self.error is not None:
            raise self.error
        if self.fits is not None and sl.stop - sl.start > self.fits:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.out[sl] = np.arange(sl.start, sl.stop) * 10


def test_batch_size_from_token_budget():
    rec = Recorder(10)
    # 12 tokens / 4 tokens per sequence -> 3 sequences per batch
    assert run_in_batches(rec, 10, 4, 12) == 3
    assert rec.calls == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert rec.out.tolist() == [i * 10 for i in range(10)]


def test_batch_size_capped_by_items_and_at_least_one():
    rec = Recorder(5)
    assert run_in_batches(rec, 5, 2, 1000) == 5
    assert rec.calls == [(0, 5)]
    rec = Recorder(3)
    assert run_in_batches(rec, 3, 100, 10) == 1  # budget below one sequence: still one at a time
    assert rec.calls == [(0, 1), (1, 2), (2, 3)]


def test_no_items():
    rec = Recorder(0)
    assert run_in_batches(rec, 0, 4, 100) == 0
    assert rec.calls == []


def test_oom_backoff_halves_and_reruns():
    rec = Recorder(20, fits=2)
    assert run_in_batches(rec, 20, 1, 8) == 2
    # tries 8 (fails at the first slice), then 4 (fails), then 2 over the whole range
    assert rec.calls[:2] == [(0, 8), (0, 4)]
    assert rec.calls[2:] == [(i, i + 2) for i in range(0, 20, 2)]
    assert rec.out.tolist() == [i * 10 for i in range(20)]


def test_oom_backoff_uneven_sizes():
    rec = Recorder(7, fits=3)
    assert run_in_batches(rec, 7, 10, 60) == 3  # start 6 -> 3
    assert rec.calls == [(0, 6), (0, 3), (3, 6), (6, 7)]
    assert rec.out.tolist() == [i * 10 for i in range(7)]


def test_oom_at_batch_size_one():
    rec = Recorder(4, fits=0)
    with pytest.raises(OutOfMemoryAtBatchSizeOne) as info:
        run_in_batches(rec, 4, 128, 512)
    assert str(info.value).startswith("out of memory at batch size 1 with 128-token sequences: lower --reference-context")
    assert [b - a for a, b in rec.calls] == [4, 2, 1]
    # streams sized by the cache they hold say so (k + chunk slots, not the context's N tokens)
    with pytest.raises(OutOfMemoryAtBatchSizeOne, match=r"^out of memory at batch size 1 with 257-slot streams \(the cache"):
        run_in_batches(Recorder(4, fits=0), 4, 257, 1024, "slot streams (the cache one stream holds)")


def test_other_errors_propagate_without_retry():
    rec = Recorder(4, error=RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        run_in_batches(rec, 4, 1, 4)
    assert rec.calls == [(0, 4)]
    rec = Recorder(4, error=ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        run_in_batches(rec, 4, 1, 4)
    assert len(rec.calls) == 1


def test_oom_when_one_sequence_is_the_start():
    rec = Recorder(3, fits=0)
    with pytest.raises(OutOfMemoryAtBatchSizeOne, match="with 1000-token sequences"):
        run_in_batches(rec, 3, 1000, 500)  # budget below one sequence: start at 1, nothing smaller to try
    assert rec.calls == [(0, 1)]


def test_long_backoff_halves_each_time():
    rec = Recorder(64, fits=5)
    assert run_in_batches(rec, 64, 1, 64) == 4
    sizes = [b - a for a, b in rec.calls]
    assert sizes[:4] == [64, 32, 16, 8]  # halving, not accelerate's default factor 0.9
    assert sizes[4:] == [4] * 16
