"""Divergences against closed forms and scipy on small hand-made distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from scipy.stats import entropy

from truncsens import divergences as dv


def logp(*probs: float) -> torch.Tensor:
    """Log-probabilities [V] float64 of a hand-made distribution (log 0 = -inf)."""
    return torch.tensor(probs, dtype=torch.float64).log()


def test_two_point_closed_form():
    p, q = logp(0.5, 0.5), logp(0.9, 0.1)
    assert dv.tv(p, q).item() == pytest.approx(0.4, abs=1e-12)
    expected_kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108256...
    assert dv.kl(p, q).item() == pytest.approx(expected_kl, abs=1e-12)
    assert dv.kl(q, p).item() == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2), abs=1e-12)
    expected_js = 0.5 * (0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)) + 0.5 * (
        0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3))
    assert dv.js(p, q).item() == pytest.approx(expected_js, abs=1e-12)


def test_against_scipy_on_random_distributions():
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.ones(7), size=5)  # [5, 7]
    Q = rng.dirichlet(np.ones(7) * 0.5, size=5)
    lp, lq = torch.tensor(np.log(P)), torch.tensor(np.log(Q))
    np.testing.assert_allclose(dv.kl(lp, lq).numpy(), entropy(P, Q, axis=1), rtol=1e-10)
    np.testing.assert_allclose(dv.js(lp, lq).numpy(), jensenshannon(P, Q, axis=1) ** 2, rtol=1e-9)
    np.testing.assert_allclose(dv.tv(lp, lq).numpy(), 0.5 * np.abs(P - Q).sum(1), rtol=1e-12)


def test_disjoint_supports():
    p, q = logp(1.0, 0.0), logp(0.0, 1.0)
    assert dv.tv(p, q).item() == 1.0
    assert dv.kl(p, q).item() == math.inf
    assert dv.js(p, q).item() == pytest.approx(math.log(2.0), abs=1e-12)
    half = logp(0.5, 0.5, 0.0)
    other = logp(0.0, 0.5, 0.5)
    assert dv.tv(half, other).item() == pytest.approx(0.5)
    assert dv.js(half, other).item() == pytest.approx(0.5 * math.log(2.0), abs=1e-12)


def test_one_hot_cases():
    one = logp(0.0, 1.0, 0.0)
    assert dv.tv(one, one).item() == 0.0
    assert dv.kl(one, one).item() == 0.0
    assert dv.js(one, one).item() == 0.0
    u = logp(1 / 3, 1 / 3, 1 / 3)
    assert dv.kl(one, u).item() == pytest.approx(math.log(3.0), abs=1e-12)  # KL(delta || uniform) = log V
    assert dv.kl(u, one).item() == math.inf
    assert dv.tv(one, u).item() == pytest.approx(2 / 3, abs=1e-12)
    assert dv.top1_agree(one, logp(0.1, 0.8, 0.1)).item() == 1
    assert dv.top1_agree(one, logp(0.8, 0.1, 0.1)).item() == 0


def test_nll_and_batch_shapes():
    lp = torch.log(torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float32))  # [2, 2]
    assert dv.nll(lp, torch.tensor([1, 0])).tolist() == pytest.approx([-math.log(0.75), math.log(2.0)])
    assert dv.tv(lp, lp.flip(0)).shape == (2,)


def test_float16_is_refused_and_shapes_must_match():
    with pytest.raises(TypeError, match="float32"):
        dv.tv(torch.zeros(3, dtype=torch.float16), torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="shape"):
        dv.kl(torch.zeros(3), torch.zeros(4))


def test_clamp_rounding_counts_and_rejects_real_errors():
    c = dv.clamp_rounding(torch.tensor([-1e-7, 0.5, 1.0 + 1e-7, 0.2]), 0.0, 1.0)
    assert c.n_clamped == 2
    assert c.values.tolist() == pytest.approx([0.0, 0.5, 1.0, 0.2])
    with pytest.raises(ValueError, match="beyond rounding"):
        dv.clamp_rounding(torch.tensor([-0.5]), 0.0)
    with pytest.raises(ValueError, match="NaN"):
        dv.clamp_rounding(torch.tensor([float("nan")]), 0.0)


def test_all_metrics_float32_from_logits():
    logits_ref = torch.tensor([[2.0, 0.0, -1.0]])  # [1, 3]
    logits_kept = torch.tensor([[0.0, 1.0, 0.0]])
    lp, lq = torch.log_softmax(logits_ref, -1), torch.log_softmax(logits_kept, -1)
    metrics, n = dv.all_metrics(lp, lq, torch.tensor([0]))
    p = torch.softmax(logits_ref, -1)[0].double().numpy()
    q = torch.softmax(logits_kept, -1)[0].double().numpy()
    assert metrics["tv"].dtype == torch.float32 and metrics["top1_agree"].dtype == torch.int8
    assert metrics["tv"].item() == pytest.approx(0.5 * np.abs(p - q).sum(), abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(entropy(p, q), abs=1e-6)
    assert metrics["kl_reverse"].item() == pytest.approx(entropy(q, p), abs=1e-6)
    assert metrics["nll_kept"].item() == pytest.approx(-math.log(q[0]), abs=1e-6)
    assert metrics["nll_ref"].item() == pytest.approx(-math.log(p[0]), abs=1e-6)
    assert metrics["top1_agree"].item() == 0  # argmax 0 vs argmax 1
    assert n == 0
