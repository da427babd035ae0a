"""Position-preserving vs re-indexed truncation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_calls import window_metrics as measure_targets
from truncsens.engine.semantics import SEMANTICS
from truncsens.policies import PolicyError, make_policy
from truncsens.models import load_model
from truncsens.targets import TargetSet


def _targets(vocab: int) -> TargetSet:
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, vocab, (4, 100), generator=g)  # [4, 100]
    return TargetSet(["a"] * 4, np.arange(4) + 100, ctx, torch.randint(0, vocab, (4,), generator=g))


def kept_window(n: int, window: int, n_sink: int, positions: str) -> tuple[list[int], list[int]]:
    """Kept indices and position ids of a window with sinks (the re-encode semantics of a sink_recent policy)."""
    policy = make_policy("sink_recent", n_sink=n_sink) if n_sink else make_policy("suffix")
    kept = policy.keep(n, n_sink + window, torch.tensor([n - 1]), [0])
    index, pos = SEMANTICS["reencode"].gather(kept, n_sink + window, positions)
    return index[0].tolist(), pos[0].tolist()


def test_kept_index_and_positions_by_hand():
    assert kept_window(10, 3, 0, "original") == ([7, 8, 9], [7, 8, 9])
    assert kept_window(10, 3, 2, "original") == ([0, 1, 7, 8, 9], [0, 1, 7, 8, 9])
    assert kept_window(10, 3, 2, "reindexed") == ([0, 1, 7, 8, 9], [0, 1, 2, 3, 4])
    with pytest.raises(PolicyError, match="larger than the available context"):
        kept_window(10, 9, 2, "original")
    with pytest.raises(ValueError, match="positions"):
        SEMANTICS["reencode"].check_positions("shifted")


def test_rope_without_sinks_is_translation_invariant(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir)
    t = _targets(loaded.model.config.vocab_size)
    a, _ = measure_targets(loaded.model, t, [2, 10, 50], 0, "original", "cpu", 4096)
    b, _ = measure_targets(loaded.model, t, [2, 10, 50], 0, "reindexed", "cpu", 4096)
    np.testing.assert_allclose(a["tv"], b["tv"], atol=2e-5)
    np.testing.assert_allclose(a["kl"], b["kl"], atol=2e-5)
    assert a["tv"].mean() > 1e-3


def test_rope_with_sinks_depends_on_positions(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir)
    t = _targets(loaded.model.config.vocab_size)
    a, _ = measure_targets(loaded.model, t, [10], 4, "original", "cpu", 4096)
    b, _ = measure_targets(loaded.model, t, [10], 4, "reindexed", "cpu", 4096)
    assert np.abs(a["tv"] - b["tv"]).max() > 1e-3


def test_learned_absolute_positions_differ(tiny_gpt2_dir):
    loaded = load_model(tiny_gpt2_dir)
    t = _targets(loaded.model.config.vocab_size)
    a, _ = measure_targets(loaded.model, t, [2, 10, 50], 0, "original", "cpu", 4096)
    b, _ = measure_targets(loaded.model, t, [2, 10, 50], 0, "reindexed", "cpu", 4096)
    assert np.abs(a["tv"] - b["tv"]).max() > 1e-3


def test_sinks_are_attended_across_a_position_jump(tiny_llama_dir):
    """With original positions the ids jump from S-1 to N-w; the sinks must still be read
    (a jump must not be taken for a packed-sequence boundary that hides them)."""
    from truncsens.engine.forward import next_token_logprobs

    loaded = load_model(tiny_llama_dir)
    ctx = _targets(loaded.model.config.vocab_size).context[:1]  # [1, 100]
    window_only = next_token_logprobs(loaded.model, ctx[:, 90:], torch.arange(90, 100)[None])
    with_sinks = next_token_logprobs(loaded.model, torch.cat([ctx[:, :4], ctx[:, 90:]], 1),
                                     torch.cat([torch.arange(4), torch.arange(90, 100)])[None])
    assert (window_only - with_sinks).abs().max() > 1e-3
