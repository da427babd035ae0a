"""Streams batched by the cache they hold (``measure --semantics streaming``).

The reference pass runs batched by N tokens on its own; each (policy, budget)'s streams run in batches
of ``max_batch_tokens // stream_cost`` targets: k + chunk cache slots for a policy with online scores
(its cache is compacted to the keys it keeps), N for a policy without scores (one parallel pass over
the N tokens). The batch sizes are pinned by recording every step's slice, and the values equal those
of a run at batch size 1 (to float rounding between batch sizes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import sharp_tiny_llama
from truncsens.engine import kernel
from truncsens.engine.batching import run_in_batches
from truncsens.engine.kernel import measure_draws
from truncsens.engine.semantics import SEMANTICS
from truncsens.policies import make_policy
from truncsens.targets import TargetSet

N = 32
STREAMING = SEMANTICS["streaming"]


def targets(model, n: int = 6) -> TargetSet:
    g = torch.Generator().manual_seed(7)
    ctx = torch.randint(0, model.config.vocab_size, (n, N), generator=g)  # [n, N]
    return TargetSet([f"d{i % 3}" for i in range(n)], np.arange(n) + 40, ctx,
                     torch.randint(0, model.config.vocab_size, (n,), generator=g))


def policies():
    return [make_policy("h2o", n_sink=2), make_policy("sink_recent", n_sink=2), make_policy("poisson", n_sink=2),
            make_policy("tova"), make_policy("merge_mean", n_sink=2)]


def run(model, max_batch_tokens: int, granularity: str = "token", chunk: int = 1, names=None):
    chosen = [p for p in policies() if names is None or p.name in names]
    return measure_draws(model, targets(model), chosen, [4, 9], STREAMING, "original", 3, "cpu",
                         max_batch_tokens, chunk=chunk, draws=2, granularity=granularity)


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_llama().double()  # float64: batch sizes change nothing above float rounding


@pytest.mark.parametrize("granularity, chunk", [("token", 1), ("token", 3), ("head", 1)])
def test_batched_streams_equal_batch_size_one(model, granularity, chunk):
    """Every metric, kept count and evicted mass of a run whose streams are batched by their cache
    (h2o at k = 4: 6 targets in one batch) equals the run one target at a time."""
    names = None if granularity == "token" else ("h2o", "sink_recent", "poisson", "tova")
    one = run(model, 1, granularity, chunk, names)
    batched = run(model, 10_000, granularity, chunk, names)
    for name, values in one.metrics.items():
        np.testing.assert_allclose(batched.metrics[name], values, atol=1e-6, rtol=1e-6, err_msg=name)  # float32 arrays
    np.testing.assert_array_equal(batched.kept_tokens, one.kept_tokens)
    np.testing.assert_allclose(batched.evicted_attention_mass, one.evicted_attention_mass, atol=1e-6)
    assert one.metrics["kl"].max() > 1e-3  # eviction moved the outputs: the comparison can fail
    assert one.evicted_attention_mass.max() > 1e-3


def test_batch_sizes_follow_what_a_stream_holds(model, monkeypatch):
    """At N = 32 and a budget of 64 tokens per batch: the reference pass and the streams of a policy
    without scores run 64 // 32 = 2 targets at a time; h2o, poisson and tova at k = 4, chunk 1 hold
    5 slots (64 // 5 = 12, capped by the 6 targets: one batch), at k = 9 10 slots (6 targets);
    merge_mean's cache of k - 1 slots the same."""
    calls = []

    def recording(step, n_items, seq_len, max_batch_tokens, unit="token sequences"):
        sizes = []

        def recorded(sl: slice) -> None:
            sizes.append(sl.stop - sl.start)
            step(sl)

        run_in_batches(recorded, n_items, seq_len, max_batch_tokens, unit)
        calls.append((seq_len, sizes))

    monkeypatch.setattr(kernel, "run_in_batches", recording)
    run(model, 64)
    reference = [(N, [2, 2, 2])]
    per_policy = {"h2o": [(5, [6]), (10, [6])], "sink_recent": [(N, [2, 2, 2])] * 2, "poisson": [(5, [6]), (10, [6])],
                  "tova": [(5, [6]), (10, [6])], "merge_mean": [(5, [6]), (10, [6])]}
    assert calls == reference + [c for p in policies() for c in per_policy[p.name]]
    calls.clear()
    run(model, 24, names=("h2o",))  # 24 // 5 = 4 targets, then 2; 24 // 10 = 2 targets
    assert calls == [(N, [1] * 6), (5, [4, 2]), (10, [2, 2, 2])]


def test_stream_cost_per_policy_and_model(model):
    """k + chunk for a policy with online scores or a merging cache, capped by N; N for a policy without
    scores; Hkv · k + chunk under head granularity (2 key/value heads); N on a model that applies its
    windows on cache indices (GPT-Neo keeps every slot)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    h2o, sink_recent = make_policy("h2o"), make_policy("sink_recent")
    assert STREAMING.stream_cost(4096, 256, 1, h2o, model) == 257
    assert STREAMING.stream_cost(4096, 256, 16, make_policy("key_norm"), model) == 272
    assert STREAMING.stream_cost(4096, 256, 1, make_policy("merge_mean")) == 257
    assert STREAMING.stream_cost(300, 256, 64, h2o, model) == 300
    assert STREAMING.stream_cost(4096, 256, 1, sink_recent, model) == 4096
    assert STREAMING.stream_cost(4096, 256, 1, make_policy("random"), model) == 4096
    assert STREAMING.stream_cost(4096, 256, 1, h2o, model, "head") == 513
    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, window_size=3,
                                         attention_types=[[["global", "local"], 1]]))
    assert STREAMING.stream_cost(4096, 256, 1, h2o, neo) == 4096
    assert SEMANTICS["prefill_evict"].stream_cost(4096, 256, 1, h2o, model) == 4096
