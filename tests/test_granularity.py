"""Head granularity: one kept set per key/value head, shared by all layers.

The engine (policies on folded (sequence, KV head) rows, [B, H, Tq, Tk] masks, per-KV-head
statistics) equals caches that evict per head, written independently in ``oracles`` (explicit
per-query-head masks, statistics computed by the oracle), to 1e-5, for every policy under
``streaming`` and ``prefill_evict`` on a tiny GQA Llama (4 query heads, 2 key/value heads); the same
eviction step for every key and head. Policies whose decisions are the same on every head give the
token-granularity answer; kept sets stay nested in time per head; hand-computed masks, seeds,
counts and evicted mass; bad input refused.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from oracles import head_evicting_loop, head_prefill_evict, head_prefill_evict_surgery, head_statistics
from truncsens.divergences import kl
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.granularity import evicted_mass, kept_count
from truncsens.engine.attention_windows import LayerWindows, kept_attention_mask
from truncsens.engine.semantics import SEMANTICS
from truncsens.models import load_model
from truncsens.policies import POLICIES, PolicyError, make_policy
from truncsens.policies.base import fold_heads, head_seeds, unfold_heads
from truncsens.policies.streaming import Evictions

SEEDS = [5, 6]


def supported(name: str, semantics: str) -> bool:
    try:
        SEMANTICS[semantics].check_policy(make_policy(name, n_sink=2))
    except PolicyError:
        return False
    return True


# merging caches take --granularity token only (refused by name: test_merge_policies.py)
STREAMING = [p for p in POLICIES if supported(p, "streaming") and not POLICIES[p].merges]
# snapkv keeps its own set per layer and key/value head (--granularity head is refused for it: test_snapkv.py)
PREFILL = [p for p in POLICIES if supported(p, "prefill_evict") and not POLICIES[p].layer_heads
           and not POLICIES[p].merges]


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    m = load_model(tiny_llama_dir).model
    assert (m.config.num_attention_heads, m.config.num_key_value_heads) == (4, 2)  # GQA: groups of 2
    return m


def random_ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


def assert_same(fast: torch.Tensor, slow: torch.Tensor) -> None:
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.exp(), slow.exp(), atol=1e-5, rtol=0)


def test_head_seeds_are_per_row_and_independent_of_the_batch():
    """Row b·Hkv + h of sequence seed s: BLAKE2b("s:kv_head:h") below 2^63; a sequence's rows do not
    depend on the other sequences of the batch; heads differ."""
    rows = head_seeds([5, 6], 2)
    expected = int.from_bytes(hashlib.blake2b(b"6:kv_head:1", digest_size=8).digest(), "big") % 2**63
    assert rows[3] == expected
    assert rows[2:] == head_seeds([6], 2) and len(set(rows)) == 4
    x = torch.arange(12).view(2, 3, 2)  # [B=2, Hkv=3, 2]
    assert fold_heads(x)[4].tolist() == [8, 9]  # row b·Hkv + h = 1·3 + 1
    assert torch.equal(unfold_heads(fold_heads(x), 3), x)


def test_kept_attention_mask_with_a_heads_dim():
    """keep [1, Hkv=2, 1, 3], groups 2 -> [1, 4, 1, 3]: query heads 0, 1 read KV head 0; 2, 3 read KV head 1."""
    keep = torch.tensor([[[[True, False, True]], [[False, True, True]]]])  # [1, 2, 1, 3]
    offset = torch.tensor([[[[0.5, 0.0, 0.0]], [[0.0, 0.25, 0.0]]]])
    mask = kept_attention_mask(LayerWindows((None,), ("full_attention",)), keep, offset,
                               torch.tensor([[2]]), torch.tensor([[0, 1, 2]]), torch.float32, groups=2)
    inf = torch.finfo(torch.float32).min  # the masked value (not -inf: a row of -inf gives NaN)
    assert mask.shape == (1, 4, 1, 3)
    assert mask[0, :, 0].tolist() == [[0.5, inf, 0.0], [0.5, inf, 0.0], [inf, 0.25, 0.0], [inf, 0.25, 0.0]]
    # a sliding window of 2 on positions is applied per head too: key 0 is out of query 2's window
    windowed = kept_attention_mask(LayerWindows((2,), ("sliding_attention",)), keep, None,
                                   torch.tensor([[2]]), torch.tensor([[0, 1, 2]]), torch.float32, groups=1)
    assert windowed[0, :, 0].tolist() == [[inf, inf, 0.0], [inf, 0.0, 0.0]]


def test_kept_count_and_evicted_mass_per_head():
    """Per head: kept 2 and 3 keys -> mean 2.5; lost mass (0.5 + 0.2) and 0.1 -> mean 0.4."""
    keep = torch.tensor([[[False, False, True, True], [True, False, True, True]]])  # [1, 2, 4]
    att = torch.tensor([[[0.5, 0.2, 0.2, 0.1], [0.3, 0.1, 0.4, 0.2]]])  # [1, 2, 4]
    assert kept_count(keep).tolist() == [2.5]
    assert evicted_mass(att, keep).tolist() == pytest.approx([0.4])
    assert evicted_mass(att[:, 0], keep[:, 0]).tolist() == pytest.approx([0.7])  # token granularity


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("name", STREAMING)
def test_streaming_heads_equal_a_per_head_evicting_cache(model, name, chunk):
    """Every streaming policy at head granularity: the same eviction step for every (key, head) as the
    oracle's per-head cache, and the same output to 1e-5; kept sets nested in time in every head."""
    T, k = 24, 7
    ids = random_ids(model.config.vocab_size, 2, T, seed=1)
    policy = make_policy(name, n_sink=2)
    fast, ev = SEMANTICS["streaming"].stream(model, ids, policy, k, SEEDS, chunk, "head")
    slow, evict = head_evicting_loop(model, ids, policy, k, head_seeds(SEEDS, 2), chunk)
    assert ev.evict.shape == (2, 2, T)
    assert torch.equal(ev.evict, evict), "the engine and the per-head cache evicted different keys"
    assert_same(fast, slow)
    kept = ev.kept().keep  # [B, Hkv, T, T]
    q = torch.arange(T)
    earlier = q.view(1, T) < q.view(T, 1)  # [T, T] j < q
    later_reads = kept[..., 1:, :] & earlier[:-1].unsqueeze(0).unsqueeze(0)  # read by q + 1, j < q
    assert not bool((later_reads & ~kept[..., :-1, :]).any()), "a key came back after its eviction"
    if not policy.expected_budget:  # (poisson holds k in expectation)
        assert bool((ev.last().sum(-1) == k).all())  # the target's query reads k keys in every head
    full = SEMANTICS["streaming"].reference(model, ids, [policy], "head").logprobs
    assert kl(full, fast).min() > 1e-5  # eviction changed the output: the test can fail


