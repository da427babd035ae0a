"""Realizable streaming with online scores (decisions a server could take, from what it has seen).

The engine (offline decisions + one masked forward, or a sequential run with online scores) equals a
real cache that evicts as it goes (``oracles.evicting_loop``: physical eviction, statistics computed
by the oracle itself), to 1e-5, with the same eviction step for every key; chunk 1 is the exact
token-by-token loop, chunk C > 1 the chunked loop. Hand-computed eviction steps; policies that are
not realizable or not online are refused.
"""

from __future__ import annotations

import pytest
import torch

from conftest import requires_reference
from oracles import evicting_loop
from truncsens.divergences import kl
from truncsens.engine.forward import next_token_logprobs
from truncsens.engine.semantics import SEMANTICS
from truncsens.models import load_model
from truncsens.policies import POLICIES, PolicyError, make_policy
from truncsens.policies.base import StreamView
from truncsens.policies.steps import chunk_bounds
from truncsens.policies.streaming import ChunkStats, run_stream



def _streamable(name: str) -> bool:
    try:
        SEMANTICS["streaming"].check_policy(make_policy(name))
    except PolicyError:
        return False
    return True


# every registered policy a streaming cache can run by evicting (merging caches: tests/test_merge_policies.py)
ONLINE = tuple(n for n in POLICIES if _streamable(n) and not POLICIES[n].merges)


def random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


def assert_same(fast: torch.Tensor, slow: torch.Tensor) -> None:
    """[B, V] log-probabilities agree to 1e-5 (absolute + 1e-5 relative; probabilities absolute)."""
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.exp(), slow.exp(), atol=1e-5, rtol=0)


def check_against_loop(model, T: int, budget: int, name: str, chunk: int, seed: int) -> None:
    ids = random_ids(model.config.vocab_size, 2, T, seed=seed)
    policy = make_policy(name, n_sink=2)
    fast, ev = SEMANTICS["streaming"].stream(model, ids, policy, budget, [5, 6], chunk)
    slow, evict = evicting_loop(model, ids, policy, budget, [5, 6], chunk)
    assert torch.equal(ev.evict, evict), "the engine and the real cache evicted different keys"
    assert_same(fast, slow)
    full = next_token_logprobs(model, ids, torch.arange(T).expand(2, T))
    assert kl(full, fast).min() > 1e-5  # eviction changed the output: the test can fail
    if name == "poisson":
        assert bool((ev.offset != 0).any())  # Hájek offsets took part


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("name", ONLINE)
def test_streaming_equals_evicting_cache_tiny_llama(tiny_llama_dir, name, chunk):
    check_against_loop(load_model(tiny_llama_dir).model, T=30, budget=8, name=name, chunk=chunk, seed=1)


@pytest.mark.parametrize("name", ["sink_recent", "poisson", "h2o", "tova", "key_norm"])
def test_streaming_equals_evicting_cache_tiny_gpt2(tiny_gpt2_dir, name):
    """Learned absolute positions, fused qkv, modules named ``attn``: the same equality."""
    check_against_loop(load_model(tiny_gpt2_dir).model, T=24, budget=7, name=name, chunk=1, seed=2)


@requires_reference
@pytest.mark.parametrize("name", ONLINE)
def test_streaming_equals_evicting_cache_reference(name):
    check_against_loop(load_model("reference").model, T=64, budget=16, name=name, chunk=1, seed=3)


