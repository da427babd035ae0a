"""Document-clustered statistics and the percentile interval (truncsens.stats)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from truncsens.stats import (bootstrap_multiplicities, cluster_mean_se, interval_or_none, percentile_interval,
                             resample_weights)


def test_cluster_mean_se_by_hand():
    # docs a: [1, 3] (sum 4, n 2), b: [2] (sum 2, n 1); mean = 6/3 = 2
    # CR1: G/(G-1) * ((4 - 2*2)^2 + (2 - 1*2)^2) / 3^2 = 0 for column 0
    # column 1: a: [1, 1] (sum 2), b: [4]; mean 2; (2 - 4)^2 + (4 - 2)^2 = 8; se = sqrt(2 * 8) / 3 = 4/3
    values = np.array([[1.0, 1.0], [2.0, 4.0], [3.0, 1.0]])
    mean, se = cluster_mean_se(values, ["a", "b", "a"])
    assert mean == pytest.approx([2.0, 2.0])
    assert se == pytest.approx([0.0, 4 / 3])


def test_cluster_mean_se_one_value_per_document_is_s_over_sqrt_n():
    v = np.array([1.0, 2.0, 3.0, 4.0])
    _, se = cluster_mean_se(v[:, None], ["a", "b", "c", "d"])
    assert se[0] == pytest.approx(np.std(v, ddof=1) / 2)  # sqrt(5/3) / sqrt(4)


def test_cluster_mean_se_skips_nonfinite_and_one_document_has_no_se():
    mean, se = cluster_mean_se(np.array([[1.0], [np.inf], [3.0]]), ["a", "a", "a"])
    assert mean[0] == 2.0 and math.isnan(se[0])


def test_resample_weights_first_row_is_the_sample():
    w = resample_weights(5, 3, seed=1)
    assert w.shape == (4, 5)
    assert np.all(w[0] == 1) and np.all(w[1:].sum(1) == 5)
    assert np.array_equal(w[1:], bootstrap_multiplicities(5, 3, 1))
    assert resample_weights(4, 0, seed=0).shape == (1, 4)


def test_percentile_interval_finite_only_by_default():
    assert percentile_interval(np.arange(101.0)) == pytest.approx((2.5, 97.5))
    # the infinite samples are dropped by default: quantiles of 0..89 (2.5%: 0.025 * 89 = 2.225)
    lo, hi = percentile_interval(np.r_[np.arange(90.0), np.full(10, np.inf)])
    assert lo == pytest.approx(2.225) and hi == pytest.approx(89 - 2.225)
    # kept: the upper end falls among the infinities
    lo, hi = percentile_interval(np.r_[np.arange(90.0), np.full(10, np.inf)], keep_inf=True)
    assert lo == pytest.approx(2.475) and hi == math.inf
    assert percentile_interval(np.array([4.0, 0.0, 2.0]), level=0.5) == pytest.approx((1.0, 3.0))


def test_interval_or_none():
    assert interval_or_none(None, 0.95) is None
    assert interval_or_none(np.zeros(0), 0.95) is None
    assert interval_or_none(np.arange(101.0), 0.9) == pytest.approx([5.0, 95.0])
