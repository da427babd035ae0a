"""The batched re-encode engine equals a naive one-pair-at-a-time loop (to 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import requires_reference
from engine_calls import window_metrics
from oracles import naive_pair
from truncsens.models import load_model
from truncsens.targets import TargetSet

WINDOWS = [1, 3, 8, 17, 40]


def random_targets(vocab: int, n: int, reference_context: int, seed: int) -> TargetSet:
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, vocab, (n, reference_context), generator=g)  # [n, N]
    tok = torch.randint(0, vocab, (n,), generator=g)  # [n]
    return TargetSet([f"d{i % 3}" for i in range(n)], np.arange(n, dtype=np.int64) + reference_context, ctx, tok)


def check_against_naive(model, vocab: int, reference_context: int, n_sink: int, positions: str, pairs: int = 20) -> None:
    targets = random_targets(vocab, 6, reference_context, seed=n_sink)
    # a small token budget forces several batches per window
    metrics, n_clamped = window_metrics(model, targets, WINDOWS, n_sink, positions, "cpu", max_batch_tokens=150)
    rng = np.random.default_rng(1)
    picks = [(int(rng.integers(len(targets))), int(rng.integers(len(WINDOWS)))) for _ in range(pairs)]
    assert len(set(picks)) >= 15
    for i, j in picks:
        ref = naive_pair(model, targets.context[i], int(targets.token_id[i]), WINDOWS[j], n_sink, positions)
        for name in ("tv", "kl", "kl_reverse", "js", "nll_ref", "nll_kept"):
            assert metrics[name][i, j] == pytest.approx(ref[name], abs=1e-5), (name, i, WINDOWS[j])
        assert metrics["top1_agree"][i, j] == ref["top1_agree"]
    assert metrics["tv"].min() > 1e-4  # the tiny model really changes with truncation


@pytest.mark.parametrize("positions", ["original", "reindexed"])
@pytest.mark.parametrize("n_sink", [0, 4])
def test_engine_equals_naive_tiny_llama(tiny_llama_dir, positions, n_sink):
    loaded = load_model(tiny_llama_dir)
    check_against_naive(loaded.model, loaded.model.config.vocab_size, 64, n_sink, positions)


@pytest.mark.parametrize("positions", ["original", "reindexed"])
def test_engine_equals_naive_tiny_gpt2_with_sinks(tiny_gpt2_dir, positions):
    loaded = load_model(tiny_gpt2_dir)
    check_against_naive(loaded.model, loaded.model.config.vocab_size, 64, 2, positions)


@requires_reference
@pytest.mark.parametrize("positions,n_sink", [("original", 0), ("reindexed", 0), ("original", 4), ("reindexed", 4)])
def test_engine_equals_naive_reference(positions, n_sink):
    loaded = load_model("reference")
    check_against_naive(loaded.model, loaded.model.config.vocab_size, 96, n_sink, positions)
