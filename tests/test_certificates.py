"""Poisson design and Hájek estimator (arXiv 2607.21475): bisection, unbiasedness, variance, radii."""

from __future__ import annotations

import math

import pytest
import torch

from truncsens.policies.poisson_design import (
    PoissonDesignError, certificate_radius, draw, empirical_bernstein_radius, hajek_attention, hajek_offsets,
    hajek_variance, inclusion_probabilities, solve_scale,
)


def exact_scale(s: list[float], m: float) -> float:
    """c with sum min(1, c s_i) = m, by trying each number of saturated tokens (sorted descending)."""
    s = sorted(s, reverse=True)
    for j in range(len(s)):
        c = (m - j) / sum(s[j:])
        if c * s[j] <= 1 + 1e-12 and (j == 0 or c * s[j - 1] >= 1 - 1e-12):
            return c
    raise AssertionError("no solution")


@pytest.mark.parametrize("m", [1.0, 3.5, 10.0, 19.0, 20.0])
def test_bisection_hits_the_expected_count(m):
    g = torch.Generator().manual_seed(int(m * 10))
    s = torch.rand(3, 20, generator=g, dtype=torch.float64) ** 4 + 1e-6  # skewed: some saturate
    eligible = torch.ones_like(s, dtype=torch.bool)
    c = solve_scale(s, eligible, m)
    pi = inclusion_probabilities(s, eligible, m)
    for b in range(3):
        assert float(c[b]) == pytest.approx(exact_scale(s[b].tolist(), m), rel=1e-9)
        assert float(pi[b].sum()) == pytest.approx(m, abs=1e-9)
    assert float(pi.max()) <= 1.0 and float(pi.min()) > 0
    if m == 20.0:
        assert torch.all(pi == 1)


def test_bisection_respects_eligibility_and_per_row_budgets():
    s = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 1.0, 2.0]], dtype=torch.float64)
    eligible = torch.tensor([[True, True, False, True], [False, True, True, True]])
    pi = inclusion_probabilities(s, eligible, torch.tensor([1.4, 0.0], dtype=torch.float64))
    assert float(pi[0].sum()) == pytest.approx(1.4, abs=1e-12)
    assert pi[0, 2] == 0 and torch.all(pi[1] == 0)
    assert float(pi[0, 3] / pi[0, 0]) == pytest.approx(4.0)


def test_design_errors():
    eligible = torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(PoissonDesignError, match="all zero"):
        solve_scale(torch.zeros(1, 5), eligible, 2.0)
    with pytest.raises(PoissonDesignError, match="exceeds the 2 tail tokens"):
        solve_scale(torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0]]), eligible, 3.0)
    with pytest.raises(PoissonDesignError, match="non-negative"):
        solve_scale(torch.tensor([[1.0, -1.0, 0.0, 1.0, 1.0]]), eligible, 1.0)
    with pytest.raises(PoissonDesignError, match="finite"):
        solve_scale(torch.tensor([[1.0, math.nan, 0.0, 1.0, 1.0]]), eligible, 1.0)