def test_chunk_bounds_and_hand_computed_suffix_steps():
    """T = 10, chunk 4, suffix k = 3: prompt chunks [0,4) [4,8) [8,9), then the target's query 9.
    After [0,4): keep {2,3} (evict 0, 1 at 4); after [4,8): keep {6,7} (evict 2..5 at 8); after
    [8,9): keep {7,8} (evict 6 at 9); the target's query reads {7, 8, 9}."""
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 9), (9, 10)]
    assert chunk_bounds(5, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    ev = run_stream(make_policy("suffix"), 3, 10, 4, [0], lambda s, e, a, o: ChunkStats())
    assert ev.evict[0].tolist() == [4, 4, 8, 8, 8, 8, 9, 10, 10, 10]
    assert ev.last()[0].nonzero().flatten().tolist() == [7, 8, 9]
    # sink_recent, T = 20, k = 7, 3 sinks, chunk 1: the target's query reads the sinks and the last 4
    ev = run_stream(make_policy("sink_recent", n_sink=3), 7, 20, 1, [0], lambda s, e, a, o: ChunkStats())
    assert ev.last()[0].nonzero().flatten().tolist() == [0, 1, 2, 16, 17, 18, 19]
    # between queries the cache holds k - 1 = 6 keys: the 3 sinks and the 3 newest, so key 3 is last read by
    # query 6 (cache 0,1,2,4,5,6 after token 6 is processed): evict step 7; sinks are never evicted (T = 20)
    assert ev.evict[0, :8].tolist() == [20, 20, 20, 7, 8, 9, 10, 11]


def test_compaction_gathers_keys_and_values_by_their_own_widths():
    """gather_slots on a cache whose keys are 3 wide and values 2 wide (multi-head latent attention
    caches a latent and a rotary part of different widths): row 0 keeps slots [0, 2], row 1 [3, 1];
    entries are 10·slot + channel (keys) and 100 + 10·slot + channel (values), so the gathered rows
    are hand-readable. Before, the values were gathered with the keys' width and it raised."""
    from transformers import DynamicCache

    from truncsens.engine.kvcache import gather_slots, layer_kv

    slot = torch.arange(4.0).view(1, 1, 4, 1)
    keys = (10 * slot + torch.arange(3.0)).expand(2, 1, 4, 3)  # [B, 1, T, 3]
    values = (100 + 10 * slot + torch.arange(2.0)).expand(2, 1, 4, 2)  # [B, 1, T, 2]
    cache = DynamicCache()
    cache.update(keys.clone(), values.clone(), 0)
    gather_slots(cache, torch.tensor([[0, 2], [3, 1]]))
    k, v = layer_kv(cache, 0)
    assert k[:, 0].tolist() == [[[0, 1, 2], [20, 21, 22]], [[30, 31, 32], [10, 11, 12]]]
    assert v[:, 0].tolist() == [[[100, 101], [120, 121]], [[130, 131], [110, 111]]]


@pytest.mark.parametrize("name", ["suffix", "sink_recent", "random"])
def test_chunk_one_equals_the_per_query_kept_sets(name):
    """Token by token, the eviction steps give exactly the per-query kept sets of ``keep`` (random:
    the k - 1 earlier keys of lowest priority are what evicting the highest priority leaves)."""
    policy = make_policy(name, n_sink=3)
    T, k = 20, 7
    ev = run_stream(policy, k, T, 1, [8, 9], lambda s, e, a, o: ChunkStats())
    assert torch.equal(ev.kept().keep, policy.keep(T, k, torch.arange(T), [8, 9]).keep)


def view(alive, budget, **scores) -> StreamView:
    e = alive.shape[-1]
    return StreamView(alive, torch.zeros(1, e), torch.zeros(1, e, dtype=torch.bool), budget, e,
                      torch.zeros(1, e, dtype=torch.float64), **scores)


def test_one_eviction_step_by_hand():
    """k = 4 (3 keys stay cached), 6 keys cached:
    h2o (recent 2: the last key protected) keeps key 5 and the two heaviest of 0..4 by accumulated
    attention [.9, .1, .5, .3, .2] -> {0, 2, 5}; tova keeps the newest query's top 3 of
    [.1, .4, .05, .3, .1, .05] -> {1, 3, 4} (ties: the later); key_norm keeps the 3 smallest norms of
    [3, 1, 2, 5, 0.5, 4] -> {1, 2, 4}."""
    alive = torch.ones(1, 6, dtype=torch.bool)
    acc = torch.tensor([[0.9, 0.1, 0.5, 0.3, 0.2, 0.0]])
    h2o = make_policy("h2o").evict(view(alive, 4, accumulated=acc)).keep
    assert h2o[0].nonzero().flatten().tolist() == [0, 2, 5]
    last = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.1, 0.05]])
    assert make_policy("tova").evict(view(alive, 4, last=last)).keep[0].nonzero().flatten().tolist() == [1, 3, 4]
    norms = torch.tensor([[3.0, 1.0, 2.0, 5.0, 0.5, 4.0]])
    assert make_policy("key_norm").evict(view(alive, 4, key_norm=norms)).keep[0].nonzero().flatten().tolist() == [1, 2, 4]
    few = torch.tensor([[True, False, True, False, False, True]])  # 3 cached <= k - 1: nothing evicted
    assert torch.equal(make_policy("h2o").evict(view(few, 4, accumulated=acc)).keep, few)


