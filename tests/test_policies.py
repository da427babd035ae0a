"""Retention policies: kept sets against explicit constructions, draws, the Poisson design, errors."""

from __future__ import annotations

import math

import pytest
import torch

from truncsens.engine.semantics import SEMANTICS, semantics_for
from truncsens.policies import (
    POLICIES, PoissonPolicy, PolicyError, RandomPolicy, SinkRecentPolicy, SuffixPolicy, make_policy, parse_policies,
)

T = 20
QUERIES = torch.arange(T)


def as_sets(keep: torch.Tensor) -> list[set[int]]:
    """[Q, T] bool -> list of kept key sets."""
    return [set(torch.nonzero(row).flatten().tolist()) for row in keep]


def test_registry_finds_every_policy_by_name():
    assert set(POLICIES) == {"suffix", "sink_recent", "random", "poisson", "h2o", "tova", "snapkv", "snapkv_shared",
                             "key_norm", "topk", "merge_mean", "merge_nearest"}
    for name, cls in POLICIES.items():
        assert isinstance(make_policy(name), cls)
        assert cls.__doc__ and cls.__module__.endswith(name)
    with pytest.raises(PolicyError, match="unknown policy 'lru'.*suffix, sink_recent, random, poisson, h2o, tova, snapkv, snapkv_shared, key_norm"):
        make_policy("lru")
    assert parse_policies("sink_recent, random") == ["sink_recent", "random"]
    with pytest.raises(PolicyError, match="twice"):
        parse_policies("random,random")
    with pytest.raises(PolicyError, match="unknown policy"):
        parse_policies("sink_recent,fifo")


@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_suffix_keeps_the_last_k(k):
    kept = SuffixPolicy().keep(T, k, QUERIES, seeds=[0, 1])
    for b in range(2):
        for q, s in enumerate(as_sets(kept.keep[b])):
            assert s == set(range(max(0, q - k + 1), q + 1))
    assert not kept.has_offsets()


@pytest.mark.parametrize("s,k", [(0, 5), (2, 5), (4, 9), (4, 5)])
def test_sink_recent_keeps_sinks_and_the_last_k_minus_s(s, k):
    kept = SinkRecentPolicy(n_sink=s).keep(T, k, QUERIES, seeds=[0])
    for q, got in enumerate(as_sets(kept.keep[0])):
        want = {j for j in range(q + 1) if j < s or j > q - (k - s)}
        assert got == want
        assert len(got) == min(k, q + 1)


def test_budget_and_sink_errors():
    with pytest.raises(PolicyError, match="larger than the available context of 20 tokens"):
        SuffixPolicy().keep(T, 21, QUERIES, [0])
    with pytest.raises(PolicyError, match="below its minimum of 5"):
        SinkRecentPolicy(n_sink=4).keep(T, 4, QUERIES, [0])
    with pytest.raises(PolicyError, match=r"^sinks \(--sinks\) must be >= 0, got -1$"):
        SinkRecentPolicy(n_sink=-1)


@pytest.mark.parametrize("per_query", [False, True])
def test_random_counts_self_and_causality(per_query):
    k = 6
    kept = RandomPolicy(per_query=per_query).keep(T, k, QUERIES, seeds=[3, 4, 5])
    assert kept.keep.shape == (3, T, T)
    assert torch.equal(kept.counts, torch.clamp(QUERIES + 1, max=k).expand(3, T))
    assert kept.keep[:, QUERIES, QUERIES].all()  # own token kept
    assert not (kept.keep & ~torch.ones(T, T, dtype=torch.bool).tril()).any()  # never a later key
    assert not kept.has_offsets()


def test_random_is_seeded_and_per_sequence_draws_are_nested():
    k = 5
    a = RandomPolicy().keep(T, k, QUERIES, seeds=[11, 12])
    b = RandomPolicy().keep(T, k, QUERIES, seeds=[11, 99])
    assert torch.equal(a.keep[0], b.keep[0]) and not torch.equal(a.keep[1], b.keep[1])
    sets = as_sets(a.keep[0])
    for q in range(1, T):  # an evicted key never comes back: a cache a server could run
        assert sets[q] - {q} <= sets[q - 1]
    per_query = RandomPolicy(per_query=True).keep(T, k, QUERIES, seeds=list(range(20)))
    broken = sum(not (as_sets(per_query.keep[b])[q] - {q} <= as_sets(per_query.keep[b])[q - 1])
                 for b in range(20) for q in range(k, T))
    assert broken > 0  # independent per-query draws are not nested


def test_random_is_uniform_over_earlier_keys():
    k, n = 5, 4000
    kept = RandomPolicy().keep(T, k, torch.tensor([T - 1]), seeds=list(range(n)))  # [n, 1, T]
    freq = kept.keep[:, 0, : T - 1].double().mean(0)  # [T-1]
    p = (k - 1) / (T - 1)
    se = math.sqrt(p * (1 - p) / n)
    assert torch.all((freq - p).abs() < 4.5 * se), freq


