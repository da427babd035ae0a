"""Per-layer window allocation: the closed form against brute force on small cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from truncsens.budget.allocation import (
    AllocationError, continuous_allocation, integer_allocation, kvpress_ratios, linear_schedule, predicted_distortion,
    uniform_windows,
)


def brute_force(C, a, b, budget, lo, hi):
    best, arg = np.inf, None
    for w in itertools.product(*[range(l, h + 1) for l, h in zip(lo, hi)]):
        if np.dot(b, w) <= budget + 1e-9:
            d = predicted_distortion(C, a, w)
            if d < best - 1e-12:
                best, arg = d, w
    return best, np.array(arg)


@pytest.mark.parametrize("case", range(12))
def test_integer_allocation_matches_brute_force(case):
    rng = np.random.default_rng(case)
    L = int(rng.integers(2, 4))
    C = rng.uniform(0.1, 2.0, L)
    a = rng.uniform(0.3, 1.5, L)
    b = rng.integers(1, 4, L).astype(float)
    lo, hi = [1] * L, [int(h) for h in rng.integers(6, 14, L)]
    budget = float(rng.uniform(b @ lo, b @ hi))
    best, _ = brute_force(C, a, b, budget, lo, hi)
    w = integer_allocation(C, a, b, budget, lo, hi)
    assert float(b @ w) <= budget + 1e-9 and np.all(w >= lo) and np.all(w <= hi)
    # optimal up to the last token the greedy could not afford: within one layer's step of the optimum
    assert predicted_distortion(C, a, w) <= best + max(C * (1 - 2.0 ** -a)) * 1.0 + 1e-12
    assert predicted_distortion(C, a, w) >= best - 1e-12


def test_equal_costs_and_laws_give_equal_windows_and_kkt_holds():
    w = continuous_allocation([1, 1, 1], [0.5, 0.5, 0.5], [1, 1, 1], 300, [1, 1, 1], [1000, 1000, 1000])
    np.testing.assert_allclose(w, [100, 100, 100], rtol=1e-9)
    C, a, b = np.array([1.0, 4.0]), np.array([0.5, 1.0]), np.array([1.0, 2.0])
    w = continuous_allocation(C, a, b, 200, [1, 1], [10_000, 10_000])
    assert b @ w == pytest.approx(200, rel=1e-9)
    lam = a * C * w ** (-a - 1) / b  # the same multiplier in both layers
    assert lam[0] == pytest.approx(lam[1], rel=1e-6)


def test_bounds_and_errors():
    w = continuous_allocation([1, 100], [1, 1], [1, 1], 50, [1, 1], [1000, 20])
    assert w[1] == 20 and w[0] == pytest.approx(30)  # the sensitive layer hits its bound, the rest goes to the other
    assert continuous_allocation([1, 1], [1, 1], [1, 1], 1e9, [1, 1], [8, 8]).tolist() == [8, 8]
    with pytest.raises(AllocationError, match="below the smallest allocation"):
        continuous_allocation([1, 1], [1, 1], [1, 1], 1, [1, 1], [8, 8])
    with pytest.raises(AllocationError, match="alpha > 0"):
        continuous_allocation([1, 1], [1, -0.2], [1, 1], 10, [1, 1], [8, 8])


def test_uniform_linear_and_kvpress_ratios():
    assert uniform_windows([1, 1, 1, 1], 256, 1, 1024).tolist() == [64] * 4
    lin = linear_schedule([1, 1, 1, 1, 1], 500, 1, 1024)
    assert lin[0] > lin[-1] and np.all(np.diff(lin) <= 0) and lin.sum() <= 500
    # k_max = 2*100 - 5 = 195 down by 47.5 to k_min = 100/20 = 5, rounded down; the token the rounding
    # left unspent goes to the shallowest layer
    assert lin.tolist() == [196, 147, 100, 52, 5] and lin.sum() == 500
    clipped = linear_schedule([1] * 5, 5 * 252, 1, 252)  # the schedule wants more than 252 in front: clipped,
    assert clipped.sum() == 5 * 252  # and what clipping left unspent is spent further down
    assert kvpress_ratios([256, 512, 1024], 1024) == [0.75, 0.5, 0.0]
    with pytest.raises(AllocationError):
        kvpress_ratios([0], 1024)


def test_layer_power_laws_recover_known_exponents():
    """Three layers whose mean curves are exactly C_l w^-alpha_l (targets scattered symmetrically per
    document): the fit returns them, with intervals around them."""
    from truncsens.fits.per_layer import layer_power_laws

    windows = np.array([4, 8, 16, 32, 64, 128])
    C, a = np.array([0.5, 2.0, 0.1]), np.array([0.4, 1.0, 0.7])
    n_docs, rng = 8, np.random.default_rng(0)
    values, doc = [], []
    for d in range(n_docs):
        z = rng.uniform(-0.3, 0.3, (len(C), 1))
        values += [C[:, None] * windows ** -a[:, None] * (1 + z), C[:, None] * windows ** -a[:, None] * (1 - z)]
        doc += [f"d{d}", f"d{d}"]
    values = np.stack(values, axis=1)  # [L, n, W]
    laws = layer_power_laws(values, windows, doc, n_boot=100)
    for l, law in enumerate(laws):
        assert law["status"] == "ok"
        assert law["C"]["value"] == pytest.approx(C[l], rel=1e-9) and law["alpha"]["value"] == pytest.approx(a[l], rel=1e-9)
        assert law["alpha"]["ci"][0] <= a[l] <= law["alpha"]["ci"][1]
    zero = layer_power_laws(np.zeros((1, 4, 6)), windows, ["a", "a", "b", "b"], n_boot=0)[0]
    assert zero["status"] == "failed" and zero["C"] is None
    # a layer that reaches the float32 noise floor of KL (1e-13) at its two largest windows: they are left
    # out (as truncsens fit leaves them out) and the law is that of the other windows, exactly
    floored = values[2:3].copy()
    floored[..., -2:] = 5e-14
    law = layer_power_laws(floored, windows, doc, n_boot=20, metric="kl")[0]
    assert law["excluded"]["noise_floor"] == [64, 128]
    assert law["alpha"]["value"] == pytest.approx(a[2], rel=1e-9) and law["C"]["value"] == pytest.approx(C[2], rel=1e-9)
    tv = layer_power_laws(floored, windows, doc, n_boot=0, metric="tv")[0]  # TV's floor (1.5e-7) takes the same two
    assert tv["excluded"]["noise_floor"] == [64, 128]


def test_budget_for_eps_is_the_smallest_that_reaches_it():
    from truncsens.budget.allocation import budget_for

    C, a, b, lo, hi = [1.0, 3.0], [0.5, 1.0], [1.0, 1.0], [1, 1], [500, 500]
    B = budget_for(C, a, b, 0.2, lo, hi)
    assert predicted_distortion(C, a, integer_allocation(C, a, b, B, lo, hi)) <= 0.2
    assert predicted_distortion(C, a, integer_allocation(C, a, b, B - 2, lo, hi)) > 0.2
    assert budget_for(C, a, b, 1e-6, lo, hi) is None  # not reachable within the bounds
    with pytest.raises(AllocationError, match="--eps"):
        budget_for(C, a, b, 0, lo, hi)


def test_a_layer_at_the_noise_floor_is_fixed_at_its_floor_window():
    """A layer whose KL reaches the float32 floor (1e-13) from window 16 on (an exact zero at 32, and
    everything after an exact zero counts as zero, as in truncsens fit) has two windows above it: no law
    (a power law needs 3), and floor_window names 16; a largest window above the floor means none."""
    from truncsens.fits.per_layer import floor_window, layer_power_laws

    windows = np.array([4, 8, 16, 32, 64])
    values = np.tile(np.array([1e-3, 1e-5, 5e-14, 0.0, 2e-14]), (1, 4, 1))  # [1, n, W]
    law = layer_power_laws(values, windows, ["a", "a", "b", "b"], n_boot=0, metric="kl")[0]
    assert law["status"] == "failed" and "at least 3" in law["reason"]
    assert floor_window(law) == 16
    values[..., 3:] = [3e-14, 1e-4]  # no exact zero, and the largest window lies above the floor: no floor window
    assert floor_window(layer_power_laws(values, windows, ["a", "a", "b", "b"], n_boot=0, metric="kl")[0]) is None


def test_allocation_with_a_fixed_layer():
    """The fixed layer keeps its window; the others share what is left exactly as integer_allocation
    shares it among them alone; the prediction leaves the fixed layer out at or above its window and
    is unknown (NaN) below it."""
    from truncsens.budget.allocation import allocation_with_fixed, predicted_with_fixed

    C, a, b = [1.0, np.nan, 2.0], [0.5, np.nan, 1.0], [1.0, 1.0, 1.0]
    w = allocation_with_fixed(C, a, b, 300, 1, 1000, [0, 16, 0])
    assert w[1] == 16
    assert w[[0, 2]].tolist() == integer_allocation([1.0, 2.0], [0.5, 1.0], [1.0, 1.0], 284, [1, 1], [1000, 1000]).tolist()
    assert predicted_with_fixed(C, a, w, [0, 16, 0]) == pytest.approx(predicted_distortion([1, 2], [0.5, 1], w[[0, 2]]))
    assert np.isnan(predicted_with_fixed(C, a, [100, 8, 100], [0, 16, 0]))
    with pytest.raises(AllocationError, match="every layer is fixed"):
        allocation_with_fixed(C, a, b, 300, 1, 1000, [4, 16, 4])
    with pytest.raises(AllocationError, match="below the smallest allocation"):
        allocation_with_fixed(C, a, b, 17, 1, 1000, [0, 16, 0])
