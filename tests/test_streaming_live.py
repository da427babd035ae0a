"""Streaming decisions held per live slot (:mod:`truncsens.policies.live_stream`) equal the driver over
every position: the same eviction steps and offsets, exactly, and the same log-probabilities.

The engine's sequential run (:func:`truncsens.engine.streaming_pass.stream_online`) is held to its
earlier version, which decided over all positions (tests/stream_online_reference.py); the driver alone
is held to :func:`truncsens.policies.streaming.run_stream` on a synthetic source, with compaction at
every step and rows of a sequence that cache different keys (dead slots in the policy's view).
"""

from __future__ import annotations

import pytest
import torch

from stream_online_reference import reference_stream_online
from test_policy_contract import synthetic_observe
from truncsens.engine.semantics import windows_of
from truncsens.engine.streaming_pass import stream_online
from truncsens.models import load_model
from truncsens.policies import PolicyError, make_policy
from truncsens.policies.base import StreamStep, head_seeds
from truncsens.policies.live_stream import run_live_stream
from truncsens.policies.streaming import ChunkStats, run_stream

ONLINE = ("h2o", "tova", "key_norm", "poisson", "topk")  # the policies that stream with online scores
LOOPED = ONLINE + ("random", "suffix", "sink_recent")  # every policy the driver can run


def random_ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


@pytest.mark.parametrize("granularity", ["token", "head"])
@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("name", ONLINE)
def test_live_slots_equal_the_driver_over_every_position(tiny_llama_dir, name, chunk, granularity):
    """Tiny Llama (GQA: 4 query heads, 2 key/value heads, so head granularity has B·2 rows), T = 40,
    k = 8, three sequences, two seed sets, compaction by default and at every chunk (slack 0)."""
    model = load_model(tiny_llama_dir).model
    windows = windows_of(model, "streaming")
    heads = 2 if granularity == "head" else None
    policy = make_policy(name, n_sink=2)
    evicted = 0
    for seeds, slack in (([1, 2, 3], 32), ([7, 8, 9], 0)):
        ids = random_ids(model.config.vocab_size, 3, 40, seed=seeds[0])
        rows = head_seeds(seeds, heads) if heads else seeds
        new_lp, new = stream_online(model, ids, policy, 8, rows, chunk, windows, slack=slack, heads=heads, groups=2)
        old_lp, old = reference_stream_online(model, ids, policy, 8, rows, chunk, windows, slack=slack, heads=heads,
                                              groups=2)
        assert torch.equal(new.evict, old.evict)
        assert torch.equal(new.offset, old.offset)
        torch.testing.assert_close(new_lp, old_lp, atol=1e-6, rtol=0)
        evicted += int((new.evict < 40).sum())
    assert evicted > 0  # decisions were taken: the equality is not vacuous
    if name == "poisson":
        assert bool((new.offset != 0).any())  # Hájek offsets took part


def test_block_rows_equal_the_reference(tiny_llama_dir):
    """The block protocol's rows (``keep`` > 1: log-probabilities after each of the last tokens) too."""
    model = load_model(tiny_llama_dir).model
    ids = random_ids(model.config.vocab_size, 2, 30, seed=4)
    args = (model, ids, make_policy("h2o"), 8, [4, 5], 1, windows_of(model, "streaming"))
    new_lp, new = stream_online(*args, keep=5)
    old_lp, old = reference_stream_online(*args, keep=5)
    assert new_lp.shape == (2, 5, model.config.vocab_size)
    assert torch.equal(new.evict, old.evict)
    torch.testing.assert_close(new_lp, old_lp, atol=1e-6, rtol=0)


def live_observe(source, heads: int):
    """The live driver's observe from a per-position ``source`` (as run_stream's): the source's
    attention over positions 0..e-1 read at each slot's position."""

    def observe(s, e, chunk):
        R = chunk.alive.shape[0]
        positions = chunk.positions.repeat_interleave(heads, 0)  # [R, L + c]
        alive = torch.zeros(R, e, dtype=torch.bool).scatter_(1, positions, chunk.alive)  # [R, e] by position
        offset = torch.zeros(R, e).scatter_(1, positions, chunk.offset)
        stats = source(s, e, alive, offset)
        att = None
        if stats.attention is not None:
            att = stats.attention.gather(2, positions.unsqueeze(1).expand(R, e - s, -1))  # [R, c, L + c]
        return ChunkStats(attention=att, key_norm=stats.key_norm)

    return observe


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("name", LOOPED)
def test_live_driver_equals_run_stream_on_a_synthetic_source(name, chunk, heads):
    """T = 60, k = 8, rows of 2 (sequence, head) pairs sharing slots when ``heads`` = 2; slack 0 and
    32. The live driver asks the policy over a compacted view (positions given, dead slots among
    them), run_stream over every position: equal steps and offsets."""
    policy = make_policy(name, n_sink=2)
    seeds = [3, 4, 5, 6]
    ref = run_stream(policy, 8, 60, chunk, seeds, synthetic_observe(11, len(seeds)))
    widths = []

    class Recorder(type(policy)):
        def evict(self, view):
            widths.append((view.alive.shape[1], view.positions is not None))
            return super().evict(view)

    for slack in (0, 32):
        widths.clear()
        recorder = Recorder(**policy.__dict__)
        live = run_live_stream(recorder, 8, 60, chunk, seeds, live_observe(synthetic_observe(11, len(seeds)), heads),
                               heads=heads, slack=slack)
        assert torch.equal(live.evict, ref.evict)
        assert torch.equal(live.offset, ref.offset)
        assert all(given for _, given in widths)
    assert int((ref.evict < 60).sum()) > 0