def scores_for(batch: int, q: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, q.numel(), T, generator=g, dtype=torch.float64) + 0.05


def test_poisson_certain_set_and_design():
    p = PoissonPolicy(n_sink=2, recent_fraction=0.25, top_fraction=0.25)
    k = 12
    r, t, m = p.slices(k)
    assert (r, t, m) == (3, 3, 4)
    sc = scores_for(3, QUERIES)
    pi, tail = p.design(k, QUERIES, sc)
    kept = p.keep(T, k, QUERIES, [1, 2, 3], sc)
    for b in range(3):
        for q in range(T):
            row_pi, row_tail = pi[b, q], tail[b, q]
            if q + 1 <= k:  # cache not full: everything kept, pi = 1
                assert as_sets(kept.keep[b])[q] == set(range(q + 1))
                assert torch.all(row_pi[: q + 1] == 1) and not row_tail.any()
                continue
            certain = {j for j in range(q + 1) if row_pi[j] == 1 and not row_tail[j]}
            rest = [j for j in range(2, q - r + 1)]
            top = set(sorted(rest, key=lambda j: -float(sc[b, q, j]))[:t])
            assert certain == set(range(2)) | set(range(q - r + 1, q + 1)) | top
            assert float(row_pi[row_tail].sum()) == pytest.approx(m, abs=1e-9)  # expected count = budget
            assert set(torch.nonzero(row_tail).flatten().tolist()) == set(rest) - top
            kept_set = as_sets(kept.keep[b])[q]
            assert certain <= kept_set <= set(range(q + 1))
            for j in kept_set - certain:  # Hájek offset log(1/pi) on kept tail keys only
                assert float(kept.offset[b, q, j]) == pytest.approx(-math.log(float(row_pi[j])), abs=1e-6)
            for j in certain:
                assert float(kept.offset[b, q, j]) == 0.0


def test_poisson_expected_count_equals_budget():
    p = PoissonPolicy(n_sink=1, recent_fraction=0.25, top_fraction=0.0)
    k, n = 8, 3000
    q = torch.tensor([T - 1])
    sc = scores_for(1, q).expand(n, 1, T)
    counts = p.keep(T, k, q, list(range(n)), sc).counts.double()  # [n, 1]
    pi, tail = p.design(k, q, sc[:1])
    var = float((pi[tail] * (1 - pi[tail])).sum())
    assert float(counts.mean()) == pytest.approx(k, abs=4.5 * math.sqrt(var / n))
    assert counts.std() > 0  # the count really is random


def test_poisson_inclusion_is_proportional_to_score():
    p = PoissonPolicy(n_sink=0, recent_fraction=0.0, top_fraction=0.0)
    q = torch.tensor([T - 1])
    sc = torch.linspace(0.1, 2.0, T, dtype=torch.float64).view(1, 1, T)
    pi, tail = p.design(6, q, sc)
    row = pi[0, 0, : T - 1]
    assert torch.allclose(row / row[0], sc[0, 0, : T - 1] / sc[0, 0, 0])  # none saturated here
    n = 4000
    freq = p.keep(T, 6, q, list(range(n)), sc.expand(n, 1, T)).keep[:, 0, : T - 1].double().mean(0)
    assert torch.all((freq - row).abs() < 4.5 * torch.sqrt(row * (1 - row) / n) + 1e-9)


def test_poisson_budget_covering_the_context_keeps_everything():
    p = PoissonPolicy()
    sc = scores_for(2, QUERIES)
    kept = p.keep(T, T, QUERIES, [0, 1], sc)
    assert torch.equal(kept.keep, torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T))
    assert not kept.has_offsets()


def test_poisson_errors():
    p = PoissonPolicy(n_sink=1, recent_fraction=0.25, top_fraction=0.0)
    q = torch.tensor([T - 1])
    with pytest.raises(PolicyError, match="scores are all zero"):
        p.keep(T, 8, q, [0], torch.zeros(1, 1, T))
    with pytest.raises(PolicyError, match="needs scores"):
        p.keep(T, 8, q, [0], None)
    with pytest.raises(PolicyError, match="non-negative"):
        p.keep(T, 8, q, [0], -torch.ones(1, 1, T))
    with pytest.raises(PolicyError, match="cannot be run with semantics reencode: it needs attention scores, attention-logit offsets on kept keys"):
        semantics_for("reencode").check_policy(p)
    with pytest.raises(ValueError, match="unknown semantics 'sliding'"):
        semantics_for("sliding")
    with pytest.raises(PolicyError, match="unknown poisson score"):
        PoissonPolicy(score="entropy")
    for name in ("suffix", "sink_recent", "random"):
        for sem in SEMANTICS:
            semantics_for(sem).check_policy(make_policy(name))  # every deterministic/uniform policy runs everywhere
    semantics_for("streaming").check_policy(p)
    semantics_for("prefill_evict").check_policy(p)
    assert p.requirements() == {"logit_offsets", "attention_scores"}
    assert PoissonPolicy(score="key_norm").requirements() == {"logit_offsets", "key_norm_scores"}


