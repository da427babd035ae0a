"""One contract over every registered policy and every semantics it supports.

Per-query kept sets (``reencode``, ``prefill_evict``): causal, the query's own token kept, the budget
respected (exactly for deterministic and uniform policies, in expectation for poisson), the same seed
giving the same draw, offsets only where the policy declared it needs them.

Streaming (one eviction step per key, :mod:`truncsens.policies.streaming`), for every chunk size: the
kept sets are nested in time (a key evicted at step q is never read again), causal, the own token
kept, at most k keys for the target's query, exactly min(k, q + 1) per query for deterministic and
uniform policies at chunk 1; a policy that tries to bring a key back is refused.

Engine: every (policy, semantics) pair runs end to end, and at a budget covering the whole context
nothing is evicted, so every metric equals the full-context answer (KL = TV = 0 up to float32 noise).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine_calls import retention_targets
from truncsens.engine.semantics import SEMANTICS
from truncsens.models import load_model
from truncsens.policies import POLICIES, PolicyError, make_policy
from truncsens.policies.base import LOGIT_OFFSETS, StreamStep
from truncsens.policies.streaming import ChunkStats, run_stream
from truncsens.targets import TargetSet

T, K = 24, 10
PAIRS = list(itertools.product(POLICIES, SEMANTICS))
SCORED = {"poisson", "h2o", "tova", "key_norm", "snapkv", "snapkv_shared", "topk"}
MERGING = {"merge_mean", "merge_nearest"}  # no kept sets: merged caches (tests/test_merge_policies.py)


def supported(policy_name: str, semantics_name: str) -> bool:
    try:
        SEMANTICS[semantics_name].check_policy(make_policy(policy_name, n_sink=2))
    except PolicyError:
        return False
    return True


RUNNABLE = [(p, s) for p, s in PAIRS if supported(p, s)]
PER_QUERY = [(p, s) for p, s in RUNNABLE if s != "streaming" and p not in MERGING]
STREAMING = [p for p, s in RUNNABLE if s == "streaming" and p not in MERGING]


def test_refused_pairs():
    """Policies that read scores need a semantics with a pass to read them from; SnapKV's observation
    window exists only in a full prefill; independent per-query draws are no streaming cache."""
    refused = sorted(set(PAIRS) - set(RUNNABLE))
    assert refused == sorted([(p, "reencode") for p in SCORED | MERGING]
                             + [("snapkv", "streaming"), ("snapkv_shared", "streaming")])
    with pytest.raises(PolicyError, match="random cannot be run with semantics streaming: it needs an independent kept "
                                          "set per query .*use --semantics reencode or prefill_evict"):
        SEMANTICS["streaming"].check_policy(make_policy("random", per_query=True))
    with pytest.raises(PolicyError, match="snapkv cannot be run with semantics streaming: it needs the attention of an "
                                          "observation window .*use --semantics prefill_evict"):
        SEMANTICS["streaming"].check_policy(make_policy("snapkv"))
    with pytest.raises(PolicyError, match="snapkv_shared cannot be run with semantics streaming: it needs the attention "
                                          "of an observation window .*use --semantics prefill_evict"):
        SEMANTICS["streaming"].check_policy(make_policy("snapkv_shared"))


def kept_sets(policy_name: str, semantics_name: str, seeds: list[int]):
    policy = make_policy(policy_name, n_sink=2)
    queries = SEMANTICS[semantics_name].queries(T, "cpu")  # [Q]
    g = torch.Generator().manual_seed(7)
    shape = (len(seeds), queries.numel(), T)
    if policy.layer_heads:  # per layer and key/value head: [L, B, Hkv, Q, T]
        shape = (2, len(seeds), 2, queries.numel(), T)
    scores = torch.rand(shape, generator=g) + 0.01 if policy.needs_scores else None
    return policy, queries, policy.keep(T, K, queries, seeds, scores)


@pytest.mark.parametrize("policy_name,semantics_name", PER_QUERY)
def test_kept_set_contract(policy_name, semantics_name):
    policy, queries, kept = kept_sets(policy_name, semantics_name, [3, 4, 5])
    B, Q = 3, queries.numel()
    assert kept.keep.shape == (B, Q, T) and kept.offset.shape == (B, Q, T)
    later = torch.arange(T).unsqueeze(0) > queries.unsqueeze(1)  # [Q, T]
    assert not kept.keep[:, later].any(), "a query keeps a later key"
    assert kept.keep[:, torch.arange(Q), queries].all(), "a query dropped its own token"
    counts = kept.counts.double()  # [B, Q]
    available = (queries + 1).clamp(max=K).double()  # [Q]
    if policy_name == "poisson":
        pi, _ = policy.design(K, queries, torch.ones(B, Q, T))
        np.testing.assert_allclose(pi.sum(-1).numpy(), available.expand(B, Q).numpy(), atol=1e-9)
    else:
        assert torch.equal(counts, available.expand(B, Q)), "deterministic and uniform policies keep exactly min(k, q+1)"
    again = kept_sets(policy_name, semantics_name, [3, 4, 5])[2]
    assert torch.equal(again.keep, kept.keep) and torch.equal(again.offset, kept.offset)
    if LOGIT_OFFSETS not in policy.requirements():
        assert not kept.has_offsets()
    assert not kept.offset[~kept.keep].any(), "offsets on dropped keys"


def synthetic_observe(seed: int, B: int):
    """Positive random attention over the keys each chunk query reads (rows sum to 1) and random key norms."""
    g = torch.Generator().manual_seed(seed)

    def observe(s, e, alive, offset):
        c = e - s
        read = alive.unsqueeze(1).repeat(1, c, 1)  # [B, c, e]
        read[:, :, s:] = torch.ones(c, c, dtype=torch.bool).tril()
        w = torch.rand(B, c, e, generator=g) * read
        return ChunkStats(attention=w / w.sum(-1, keepdim=True), key_norm=torch.rand(B, c, generator=g) + 0.5)

    return observe


def streamed(policy_name: str, chunk: int, seeds: list[int]):
    policy = make_policy(policy_name, n_sink=2)
    return policy, run_stream(policy, K, T, chunk, seeds, synthetic_observe(11, len(seeds)))


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("policy_name", STREAMING)
def test_streaming_kept_sets_are_nested_in_time(policy_name, chunk):
    policy, ev = streamed(policy_name, chunk, [3, 4, 5])
    kept = ev.kept()
    keep = kept.keep  # [B, T, T]
    q = torch.arange(T)
    assert not keep[:, q.view(T, 1) < q.view(1, T)].any(), "a query keeps a later key"
    assert keep[:, q, q].all(), "a query dropped its own token"
    earlier = q.view(T, 1) >= q.view(1, T)  # [T, T] key j <= query q
    back = keep[:, 1:, :] & ~keep[:, :-1, :] & earlier[:-1].unsqueeze(0)  # kept at q + 1 but not at q (j <= q)
    assert not back.any(), "an evicted key came back"
    counts = kept.counts  # [B, T]
    if policy.expected_budget:  # poisson: k keys per query in expectation, not surely
        assert abs(float(counts[:, K + chunk:].float().mean()) - K) < 1.0
    else:
        assert int(counts[:, -1].max()) <= K and int(counts.max()) <= K + chunk - 1
    assert int((ev.evict < T).sum()) > 0  # something was evicted: the property is not vacuous
    if policy_name != "poisson" and chunk == 1:
        assert torch.equal(counts, (q + 1).clamp(max=K).expand(3, T))
    again = streamed(policy_name, chunk, [3, 4, 5])[1]
    assert torch.equal(again.evict, ev.evict) and torch.equal(again.offset, ev.offset)
    if LOGIT_OFFSETS not in policy.requirements():
        assert not kept.has_offsets()
    else:
        assert kept.has_offsets()  # poisson drew some keys with pi < 1


class _Readmits:
    """A broken streaming policy: drops the oldest key at the first step, brings it back at the next."""

    name = "broken"

    def __init__(self, change_offset: bool = False):
        self.calls, self.change_offset = 0, change_offset

    def check(self, budget, context_len):
        pass

    def score_kind(self):
        return None

    def evict(self, view):
        self.calls += 1
        keep = view.alive.clone()
        if self.change_offset:
            drawn = torch.ones_like(view.drawn)
            return StreamStep(keep, view.offset + (self.calls > 1), drawn)
        keep[:, 0] = self.calls > 1
        return StreamStep(keep, view.offset, view.drawn)


def test_run_stream_refuses_readmission_and_redrawn_offsets():
    observe = lambda s, e, alive, offset: ChunkStats()  # noqa: E731
    with pytest.raises(PolicyError, match="kept a key it had evicted"):
        run_stream(_Readmits(), 20, 8, 1, [0], observe)
    with pytest.raises(PolicyError, match="changed the offset of a key drawn earlier"):
        run_stream(_Readmits(change_offset=True), 20, 8, 1, [0], observe)


@pytest.mark.parametrize("policy_name,semantics_name", RUNNABLE)
def test_engine_contract(tiny_llama_dir, policy_name, semantics_name):
    model = load_model(tiny_llama_dir).model
    n = 3
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, model.config.vocab_size, (n, T), generator=g)  # [n, T]
    targets = TargetSet([f"d{i}" for i in range(n)], np.arange(n) + T, ctx, torch.randint(0, 50, (n,), generator=g))
    policy = make_policy(policy_name, n_sink=2)
    metrics, extras, _ = retention_targets(model, targets, [policy], [K, T], semantics_name, "original", 0, "cpu", 10_000)
    assert metrics["tv"].shape == (1, n, 2)
    assert np.all((metrics["tv"] >= 0) & (metrics["tv"] <= 1)) and np.all(metrics["kl"] >= 0)
    np.testing.assert_allclose(metrics["kl"][0, :, 1], 0, atol=2e-6)  # budget T: nothing evicted
    np.testing.assert_allclose(metrics["tv"][0, :, 1], 0, atol=2e-4)
    np.testing.assert_array_equal(metrics["nll_ref"][0, :, 1], metrics["nll_ref"][0, :, 0])
    assert metrics["kl"][0, :, 0].max() > 1e-4  # budget K < T evicts: the metrics can tell
    np.testing.assert_array_equal(extras["kept_tokens"][0, :, 1], T)
