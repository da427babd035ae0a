"""Time-uniform validity: over many simulated trajectories the e-process's error rate stays below δ,
while per-step certificates read naively at every step miss somewhere far more often; and the
radius's coverage on synthetic attention (Gaussian keys and values)."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from truncsens.certificates.eprocess import e_process, rejects, step_levels, step_weights
from truncsens.certificates.estimator import attention_records
from truncsens.policies import make_policy


def test_weights_and_hand_values():
    np.testing.assert_allclose(step_weights(3), [1 / 2, 1 / 6, 1 / 12])
    np.testing.assert_allclose(step_levels(3, 0.1), [0.05, 0.1 / 6, 0.1 / 12])
    e = e_process(np.array([False, True, False]), 0.1)
    np.testing.assert_allclose(e, [0.0, 10.0, 10.0])  # one miss adds exactly 1/delta
    assert rejects(np.array([[False, False], [False, True]]), 0.1).tolist() == [False, True]
    with pytest.raises(ValueError, match="delta"):
        step_levels(3, 0.0)


def test_time_uniform_error_rate_stays_below_delta_where_naive_reading_exceeds_it():
    # step t: the error is |N(0, s_t^2)| and the normal radius z_{1 - level/2} s_t misses with probability level exactly
    rng = np.random.default_rng(0)
    n_traj, n_steps, delta = 4000, 50, 0.05
    scale = rng.uniform(0.1, 3.0, size=(n_traj, n_steps))
    error = np.abs(rng.normal(size=(n_traj, n_steps))) * scale
    z = NormalDist().inv_cdf
    naive_radius = z(1 - delta / 2) * scale
    uniform_radius = np.array([z(1 - d / 2) for d in step_levels(n_steps, delta)]) * scale
    naive_rate = float((error > naive_radius).any(-1).mean())
    uniform_rate = float(rejects(error > uniform_radius, delta).mean())
    se = math.sqrt(delta * (1 - delta) / n_traj)
    assert uniform_rate <= delta + 2 * se
    assert naive_rate > 0.9  # 1 - 0.95^50 = 0.92
    assert abs(naive_rate - (1 - (1 - delta) ** n_steps)) < 4 * math.sqrt(0.08 * 0.92 / n_traj)
    assert float((error > naive_radius).mean()) == pytest.approx(delta, abs=4 * math.sqrt(delta / (n_traj * n_steps)))


def test_radius_coverage_on_synthetic_attention():
    """Gaussian keys and values, one fixed query, many Poisson draws: the empirical-Bernstein radius
    covers at least 1 - delta (its construction is conservative) within two binomial standard errors."""
    g = torch.Generator().manual_seed(0)
    T, d, k, delta, draws = 256, 16, 64, 0.05, 600
    keys = torch.randn(T, d, generator=g, dtype=torch.float64)
    values = torch.randn(T, d, generator=g, dtype=torch.float64)
    query = torch.randn(d, generator=g, dtype=torch.float64)
    logits = keys @ query / math.sqrt(d)  # [T]
    scores = torch.softmax(logits, -1).view(1, 1, T).expand(draws, 1, T)  # the query's own attention as score
    policy = make_policy("poisson", n_sink=4)
    q = torch.tensor([T - 1])
    pi, tail = policy.design(k, q, scores)
    kept = policy.keep(T, k, q, list(range(draws)), scores).keep  # [draws, 1, T]
    rec = attention_records(logits.expand(draws, 1, T), values.expand(draws, 1, T, d), torch.ones(T, dtype=torch.bool),
                            kept, pi, tail, delta)
    covered = (rec.error <= rec.radius_eb).double().mean().item()
    se = math.sqrt(delta * (1 - delta) / draws)
    assert covered >= 1 - delta - 2 * se
    assert torch.isfinite(rec.radius_eb).all() and float(rec.error.max()) > 0