@pytest.mark.parametrize("name", ["random", "key_norm", "h2o"])
def test_heads_decide_differently(model, name):
    """Per-head draws and per-head scores give different kept sets on the two KV heads (else the
    head tests could not tell head from token granularity)."""
    ids = random_ids(model.config.vocab_size, 2, 24, seed=1)
    _, ev = SEMANTICS["streaming"].stream(model, ids, make_policy(name, n_sink=2), 7, SEEDS, 1, "head")
    assert not torch.equal(ev.evict[:, 0], ev.evict[:, 1])


def _head_scores(policy, att: torch.Tensor, norms: torch.Tensor, T: int) -> torch.Tensor | None:
    """[B·Hkv, 1, T] scores of the target's query from the oracle's per-head statistics, as each
    policy defines them (accumulated attention, the previous query's row, SnapKV's window, key norm)."""
    kind = policy.score_kind()
    att, norms = att.flatten(0, 1), norms.flatten(0, 1)  # [B·Hkv, T, T], [B·Hkv, T]
    if kind is None:
        return None
    if kind == "attention":
        return att.sum(1, keepdim=True)  # every query row 0..T-1 accumulated
    if kind == "last_attention":
        return att[:, T - 2 : T - 1, :]
    if kind == "window_attention":
        return policy.window_scores(att, torch.tensor([T - 1]))
    return norms.unsqueeze(1)


@pytest.mark.parametrize("name", PREFILL)
def test_prefill_evict_heads_equal_a_per_head_masked_decode(model, name):
    """Every prefill_evict policy at head granularity: kept sets from per-head full-prefill statistics
    computed by the oracle equal the engine's, and the decode with a per-query-head mask equals it;
    so does per-head cache surgery (each KV head's cache holding only its kept keys), which checks
    that query head i reads KV head i // G without assuming it."""
    T, k = 24, 8
    ids = random_ids(model.config.vocab_size, 2, T, seed=2)
    policy = make_policy(name, n_sink=2, window=3)
    sem = SEMANTICS["prefill_evict"]
    ref = sem.reference(model, ids, [policy], "head")
    fast, keep_last = sem.policy_logprobs(model, ids, policy, k, SEEDS, ref, "original", 1, "head")
    att, norms = head_statistics(model, ids)
    kept = policy.keep(T, k, torch.tensor([T - 1]), head_seeds(SEEDS, 2), _head_scores(policy, att, norms, T))
    oracle_keep = kept.keep[:, -1].view(2, 2, T)  # [B, Hkv, T]
    assert torch.equal(keep_last, oracle_keep)
    slow = head_prefill_evict(model, ids, oracle_keep, kept.offset[:, -1].view(2, 2, T))
    assert_same(fast, slow)
    if name != "poisson":  # the same count in every head: per-head cache surgery, no query-head mapping assumed
        assert_same(fast, head_prefill_evict_surgery(model, ids, oracle_keep))
    assert kl(ref.logprobs, fast).min() > 1e-5


