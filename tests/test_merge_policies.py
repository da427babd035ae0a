"""Merging policies (``merge_mean``, ``merge_nearest``): the engine's merging cache equals a naive
k-slot loop that rebuilds the cache from lists of merged tokens at every step (tests/oracles.py),
under every semantics that accepts them; ``reencode`` refuses them by name."""

from __future__ import annotations

import pytest
import torch

from oracles import merging_loop
from truncsens.engine.semantics import SEMANTICS
from truncsens.models import load_model
from truncsens.policies import PolicyError, make_policy
from truncsens.policies.merging import MergeView

T = 28
RULES = {"merge_mean": "mean", "merge_nearest": "nearest"}


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir).model


@pytest.fixture(scope="module")
def ids(model):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, model.config.vocab_size, (3, T), generator=g)  # [B, T]


def engine(model, ids, policy, budget, semantics, chunk=1):
    sem = SEMANTICS[semantics]
    ref = sem.reference(model, ids, [policy])
    return sem.policy_logprobs(model, ids, policy, budget, [0, 1, 2], ref, "original", chunk)


CASES = [("merge_mean", {}, 8, 1), ("merge_mean", {"n_summary": 3}, 10, 1), ("merge_mean", {"n_summary": 2}, 9, 3),
         ("merge_nearest", {}, 8, 1), ("merge_nearest", {}, 7, 4), ("merge_mean", {}, 5, 1)]


@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict"])
@pytest.mark.parametrize("name,params,budget,chunk", CASES)
def test_merging_cache_equals_naive_loop(model, ids, semantics, name, params, budget, chunk):
    policy = make_policy(name, n_sink=2, **params)
    lp, read = engine(model, ids, policy, budget, semantics, chunk)
    want = merging_loop(model, ids, RULES[name], budget, 2, params.get("n_summary", 1), chunk, semantics)
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)  # log-probabilities (float32 logits)
    torch.testing.assert_close(lp.exp(), want.exp(), atol=1e-5, rtol=0)
    # the sinks and the query's own token are read unmerged; at most k slots in all
    assert read[:, :2].all() and read[:, -1].all() and int(read.sum(1).max()) <= budget
    # merging changes the answer: it is neither the full context nor sink_recent at the same budget
    full = SEMANTICS[semantics].reference(model, ids, [policy]).logprobs
    sr, _ = engine(model, ids, make_policy("sink_recent", n_sink=2), budget, semantics, chunk)
    assert (lp - full).abs().max() > 1e-3 and (lp - sr).abs().max() > 1e-3


@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict"])
@pytest.mark.parametrize("name", list(RULES))
def test_a_budget_covering_the_context_merges_nothing(model, ids, semantics, name):
    policy = make_policy(name, n_sink=2)
    lp, read = engine(model, ids, policy, T, semantics)
    full = SEMANTICS[semantics].reference(model, ids, [policy]).logprobs
    torch.testing.assert_close(lp, full, atol=2e-5, rtol=0)
    assert read.all()


def test_reencode_refuses_merging_policies_by_name():
    for name in RULES:
        with pytest.raises(PolicyError, match=f"policy {name} cannot be run with semantics reencode: it needs a cache "
                                              "whose slots' keys and values are replaced by merges.*use --semantics "
                                              "streaming or prefill_evict"):
            SEMANTICS["reencode"].check_policy(make_policy(name))
        with pytest.raises(PolicyError, match=f"policy {name} merges .* no kept set"):
            make_policy(name).keep(T, 8, torch.tensor([T - 1]), [0])


def test_head_granularity_and_reindexed_positions_are_refused(model, ids):
    policy = make_policy("merge_mean", n_sink=2)
    sem = SEMANTICS["prefill_evict"]
    ref = sem.reference(model, ids, [policy])
    with pytest.raises(PolicyError, match="policy merge_mean merges slots at their original positions"):
        sem.policy_logprobs(model, ids, policy, 8, [0, 1, 2], ref, "reindexed")
    with pytest.raises(PolicyError, match="use --positions original and --granularity token"):
        SEMANTICS["streaming"].policy_logprobs(model, ids, policy, 8, [0, 1, 2], None, "original", 1, "head")


def test_merge_mean_pairs_the_old_region_by_smallest_counts():
    """Sinks 0, 1; 2 summaries; budget 8 -> 7 slots: the 3 newest slots are protected, the old region
    (slots 2..6 here, counts 3, 1, 1, 1, 1) merges the pair of smallest total count, oldest first."""
    anchor = torch.tensor([[0, 1, -1, 5, 6, 7, 8, 9, 10, 11]])
    count = torch.tensor([[1, 1, 3, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    view = MergeView(anchor, count, 8, 12, lambda v: None)
    step = make_policy("merge_mean", n_sink=2, n_summary=2).merge(view)
    # 10 slots -> 7: (5, 6) merge first (total 2), then (7, 8) (total 2), then (5+6, 7+8) (total 4 < 3 + 2)
    assert step.dest.tolist() == [[0, 1, 2, 3, 3, 3, 3, 4, 5, 6]]
    assert step.anchor.tolist() == [[0, 1, -1, -1, 9, 10, 11]]


def test_merge_nearest_joins_the_most_similar_survivor():
    """The oldest non-sink slot (index 2) joins the non-sink survivor of highest similarity (index 4)."""
    anchor = torch.tensor([[0, 1, 2, 3, 4, 5]])
    sim = torch.tensor([[[0.9, 0.9, 1.0, 0.1, 0.5, 0.2]]])  # sinks are never joined, nor the victim itself
    view = MergeView(anchor, torch.ones(1, 6, dtype=torch.float64), 6, 6, lambda v: sim)
    step = make_policy("merge_nearest", n_sink=2).merge(view)
    assert step.dest.tolist() == [[0, 1, 3, 2, 3, 4]] and step.anchor.tolist() == [[0, 1, 3, 4, 5]]


def test_the_block_protocol_refuses_merging_policies_by_name():
    from truncsens.engine.block.plan import check_policy_blocks
    from truncsens.engine.errors import MeasureError

    with pytest.raises(MeasureError, match=r"merge_nearest merges evicted keys into kept slots; use protocol=.exact. \(--protocol exact\)"):
        check_policy_blocks("streaming", [make_policy("sink_recent"), make_policy("merge_nearest")], "original", "token", 1)


def test_summary_slots_configure_merge_mean_only():
    """``summary_slots`` (``--summary-slots``) sets merge_mean's m and no other policy's; given without
    merge_mean, or below 1, it is refused by its keyword and flag before any model loads."""
    from truncsens.api.measure import measure_config
    from truncsens.engine.errors import MeasureError

    cfg = measure_config("reference", policies="merge_mean,sink_recent", summary_slots=3, budgets=[16], reference_context=256)
    built = {p.name: p for p in cfg.build_policies()}
    assert built["merge_mean"].n_summary == 3 and built["merge_mean"].min_budget() == 4 + 3 + 1
    assert measure_config("reference", policies="merge_mean", budgets=[16], reference_context=256).build_policies()[0].n_summary == 1
    with pytest.raises(MeasureError, match=r"summary_slots \(--summary-slots\) sets merge_mean's summary slots; give --policy "
                                           r"merge_mean \(this run's policies: sink_recent\)"):
        measure_config("reference", policies="sink_recent", summary_slots=2, budgets=[16], reference_context=256)
    with pytest.raises(MeasureError, match=r"summary_slots \(--summary-slots\) must be >= 1, got 0"):
        measure_config("reference", policies="merge_mean", summary_slots=0, budgets=[16], reference_context=256)
