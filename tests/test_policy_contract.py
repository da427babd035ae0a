"""One contract over every registered policy and every semantics it supports.

Kept sets: causal, the query's own token kept, the budget respected (exactly for deterministic and
uniform policies, in expectation for poisson), the same seed giving the same draw, offsets only
where the policy declared it needs them. Engine: every (policy, semantics) pair runs end to end, and
at a budget covering the whole context nothing is evicted, so every metric equals the full-context
answer (KL = TV = 0 up to float32 noise).
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
from truncsens.policies.base import LOGIT_OFFSETS
from truncsens.targets import TargetSet

T, K = 24, 10
PAIRS = list(itertools.product(POLICIES, SEMANTICS))


def supported(policy_name: str, semantics_name: str) -> bool:
    try:
        SEMANTICS[semantics_name].check_policy(make_policy(policy_name, n_sink=2))
    except PolicyError:
        return False
    return True


RUNNABLE = [(p, s) for p, s in PAIRS if supported(p, s)]


def test_only_score_or_offset_policies_under_reencode_are_refused():
    needy = sorted(p for p in POLICIES if make_policy(p, n_sink=2).requirements())
    assert "poisson" in needy and "topk" in needy and "suffix" not in needy
    assert sorted(set(PAIRS) - set(RUNNABLE)) == [(p, "reencode") for p in needy]


def kept_sets(policy_name: str, semantics_name: str, seeds: list[int]):
    policy = make_policy(policy_name, n_sink=2)
    queries = SEMANTICS[semantics_name].queries(T, "cpu")  # [Q]
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(len(seeds), queries.numel(), T, generator=g) + 0.01 if policy.needs_scores else None
    return policy, queries, policy.keep(T, K, queries, seeds, scores)


@pytest.mark.parametrize("policy_name,semantics_name", RUNNABLE)
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