@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict"])
@pytest.mark.parametrize("name", ["suffix", "sink_recent"])
def test_identical_head_decisions_equal_token_granularity(model, semantics, name):
    """Policies that read no scores keep the same set on every head: head granularity gives the
    token-granularity kept set on each head and the same output."""
    ids = random_ids(model.config.vocab_size, 2, 20, seed=3)
    policy = make_policy(name, n_sink=2)
    sem = SEMANTICS[semantics]
    out = {}
    for g in ("token", "head"):
        ref = sem.reference(model, ids, [policy], g)
        out[g] = sem.policy_logprobs(model, ids, policy, 6, SEEDS, ref, "original", 1, g)
    assert torch.equal(out["head"][1], out["token"][1].unsqueeze(1).expand(2, 2, 20))
    torch.testing.assert_close(out["head"][0], out["token"][0], atol=1e-6, rtol=0)


def test_evictions_per_head_kept_sets():
    """evict [1, 2, 4] -> kept [1, 2, 4, 4]: head 0 evicts key 0 at step 2, head 1 never."""
    ev = Evictions(torch.tensor([[[2, 4, 4, 4], [4, 4, 4, 4]]]), torch.zeros(1, 2, 4))
    keep = ev.kept().keep
    assert keep[0, 0, :, 0].tolist() == [True, True, False, False]
    assert keep[0, 1, :, 0].tolist() == [True, True, True, True]
    assert ev.last().tolist() == [[[False, True, True, True], [True, True, True, True]]]


def test_granularity_config():
    """Unknown granularity, head under reencode (policies or windows): one clear error each; the
    default keeps the fingerprint of runs from before the option; head is part of it."""
    with pytest.raises(MeasureError, match=r"^granularity \(--granularity\) must be token or head, got 'x'$"):
        MeasureConfig(policies=["suffix"], granularity="x")
    with pytest.raises(MeasureError, match=r"granularity='head' \(--granularity head\) needs a per-head cache; semantics reencode"):
        MeasureConfig(policies=["suffix"], semantics="reencode", granularity="head")
    with pytest.raises(MeasureError, match=r"granularity=\'head\' \(--granularity head\) needs --policy NAME"):
        MeasureConfig(granularity="head")
    assert "granularity" not in MeasureConfig(policies=["suffix"]).fingerprint()
    assert MeasureConfig(policies=["suffix"], granularity="head").fingerprint()["granularity"] == "head"


def test_measure_records_granularity(tiny_llama_dir, corpus_dir, tmp_path):
    """A head-granularity run end to end: the attr is recorded, the target's query keeps k keys per
    head, and the evicted attention mass lies in [0, 1]."""
    from truncsens import results
    from truncsens.engine.measure import run_measure

    for g in ("token", "head"):
        cfg = MeasureConfig(model=tiny_llama_dir, corpus=corpus_dir, policies=["key_norm"], budgets=[8],
                            semantics="prefill_evict", reference_context=24, targets_per_doc=2, max_docs=2,
                            out=str(tmp_path / f"{g}.nc"), progress=False, granularity=g)
        run_measure(cfg)
    head, token = results.load(tmp_path / "head.nc"), results.load(tmp_path / "token.nc")
    assert head.attrs["granularity"] == "head" and token.attrs["granularity"] == "token"
    np.testing.assert_array_equal(head["kept_tokens"].values, 8)
    mass = head["evicted_attention_mass"].values
    assert bool(((mass >= 0) & (mass <= 1)).all()) and mass.min() > 0  # 8 of 24 keys kept: some mass is lost
    assert np.abs(head["kl"].values - token["kl"].values).max() > 1e-6  # per-head key norms changed the choice


@pytest.mark.parametrize("name", ["h2o", "key_norm"])
def test_streaming_heads_tiny_gpt2(tiny_gpt2_dir, name):
    """No grouped-query attention (Hkv = H = 4, fused qkv, modules named ``attn``): the same equality."""
    model = load_model(tiny_gpt2_dir).model
    ids = random_ids(model.config.vocab_size, 2, 20, seed=4)
    policy = make_policy(name)
    fast, ev = SEMANTICS["streaming"].stream(model, ids, policy, 6, SEEDS, 1, "head")
    slow, evict = head_evicting_loop(model, ids, policy, 6, head_seeds(SEEDS, 4), 1)
    assert ev.evict.shape == (2, 4, 20) and torch.equal(ev.evict, evict)
    assert_same(fast, slow)


def test_evictions_last_rows_are_the_last_rows_of_kept():
    """Evictions.last_rows(n): the kept keys of the last n queries, by hand and equal to kept()'s rows."""
    from truncsens.policies.streaming import Evictions

    evict = torch.tensor([[2, 5, 5, 4, 5]])  # key 0 read by queries 0..1, key 3 by query 3 only
    ev = Evictions(evict, torch.zeros(1, 5))
    rows = ev.last_rows(2)  # queries 3 and 4
    assert rows.tolist() == [[[False, True, True, True, False], [False, True, True, False, True]]]
    assert torch.equal(rows, ev.kept().keep[:, -2:]) and torch.equal(ev.last_rows(1)[:, 0], ev.last())
    per_head = Evictions(torch.stack([evict, evict.flip(-1).clamp(min=1)], 1), torch.zeros(1, 2, 5))  # [1, 2, 5]
    assert torch.equal(per_head.last_rows(3), per_head.kept().keep[..., -3:, :])