@pytest.mark.parametrize("name", ["h2o", "tova", "key_norm", "poisson"])
def test_the_engine_decides_over_the_live_slots_only(tiny_llama_dir, name):
    """T = 120, k = 8, chunk 1, slack 0: every view the policy gets is compacted (positions given) and
    at most 2·(k - 1) + C columns wide for a hard budget, however long the context (the driver over
    every position gave e columns, up to 119); poisson, whose budget holds in expectation, keeps its
    tail to a few more."""
    model = load_model(tiny_llama_dir).model
    ids = random_ids(model.config.vocab_size, 2, 120, seed=6)
    widths = []

    class Recorder(type(make_policy(name))):
        def evict(self, view):
            widths.append((view.alive.shape[1], view.positions is not None, int(view.alive.sum(-1).max())))
            return super().evict(view)

    stream_online(model, ids, Recorder(), 8, [1, 2], 1, windows_of(model, "streaming"), slack=0)
    assert len(widths) == 119 and all(given for _, given, _ in widths)
    most = max(live for _, _, live in widths)
    assert max(width for width, _, _ in widths) <= 2 * most + 1
    if name != "poisson":
        assert most <= 8  # k - 1 cached keys and the chunk's one
    assert most < 30


class _Broken:
    """A streaming policy that breaks one rule at its second step (``rule``)."""

    name = "broken"
    expected_budget = False

    def __init__(self, rule: str):
        self.rule, self.calls = rule, 0
        self.expected_budget = rule == "pi"

    def check(self, budget, context_len):
        pass

    def score_kind(self):
        return None

    def evict(self, view):
        self.calls += 1
        keep, offset, drawn = view.alive.clone(), view.offset.clone(), view.drawn.clone()
        pi = view.inclusion().clone()
        oldest = view.columns().masked_fill(~view.alive, 10**9).argmin(-1, keepdim=True)  # [B, 1]
        if self.calls == 1:  # evict the oldest key, draw the rest with pi 1/2 (offset log 2)
            keep.scatter_(1, oldest, False)
            drawn = keep.clone()
            pi = torch.where(keep, 0.5, 1.0).double()
            offset = torch.where(keep, torch.log(torch.tensor(2.0)), torch.tensor(0.0))
        elif self.rule == "readmit":
            keep = torch.ones_like(keep)
        elif self.rule == "offset":
            offset = offset + 1
        elif self.rule == "pi":
            pi = torch.where(keep, 0.75, 1.0).double()
            offset = torch.where(keep, -torch.log(pi), torch.zeros_like(pi)).float()
        return StreamStep(keep, offset, drawn, pi if self.expected_budget else None)


@pytest.mark.parametrize("rule,message", [
    ("readmit", "kept a key it had evicted"),
    ("offset", "changed the offset of a key drawn earlier"),
    ("pi", "raised the inclusion probability of a key drawn earlier"),
])
def test_live_driver_refuses_what_no_cache_could_do(rule, message):
    observe = lambda s, e, chunk: ChunkStats()  # noqa: E731
    with pytest.raises(PolicyError, match=message):
        run_live_stream(_Broken(rule), 4, 12, 2, [0, 1], observe)
    with pytest.raises(PolicyError, match=r"kept more than budget - 1 = 1 keys"):
        run_live_stream(_Broken("none"), 2, 12, 2, [0], observe)


def test_live_driver_refuses_heads_that_do_not_divide_the_rows():
    with pytest.raises(PolicyError, match="heads=2"):
        run_live_stream(make_policy("h2o"), 4, 12, 1, [0, 1, 2], lambda s, e, chunk: ChunkStats(), heads=2)