def test_poisson_streaming_thins_its_tail_with_known_probabilities():
    """k = 8, 2 sinks: slices r = 2, t = 2, m = 2. Every step thins the tail to m keys in
    expectation: the inclusion probabilities of the tail sum to m after a step that thins, a kept
    key's pi never rises, and its offset is log(1/pi) at every step (run_stream refuses anything else)."""
    policy = make_policy("poisson", n_sink=2)
    assert policy.slices(8) == (2, 2, 2)
    g = torch.Generator().manual_seed(0)
    seen = []

    class Recorder(type(policy)):
        def evict(self, view):
            step = super().evict(view)
            seen.append((view.inclusion().clone(), view.drawn.clone(), step))
            return step

    def observe(s, e, alive, offset):
        w = torch.rand(2, e - s, e, generator=g)
        return ChunkStats(attention=w / w.sum(-1, keepdim=True))

    ev = run_stream(Recorder(n_sink=2), 8, 40, 1, [1, 2], observe)
    thinned = 0
    for before, drawn, step in seen:
        tail = step.drawn & step.keep  # kept tail keys
        assert bool((step.pi[step.keep & drawn] <= before[step.keep & drawn] + 1e-15).all())
        assert torch.allclose(step.offset[tail].double(), -torch.log(step.pi[tail]), atol=1e-6)
        if bool(tail.any()):
            thinned += 1
    assert thinned > 20
    tail_count = torch.stack([(st.drawn & st.keep).sum(-1) for _, _, st in seen[8:]]).float()  # [steps, B]
    assert abs(float(tail_count.mean()) - 2.0) < 0.4  # m = 2 kept tail keys on average
    assert bool((ev.offset >= 0).all())


def test_streaming_hybrid_window_model_sequential(tmp_path):
    """A hybrid model (full + sliding layers, window 5): the sequential run with online scores reads,
    in every layer, the kept keys within the layer's window: equal to the windowed token loop on the
    engine's own kept sets."""
    from oracles import windowed_streaming_loop
    from test_sliding_window import QWEN_TYPES, QWEN_WINDOWS, save_tiny

    model = load_model(save_tiny(tmp_path, "qwen2")).model
    T = 20
    ids = random_ids(model.config.vocab_size, 2, T, seed=5)
    for name in ("h2o", "key_norm"):
        lp, ev = SEMANTICS["streaming"].stream(model, ids, make_policy(name), 8, [0, 1], 1)
        kept = ev.kept()
        assert_same(lp, windowed_streaming_loop(model, ids, kept.keep, kept.offset, QWEN_TYPES, QWEN_WINDOWS))
        assert int((ev.evict < T).sum()) > 0


@pytest.mark.parametrize("name", ["h2o", "poisson"])
def test_compacted_cache_equals_evicting_cache(tiny_llama_dir, name):
    """Compaction at every chunk (slack 0; poisson rows cache different numbers of keys, so some rows
    keep dead slots): still the real evicting cache, to 1e-5 with the same eviction steps."""
    from truncsens.engine.semantics import windows_of
    from truncsens.engine.streaming_pass import stream_online

    model = load_model(tiny_llama_dir).model
    ids = random_ids(model.config.vocab_size, 3, 30, seed=8)
    policy = make_policy(name, n_sink=2)
    for chunk in (1, 3):
        fast, ev = stream_online(model, ids, policy, 8, [1, 2, 3], chunk, windows_of(model, "streaming"), slack=0)
        slow, evict = evicting_loop(model, ids, policy, 8, [1, 2, 3], chunk)
        assert torch.equal(ev.evict, evict)
        assert_same(fast, slow)
    if name == "poisson":
        counts = ev.kept().keep.sum(-1)  # [B, T]
        assert bool((counts != counts[:1]).any())  # rows cache different numbers of keys: dead slots exercised
