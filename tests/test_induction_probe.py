"""The probes of benchmarks/induction_probe.py on a stream of distinct tokens (why the reference model misses copy targets)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SPEC = importlib.util.spec_from_file_location("induction_probe", Path(__file__).parents[1] / "benchmarks" / "induction_probe.py")
probe = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(probe)


def test_a_natural_probe_ends_with_the_span_from_distance_d():
    stream = np.arange(10_000, dtype=np.int64)  # every token distinct: copies are visible
    seq = probe.probe_sequence(stream, np.random.default_rng(0), 200, 50, drawn=False)
    start = int(seq[0])
    assert np.array_equal(seq[:176], np.arange(start, start + 176))  # the crop, untouched before the copy
    assert np.array_equal(seq[176:], np.arange(start + 126, start + 150))  # each token from 50 positions back


def test_a_drawn_probe_copies_drawn_tokens_and_a_perfect_copier_scores_every_scored_token():
    stream = np.arange(10_000, dtype=np.int64)
    seq = probe.probe_sequence(stream, np.random.default_rng(1), 200, 50, drawn=True)
    start = int(seq[0])
    src = slice(126, 150)
    assert np.array_equal(seq[src], seq[176:])  # the copy
    assert not np.array_equal(seq[src], np.arange(start + 126, start + 150))  # of drawn tokens, not the crop's
    keep = np.r_[0:126, 150:176]
    assert np.array_equal(seq[keep], start + keep)  # the rest stays the crop
    # the token after each position's earlier occurrence: a perfect copier's prediction at n - SPAN - 1 + i
    pred = np.array([seq[126 + i] for i in range(24)])
    assert probe.copied_hits(pred, seq) == 24 - probe.SCORED_FROM
    assert probe.copied_hits(np.roll(pred, 1), seq) == 0  # off by one position: no hit
    with pytest.raises(ValueError, match="distance 160 needs a context of at least 208 tokens, got 200"):
        probe.probe_sequence(stream, np.random.default_rng(0), 200, 160, drawn=False)
