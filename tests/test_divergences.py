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
    assert metrics["tv"].dtype == torch.float64 and metrics["top1_agree"].dtype == torch.int8
    assert metrics["tv"].item() == pytest.approx(0.5 * np.abs(p - q).sum(), abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(entropy(p, q), abs=1e-6)
    assert metrics["kl_reverse"].item() == pytest.approx(entropy(q, p), abs=1e-6)
    assert metrics["nll_kept"].item() == pytest.approx(-math.log(q[0]), abs=1e-6)
    assert metrics["nll_ref"].item() == pytest.approx(-math.log(p[0]), abs=1e-6)
    # raw logits give the same metrics as their log-probabilities (log_softmax is idempotent)
    raw, _ = dv.all_metrics(logits_ref, logits_kept, torch.tensor([0]))
    for name in dv.METRICS:
        assert raw[name].item() == pytest.approx(metrics[name].item(), rel=1e-6, abs=1e-7), name
    assert metrics["top1_agree"].item() == 0  # argmax 0 vs argmax 1
    assert n == 0


# ---------------------------------------------------------------- float64 from float32 logits


def _exact(logits_p: torch.Tensor, logits_q: torch.Tensor) -> dict[str, float]:
    """TV, KL(p||q), KL(q||p) and JS of softmax(logits) at 40 significant digits (mpmath), the
    float32 logits taken as exact numbers."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    a = [mpmath.mpf(float(x)) for x in logits_p.tolist()]
    b = [mpmath.mpf(float(x)) for x in logits_q.tolist()]
    za, zb = mpmath.fsum(mpmath.exp(x) for x in a), mpmath.fsum(mpmath.exp(x) for x in b)
    p = [mpmath.exp(x) / za for x in a]
    q = [mpmath.exp(x) / zb for x in b]
    m = [(x + y) / 2 for x, y in zip(p, q)]
    kl_pq = mpmath.fsum(x * mpmath.log(x / y) for x, y in zip(p, q))
    kl_qp = mpmath.fsum(y * mpmath.log(y / x) for x, y in zip(p, q))
    js = (mpmath.fsum(x * mpmath.log(x / z) for x, z in zip(p, m)) + mpmath.fsum(y * mpmath.log(y / z) for y, z in zip(q, m))) / 2
    tv = mpmath.fsum(abs(x - y) for x, y in zip(p, q)) / 2
    return {"tv": float(tv), "kl": float(kl_pq), "kl_reverse": float(kl_qp), "js": float(js)}


@pytest.mark.parametrize("seed,scale,delta,exact_kl", [(0, 3.0, 1e-3, 2.662e-7), (1, 1.0, 2e-2, 2.0450e-4)])
def test_float32_logits_give_float64_accurate_divergences(seed, scale, delta, exact_kl):
    """Two float32 logit vectors over a 4096-token vocabulary that differ by ~delta: from float32
    log-probabilities KL is visibly wrong; all_metrics on the float32 logits matches the exact value
    (docs/precision.md quotes both; the float32 value depends on the CPU's kernels, the exact one not)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4096, generator=g) * scale  # [V] float32
    b = a + torch.randn(4096, generator=g) * delta
    exact = _exact(a, b)
    assert exact["kl"] == pytest.approx(exact_kl, rel=2e-4)
    lp32, lq32 = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl32 = float((lp32.exp() * (lp32 - lq32)).sum())  # what a float32 pipeline computes
    # visibly wrong: -1.26e-7 (AVX-512) or 3.12e-7 (AVX2) for the exact 2.66e-7; a relative error of 1.5e-3 at 2.0e-4
    assert abs(kl32 - exact["kl"]) / exact["kl"] > 1e-3
    metrics, n = dv.all_metrics(a[None], b[None], torch.tensor([0]))
    for name, value in exact.items():
        assert metrics[name].item() == pytest.approx(value, rel=1e-9), name
    assert n == 0


def test_js_and_kl_of_identical_distributions_are_exactly_zero():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4096, generator=g) * 4  # [4, V] float32
    metrics, n = dv.all_metrics(logits, logits.clone(), torch.zeros(4, dtype=torch.long))
    for name in ("tv", "kl", "kl_reverse", "js"):
        assert metrics[name].tolist() == [0.0] * 4, name
    assert metrics["top1_agree"].tolist() == [1] * 4 and n == 0
    # the float32 formula of before gave JS(p, p) of order 1e-8 .. 1e-7, not 0
    lp = torch.log_softmax(logits, -1)  # float32
    logm = torch.logaddexp(lp, lp) - math.log(2.0)
    old = (lp.exp() * (lp - logm)).sum(-1)  # 1/2 KL(p||m) + 1/2 KL(p||m), all in float32
    assert old.abs().max().item() > 1e-9
    # logits and their own float64 log-probabilities are the same distribution
    same, _ = dv.all_metrics(logits, torch.log_softmax(logits.double(), -1), torch.zeros(4, dtype=torch.long))
    assert same["js"].abs().max().item() < 1e-14 and same["tv"].max().item() < 1e-14


def test_js_on_disjoint_and_partial_supports_in_float64():
    p, q = logp(0.25, 0.75, 0.0), logp(0.0, 0.25, 0.75)
    m = [0.125, 0.5, 0.375]
    expected = 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])) + 0.5 * (
        0.25 * math.log(0.25 / m[1]) + 0.75 * math.log(0.75 / m[2]))
    assert dv.js(p, q).item() == pytest.approx(expected, rel=1e-13)
    assert dv.js(p.float(), q.float()).dtype == torch.float64
