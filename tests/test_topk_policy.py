"""The deterministic ``topk`` policy: its kept set by hand, the same budget split as poisson, and
Theorem 1 of arXiv 2607.21475 (the kept state cannot tell the error of deterministic eviction)."""

from __future__ import annotations

import torch

from truncsens.certificates.estimator import attention_records
from truncsens.certificates.passes import design_of
from truncsens.policies import make_policy


def test_topk_keeps_sinks_recent_and_the_top_scores():
    T, k = 10, 6
    scores = torch.tensor([[[9.0, 0.1, 5.0, 0.2, 4.0, 0.3, 3.0, 7.0, 0.4, 0.5]]])  # [1, 1, T]
    kept = make_policy("topk", n_sink=1).keep(T, k, torch.tensor([T - 1]), [0], scores)
    # sink 0, recent R = max(1, int(0.25 * 6)) = 1 (the query 9), then the 4 best of keys 1..8: 7, 2, 4, 6
    assert kept.keep[0, 0].nonzero().flatten().tolist() == [0, 2, 4, 6, 7, 9]
    assert not kept.has_offsets()
    early = make_policy("topk", n_sink=1).keep(T, k, torch.tensor([3]), [0], scores)  # q + 1 <= k: everything
    assert early.keep[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_topk_certain_set_is_poissons():
    T, k = 40, 16
    scores = torch.rand(1, 1, T, generator=torch.Generator().manual_seed(0)) + 0.01
    q = torch.tensor([T - 1])
    pi, tail = make_policy("poisson", n_sink=4).design(k, q, scores)
    topk = make_policy("topk", n_sink=4).keep(T, k, q, [0], scores).keep
    certain = (pi >= 1) & ~tail
    assert bool((topk & certain).eq(certain).all())  # topk keeps every key poisson keeps surely
    assert int(topk.sum()) == k and int(certain.sum()) < k


def test_theorem_1_identical_kept_state_different_true_error():
    T, d, k = 48, 8, 12
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(T, generator=g, dtype=torch.float64)
    values = torch.randn(T, d, generator=g, dtype=torch.float64)
    scores = torch.rand(1, T, generator=g) + 0.01  # [B=1, T]
    kept, pi, tail = design_of(make_policy("topk", n_sink=2), T, k, [0], scores)
    kept, pi, tail = kept[0], pi[0], tail[0]
    moved = values.clone()
    moved[~kept] += 25.0  # other evicted values; kept keys, values and scores unchanged
    kept2, pi2, tail2 = design_of(make_policy("topk", n_sink=2), T, k, [0], scores)
    assert torch.equal(kept2[0], kept) and not tail.any()
    everything = torch.ones(T, dtype=torch.bool)
    a = attention_records(logits, values, everything, kept, pi, tail)
    b = attention_records(logits, moved, everything, kept2[0], pi2[0], tail2[0])
    for name in ("o_hat", "variance", "radius_eb", "radius_normal"):  # every statistic of the kept state
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert float(a.radius_eb) == 0.0  # the kept state "certifies" no error at all
    assert float(b.error) > 10 * float(a.error) and float(b.error) > 1.0  # the true errors differ
