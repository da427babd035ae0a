"""Gated recomputation (truncsens.certificates.attribution): the vectorized gated_removal_curve, and
removal_curves / attribution_statistics built on it, equal the old per-score loop (kept here as the
naive reference) exactly, on random scores with many ties, NaN and ±inf."""

from __future__ import annotations

import math

import numpy as np
import pytest

from truncsens.certificates.attribution import (
    attribution_statistics, auc, gated_removal_curve, random_removal, removal_curves,
)


def naive_gated_removal(scores, caused, fraction):
    """gated_removal (now gated_removal_curve) as it was: one pass per distinct score, highest first."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"a recomputation fraction must lie in [0, 1], got {fraction}")
    s = np.nan_to_num(np.asarray(scores, float), nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    c = np.asarray(caused, bool)
    if c.sum() == 0:
        return math.nan
    m = math.ceil(fraction * s.size - 1e-9)
    removed, left = 0.0, m
    for value in np.unique(s)[::-1]:
        if left <= 0:
            break
        group = s == value
        size = int(group.sum())
        take = min(left, size)
        removed += take / size * c[group].sum()
        left -= take
    return float(removed / c.sum())


def naive_attribution_statistics(cert, conf_kept, conf_ref, fail_kept, fail_ref, fractions):
    """attribution_statistics as it was (its own gating loop)."""
    fail_kept, fail_ref = np.asarray(fail_kept, bool), np.asarray(fail_ref, bool)
    caused, inherent = fail_kept & ~fail_ref, fail_kept & fail_ref
    out = {"n": float(fail_kept.size), "n_failures": float(fail_kept.sum()), "n_eviction_caused": float(caused.sum()),
           "n_inherent": float(inherent.sum()), "n_fixed": float((~fail_kept & fail_ref).sum())}
    gates = {"certificate": np.asarray(cert, float), "confidence": -np.asarray(conf_kept, float),
             "confidence_ref": -np.asarray(conf_ref, float)}
    for name, score in gates.items():
        out[f"auc_attribution_{name}"] = auc(score[fail_kept], caused[fail_kept])
        out[f"auc_failure_{name}"] = auc(score, fail_kept)
    for f in fractions:
        for name in ("certificate", "confidence"):
            out[f"removed_{name}_{f:g}"] = naive_gated_removal(gates[name], caused, f)
        out[f"removed_random_{f:g}"] = random_removal(fail_kept.size, f) if caused.any() else math.nan
    return out


def random_case(rng, n):
    scores = rng.integers(0, max(2, n // 3), n).astype(float)  # many ties
    special = rng.random(n)
    scores[special < 0.1] = np.nan
    scores[(special >= 0.1) & (special < 0.15)] = np.inf
    scores[(special >= 0.15) & (special < 0.2)] = -np.inf
    return scores, rng.random(n) < rng.uniform(0.05, 0.7)


FRACTIONS = np.array([0.0, 0.01, 0.05, 0.1, 0.2, 1 / 3, 0.5, 0.77, 0.999, 1.0])


@pytest.mark.parametrize("seed", range(10))
def test_curve_equals_the_per_score_loop_exactly(seed):
    rng = np.random.default_rng(seed)
    for n in (1, 2, 7, 30, 101):
        scores, caused = random_case(rng, n)
        fractions = np.concatenate([FRACTIONS, rng.random(5), np.arange(n + 1) / n])  # every cut, between groups too
        want = np.array([naive_gated_removal(scores, caused, f) for f in fractions])
        np.testing.assert_array_equal(gated_removal_curve(scores, caused, fractions), want)  # NaN where no cause


def test_curve_by_hand_with_ties_nan_and_inf():
    # groups highest first: {inf: 1 caused of 1}, {2: 1 of 3}, {NaN, -inf: 1 of 2}; 3 caused in all
    scores = np.array([2.0, np.nan, np.inf, 2.0, -np.inf, 2.0])
    caused = np.array([1, 1, 1, 0, 0, 0], bool)
    # 6 targets: m = 0, 1, 2 (1 + 1/3), 4 (1 + 1), 5 (2 + 1/2), 6
    np.testing.assert_allclose(gated_removal_curve(scores, caused, [0, 1 / 6, 2 / 6, 4 / 6, 5 / 6, 1]),
                               [0, 1 / 3, 4 / 9, 2 / 3, 5 / 6, 1], rtol=0, atol=1e-15)


def test_removal_curves_and_statistics_equal_the_old_code():
    rng = np.random.default_rng(7)
    for n in (5, 40, 120):
        cert, caused = random_case(rng, n)
        conf_kept = rng.integers(0, 6, n) / 5  # ties in confidence too
        conf_ref = rng.random(n)
        fail_kept = caused | (rng.random(n) < 0.3)
        fail_ref = fail_kept & ~caused
        curves = removal_curves(cert, conf_kept, caused, FRACTIONS)
        np.testing.assert_array_equal(curves["certificate"], [naive_gated_removal(cert, caused, f) for f in FRACTIONS])
        np.testing.assert_array_equal(curves["confidence"],
                                      [naive_gated_removal(-conf_kept, caused, f) for f in FRACTIONS])
        np.testing.assert_array_equal(curves["random"], [random_removal(n, f) for f in FRACTIONS])
        fractions = (0.05, 0.1, 0.2, 0.5)
        new = attribution_statistics(cert, conf_kept, conf_ref, fail_kept, fail_ref, fractions)
        old = naive_attribution_statistics(cert, conf_kept, conf_ref, fail_kept, fail_ref, fractions)
        assert list(new) == list(old)  # the same names in the same order
        np.testing.assert_array_equal(np.array(list(new.values())), np.array(list(old.values())))
        assert all(type(v) is float for v in new.values())


def test_no_caused_failure_and_bad_fractions():
    assert np.isnan(removal_curves(np.ones(3), np.ones(3), np.zeros(3, bool), [0.0, 0.5])["random"]).all()
    assert np.isnan(gated_removal_curve(np.ones(3), np.zeros(3, bool), [0.0, 0.5])).all()
    assert np.isnan(gated_removal_curve(np.array([]), np.array([], bool), [0.5])).all()  # nothing caused
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=rf"must lie in \[0, 1\], got {bad}"):
            gated_removal_curve(np.ones(3), np.ones(3, bool), [bad])
        with pytest.raises(ValueError, match="must lie in"):
            removal_curves(np.ones(3), np.ones(3), np.ones(3, bool), [0.2, bad])