def one_head(seed: int = 0, n: int = 200, d_head: int = 16, d_v: int = 6):
    """Logits q·k/sqrt(d) and values of one attention head over n keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d_head, generator=g, dtype=torch.float64)
    keys = torch.randn(n, d_head, generator=g, dtype=torch.float64)
    logits = keys @ q / math.sqrt(d_head)  # [n]
    values = torch.randn(n, d_v, generator=g, dtype=torch.float64) + 2 * torch.linspace(-1, 1, n, dtype=torch.float64).unsqueeze(1)
    return logits, values, g


def poisson_draws(logits, values, g, draws: int = 12000, tail_budget: float = 60.0, n_certain: int = 4):
    n = logits.numel()
    w = torch.softmax(logits, 0)  # [n]
    scores = w * (0.5 + torch.rand(n, generator=g, dtype=torch.float64))  # attention-like, noisy
    certain = torch.zeros(n, dtype=torch.bool)
    certain[:n_certain] = True
    tail = ~certain
    pi = torch.where(certain, torch.ones(n, dtype=torch.float64), inclusion_probabilities(scores, tail, tail_budget))
    hajek, plain, var = [], [], []
    for _ in range(draws // 2000):  # chunks keep memory small
        u = torch.rand(2000, n, generator=g, dtype=torch.float64)
        kept = draw(pi.expand(2000, n), u) | certain  # [D, n]
        L, V = logits.expand(2000, n), values.expand(2000, n, values.shape[1])
        hajek.append(hajek_attention(L, V, kept, pi.expand(2000, n)))  # [D, d]
        plain.append(hajek_attention(L, V, kept, torch.ones(2000, n, dtype=torch.float64)))
        var.append(hajek_variance(L, V, kept, pi.expand(2000, n), tail.expand(2000, n)))  # [D]
    return torch.cat(hajek), torch.cat(plain), torch.cat(var), w @ values


def test_hajek_output_is_unbiased_and_uncorrected_is_not():
    logits, values, g = one_head()
    hajek, plain, _, full = poisson_draws(logits, values, g)
    D = hajek.shape[0]
    z_hajek = (hajek.mean(0) - full) / (hajek.std(0) / math.sqrt(D))  # per output coordinate
    z_plain = (plain.mean(0) - full) / (plain.std(0) / math.sqrt(D))
    assert z_hajek.abs().max() < 4.0, z_hajek  # matches the full output within Monte-Carlo error
    assert z_plain.abs().max() > 20.0, z_plain  # the uncorrected output is biased
    assert (plain.mean(0) - full).norm() > 20 * (hajek.mean(0) - full).norm()


def test_variance_estimate_matches_the_error_and_the_radius_covers():
    logits, values, g = one_head(seed=1)
    hajek, _, var, full = poisson_draws(logits, values, g)
    mse = ((hajek - full) ** 2).sum(-1).mean()
    assert float(var.mean()) == pytest.approx(float(mse), rel=0.15)  # unbiased for the linearized error
    radius = certificate_radius(var, delta=0.05)
    coverage = float(((hajek - full).norm(dim=-1) <= radius).double().mean())
    assert 0.9 <= coverage <= 1.0


def test_offsets_and_closed_form_radii():
    pi = torch.tensor([1.0, 0.5, 0.25, 0.1], dtype=torch.float64)
    kept = torch.tensor([True, True, False, True])
    torch.testing.assert_close(hajek_offsets(pi, kept), torch.tensor([0.0, math.log(2), 0.0, math.log(10)], dtype=torch.float64))
    # the offset form equals the explicit ratio estimator sum(w/pi v) / sum(w/pi)
    logits = torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=torch.float64)
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    w = logits.exp() * kept / pi
    torch.testing.assert_close(hajek_attention(logits, values, kept, pi), (w @ values) / w.sum())
    assert float(certificate_radius(torch.tensor(4.0), delta=0.05)) == pytest.approx(1.959964 * 2, rel=1e-6)
    r = empirical_bernstein_radius(torch.tensor(0.5), 100, 1.0, delta=0.1)
    assert float(r) == pytest.approx(math.sqrt(2 * 0.5 * math.log(40) / 100) + 7 * math.log(40) / (3 * 99), rel=1e-12)
    with pytest.raises(ValueError, match="delta"):
        certificate_radius(torch.tensor(1.0), delta=1.5)


# ---------------------------------------------------------------- randomness edge cases


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def test_certain_key_is_kept_with_a_uniform_just_below_one():
    """float32 π = 1 and the float64 uniform 1 − 2⁻²⁶: a float32 cast rounds u to 1 and dropped the key."""
    u = torch.tensor([1 - 2.0**-26], dtype=torch.float64)
    assert u.to(torch.float32).item() == 1.0  # the rounding that dropped it
    assert draw(torch.tensor([1.0], dtype=torch.float32), u).tolist() == [True]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pi_one_always_kept_and_pi_zero_never(dtype):
    u = torch.tensor([0.0, 2.0**-60, 0.5, 1 - 2.0**-53, 1 - 2.0**-26, 1 - 2.0**-11, 1.0], dtype=torch.float64)
    ones = torch.ones(7, dtype=dtype)
    zeros = torch.zeros(7, dtype=dtype)
    assert draw(ones, u).tolist() == [True] * 7
    assert draw(zeros, u).tolist() == [False] * 7
    # an inner π keeps exactly the uniforms below it, compared in float64: π = 0.5 is exact in every dtype
    assert draw(torch.full((7,), 0.5, dtype=dtype), u).tolist() == [True, True, False, False, False, False, False]
    # float32 uniforms too
    assert draw(ones, u.float().clamp(max=1.0)).all() and not draw(zeros, u.float()).any()


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), float("inf")])
def test_pi_outside_the_unit_interval_is_refused(bad):
    pi = torch.tensor([0.5, bad], dtype=torch.float64)
    kept = torch.tensor([True, True])
    with pytest.raises(ValueError, match=r"pi must lie in \[0, 1\]: 1 entries are NaN or outside"):
        draw(pi, torch.tensor([0.1, 0.2], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"pi must lie in \[0, 1\]"):
        hajek_offsets(pi, kept)
    with pytest.raises(ValueError, match=r"pi must lie in \[0, 1\]"):
        hajek_attention(torch.zeros(2), torch.ones(2, 1), kept, pi)


def test_uniforms_and_budgets_are_validated():
    with pytest.raises(ValueError, match=r"uniforms must lie in \[0, 1\]"):
        draw(torch.tensor([0.5]), torch.tensor([float("nan")], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"uniforms must lie in \[0, 1\]"):
        draw(torch.tensor([0.5]), torch.tensor([-0.25], dtype=torch.float64))
    with pytest.raises(ValueError, match="inclusion probability 0"):
        hajek_offsets(torch.tensor([0.0, 1.0]), torch.tensor([True, True]))
    s = torch.ones(1, 4, dtype=torch.float64)
    e = torch.ones_like(s, dtype=torch.bool)
    for m in (-1.0, float("nan")):
        with pytest.raises(PoissonDesignError, match="tail budget must be a finite number >= 0"):
            inclusion_probabilities(s, e, m)


@pytest.mark.parametrize("dtype", DTYPES)
def test_offsets_are_exact_for_every_dtype(dtype):
    pi = torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=dtype)
    kept = torch.tensor([True, True, True, False])
    off = hajek_offsets(pi, kept)
    assert off.dtype == dtype
    assert off.tolist() == pytest.approx([0.0, math.log(2), math.log(4), 0.0], rel=1e-2 if dtype in DTYPES[:2] else 1e-7)
    assert off[0].item() == 0.0 and off[3].item() == 0.0


def test_an_error_below_float64_resolution_is_stored_as_zero():
    """‖ô − o‖ at float64 rounding of the outputs (a tail whose weights underflow) is 0 on every machine;
    an error just above the resolution is kept as it is."""
    from truncsens.certificates.estimator import F64_RESOLUTION, attention_records, resolved_error

    scale = torch.tensor([6.0, 6.0, 6.0, 0.0], dtype=torch.float64)
    error = torch.tensor([3.9e-17, 0.0, 6.0 * F64_RESOLUTION * 2, 0.0], dtype=torch.float64)
    assert resolved_error(error, scale).tolist() == [0.0, 0.0, 6.0 * F64_RESOLUTION * 2, 0.0]
    # end to end: keys of weight e^-60 drawn away change o by ~1e-26 relative: the stored error is exactly 0
    logits = torch.tensor([[0.0, 0.5, -60.0, -61.0]], dtype=torch.float64)
    values = torch.randn(1, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    kept = torch.tensor([[True, True, False, True]])
    pi = torch.tensor([[1.0, 1.0, 0.5, 0.5]], dtype=torch.float64)
    tail = torch.tensor([[False, False, True, True]])
    rec = attention_records(logits, values, torch.ones_like(kept), kept, pi, tail)
    assert rec.error.tolist() == [0.0]