def test_deployed_policies_keep_by_hand():
    """One query (q = 5, T = 6) at budget 4, scores [.9, .1, .5, .3, .2, 0]:
    h2o (2 recent: 4, 5) + the 2 heaviest of 0..3 -> {0, 2, 4, 5};
    tova: the own token + the 3 highest -> {0, 2, 3, 5}; key_norm (scores as norms): the 3 lowest
    -> {1, 4, 3} + 5; snapkv_shared (window 2: keys 3, 4, and 5) + the highest of 0..2 -> {0, 3, 4, 5}."""
    from truncsens.policies import make_policy

    q = torch.tensor([5])
    scores = torch.tensor([[[0.9, 0.1, 0.5, 0.3, 0.2, 0.0]]])  # [1, 1, 6]
    kept = lambda name, **kw: as_sets(make_policy(name, **kw).keep(6, 4, q, [0], scores).keep[0])[0]  # noqa: E731
    assert kept("h2o") == {0, 2, 4, 5}
    assert kept("tova") == {0, 2, 3, 5}
    assert kept("key_norm") == {1, 3, 4, 5}
    assert kept("snapkv_shared", window=2) == {0, 3, 4, 5}
    with pytest.raises(PolicyError, match="h2o needs scores of shape"):
        make_policy("h2o").keep(6, 4, q, [0], None)
    for name in ("snapkv", "snapkv_shared"):
        with pytest.raises(PolicyError, match=f"{name} needs an observation window >= 1 .* odd pooling kernel"):
            make_policy(name, kernel=4)


def test_snapkv_shared_window_scores_by_hand():
    """Attention of 4 tokens; query 3's window of 2 is rows 1 and 2: votes [a10 + a20, a11 + a21, a22, 0]
    = [.5 + .2, .5 + .3, .5, 0], pooled with kernel 3 (average over the keys inside the sequence):
    [(.7 + .8)/2, (.7 + .8 + .5)/3, (.8 + .5 + 0)/3, (.5 + 0)/2]."""
    from truncsens.policies import make_policy

    att = torch.tensor([[[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.3, 0.5, 0], [0.1, 0.2, 0.3, 0.4]]])
    got = make_policy("snapkv_shared", window=2, kernel=3).window_scores(att, torch.tensor([3]))  # [1, 1, 4]
    want = torch.tensor([(0.7 + 0.8) / 2, (0.7 + 0.8 + 0.5) / 3, (0.8 + 0.5) / 3, 0.5 / 2])
    torch.testing.assert_close(got[0, 0], want)


@pytest.mark.parametrize("name", ["suffix", "sink_recent", "random"])
def test_closed_form_eviction_steps_equal_the_stream_loop(name):
    """suffix / sink_recent (closed form, O(T)) and random (a heap of priorities, O(T log k)) take
    their eviction steps without the per-step loop; the generic loop, step by step, agrees for every
    context length, budget, chunk, number of sinks and seed tried."""
    from truncsens.policies.streaming import ChunkStats, run_stream

    checked = 0
    for n_sink in ([0, 1, 3] if name == "sink_recent" else [0]):
        policy = make_policy(name, n_sink=n_sink)
        for T in (1, 2, 3, 5, 9, 17, 30):
            for k in range(policy.min_budget(), T + 1):
                for chunk in (1, 2, 3, 7):
                    seeds = [0, 1, 2 + T + 100 * k]
                    loop = run_stream(policy, k, T, chunk, seeds, lambda s, e, alive, offset: ChunkStats())
                    steps = policy.eviction_steps(k, T, chunk, seeds, "cpu")  # [B, T]
                    assert torch.equal(loop.evict, steps), (n_sink, T, k, chunk, loop.evict[0], steps[0])
                    checked += 1
    assert checked >= 268  # every (T, k, chunk) of one policy is 268 cases
    assert make_policy("random", per_query=True).eviction_steps(2, 5, 1, [0], "cpu") is None


def test_closed_form_eviction_steps_by_hand():
    # suffix, k = 3, chunk 1, T = 6: after token e the cache keeps e-2 .. e-1, so key j goes at step j + 3;
    # keys 3..5 are never evicted before the query (prompt ends at T - 1 = 5: key 2 at 5, keys 3.. stay)
    assert make_policy("suffix").eviction_steps(3, 6, 1, [0], "cpu").tolist() == [[3, 4, 5, 6, 6, 6]]
    # sink_recent with 1 sink, k = 3, chunk 2, T = 8: sink never goes; key j >= 1 is due at j + 2, at the
    # next multiple of 2 below 7, else at 7 (the prompt's end); keys due after 7 stay
    assert make_policy("sink_recent", n_sink=1).eviction_steps(3, 8, 2, [0, 1], "cpu").tolist() == [[8, 4, 4, 6, 6, 7, 8, 8]] * 2
