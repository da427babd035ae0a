"""The emitted certificate r_EB + b·‖ô‖ and coverage over every record: the floor cases built by hand
(a head whose tail holds no attention; an error below the arithmetic bound), calibration at 80 / 90 /
95 / 99 % on records whose coverage at each level is known, with Wilson intervals computed by hand,
and files written before ``radius_certificate`` summarised from what they hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xarray as xr

from truncsens.certificates.arithmetic import ARITH_FACTOR, certificate_records, declared_bound, emitted_radius
from truncsens.certificates.coverage_report import format_summary, summarize
from truncsens.certificates.estimator import attention_records
from truncsens.certificates.statistics import coverage, reliability, tightness, tolerance_curve

F32 = 64 * float(np.finfo(np.float32).eps)  # the declared float32 bound, 7.63e-6


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval (Wilson 1927), by its formula."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def test_declared_float32_bound_exceeds_what_was_measured():
    assert ARITH_FACTOR == 64 and declared_bound("float32") == pytest.approx(7.62939453125e-06, rel=1e-12)
    assert declared_bound("float32") > 2.84e-6  # the largest float32-vs-float64 difference measured (N = 1,024)
    assert declared_bound("float32", 10) == pytest.approx(1.1920928955078125e-06)  # the earlier floor


def floor_head_records():
    """One query, 6 keys: 2 surely kept, 4 in the tail. Row 0: the tail holds no attention (logits
    -2000: weight exp(-2000) = 0 in float64). Row 1: the two drawn tail keys hold none, the two undrawn
    ones weight exp(-30) ≈ 9e-14 each: a tiny nonzero error that no kept key shows."""
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, -1.0], [2.0, 2.0], [-1.0, 4.0], [5.0, 0.0]], dtype=torch.float64)
    logits = torch.tensor([[0.0, 0.5, -2000.0, -2000.0, -2000.0, -2000.0],
                           [0.0, 0.5, -2000.0, -2000.0, -30.0, -30.0]], dtype=torch.float64)
    kept = torch.tensor([True, True, True, True, False, False])
    tail = torch.tensor([False, False, True, True, True, True])
    pi = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    return attention_records(logits, values.expand(2, 6, 2), torch.ones(6, dtype=torch.bool), kept, pi, tail, 0.05)


def test_floor_cases_built_by_hand_are_covered_by_the_certificate():
    rec = floor_head_records()
    assert rec.error[0] == 0 and rec.radius_eb[0] == 0  # no tail mass: error and radius exactly 0
    assert 0 < rec.error[1] < 1e-12 and rec.radius_eb[1] == 0  # missed by the statistical radius alone
    assert torch.allclose(rec.o_hat_norm, rec.o_hat.norm(dim=-1))
    cert = emitted_radius(rec.radius_eb.numpy(), rec.o_hat_norm.numpy(), F32)
    np.testing.assert_allclose(cert, F32 * rec.o_hat_norm.numpy())  # r_EB + b·||o^|| with r_EB = 0
    err = rec.error.numpy()[None]  # [1 target, 2 records]
    floor = F32 * rec.o_hat_norm.numpy()[None]
    c = coverage(err, cert[None], floor=floor, statistical=rec.radius_eb.numpy()[None])
    assert (c["covered"], c["n"], c["rate"], c["n_at_floor"], c["n_at_floor_missed_statistical"]) == (2, 2, 1.0, 2, 1)
    eb = coverage(err, rec.radius_eb.numpy()[None], floor=floor)
    assert (eb["covered"], eb["n"]) == (1, 2)  # error 0 under radius 0 covers; the tiny error does not
    old = coverage(err, rec.radius_eb.numpy()[None], floor=floor, leave_out_floor=True)
    assert (old["n"], old["n_at_floor"]) == (0, 2)  # the earlier rule left both out


def records_dataset(error, radius_eb, hat_norm, norm, has_tail, variance=None, value_range=None, n_random=None,
                    new_file=True, bound=F32, docs=None):
    """A certify results Dataset of one budget (64 of N = 512: 12.5 %), poisson only, records [n, 1, 1]."""
    n = len(error)
    shape = (1, n, 1, 1, 1)
    arr = lambda x: np.asarray(x, float).reshape(shape)  # noqa: E731
    rec = {"attn_error": arr(error), "radius_eb": arr(radius_eb), "attn_norm": arr(norm), "has_tail": arr(has_tail),
           "radius_normal": arr(radius_eb), "attn_variance": arr(np.zeros(n) if variance is None else variance),
           "value_range": arr(np.zeros(n) if value_range is None else value_range),
           "n_random": arr(np.full(n, 2.0) if n_random is None else n_random)}
    attrs = {"delta": 0.05, "reference_context": 512, "model": "hand", "corpus": "hand", "error_floor_relative": bound}
    if new_file:
        rec["attn_hat_norm"] = arr(hat_norm)
        rec["radius_certificate"] = arr(emitted_radius(radius_eb, hat_norm, bound))
        attrs["arithmetic_bound_relative"] = bound
    dims = ("policy", "target", "budget", "layer", "head")
    data = {k: (dims, v) for k, v in rec.items()}
    data["kl"] = (("policy", "target", "budget"), np.zeros((1, n, 1)))
    docs = docs if docs is not None else [f"d{i % 4}" for i in range(n)]
    return xr.Dataset(data, coords={"policy": ["poisson"], "budget": [64], "doc": ("target", docs)}, attrs=attrs)


def test_summary_counts_every_record_and_the_floor_column():
    # 4 records: no tail mass (0, 0); tiny error under b·||o^|| with r_EB = 0; covered by r_EB; a miss
    error = [0.0, 1e-9, 0.5, 2.0]
    v = 1 / (2 * math.log(80))  # V^ with r_EB(0.05) = sqrt(2 V^ ln 80) = 1 (B^ = 0): the stored radii recomputed
    ds = records_dataset(error, [0.0, 0.0, 1.0, 1.0], hat_norm=[1.0, 1.0, 1.0, 1.0], norm=[1.0, 1.0, 1.1, 1.2],
                         has_tail=[1, 1, 1, 1], variance=[0.0, 0.0, v, v])
    s = summarize(ds, n_boot=0)
    b = s["budgets"][0]
    c = b["coverage_certificate"]
    assert (c["covered"], c["n"], c["n_at_floor"], c["n_at_floor_missed_statistical"]) == (3, 4, 2, 1)
    assert c["rate"] == 0.75 and c["ci"] == pytest.approx(wilson(3, 4))
    assert (b["coverage_eb"]["covered"], b["coverage_eb"]["n"]) == (2, 4)
    assert b["verdict_coverage"] == "holds"  # the Wilson interval of 3 / 4 reaches 95 %
    # tightness over error > 0: ratios b/1e-9, (1 + b)/0.5, (1 + b)/2 -> median (1 + b)/0.5
    assert b["tightness_certificate"] == {"median_ratio": pytest.approx((1 + F32) / 0.5), "n": 3}
    assert s["floor"]["declared_relative"] == F32 and s["floor"]["relative_to"] == "||o^||"
    text = format_summary(s)
    assert "at floor, r_EB misses" in text and "calibration" in text and "nominal 80%" in text
    above = b["calibration"][2]["certificate_above_floor"]  # nominal 95 %: records 0.5 (covered) and 2.0 (missed)
    assert (above["covered"], above["n"]) == (1, 2)


def test_an_old_file_is_summarised_from_the_oracle_norm():
    error = [0.0, 1e-9, 0.5, 2.0]
    ds = records_dataset(error, [0.0, 0.0, 1.0, 1.0], hat_norm=None, norm=[1.0, 1.0, 1.0, 1.0], has_tail=[1, 1, 1, 1],
                         new_file=False, bound=1e-6)
    r = certificate_records(ds, "poisson", 64)
    assert r["oracle_norm"] and np.allclose(r["radius_certificate"].ravel(), [1e-6, 1e-6, 1 + 1e-6, 1 + 1e-6])
    s = summarize(ds, n_boot=0)
    assert s["budgets"][0]["coverage_certificate"]["covered"] == 3 and "oracle" in s["floor"]["relative_to"]


def calibration_records():
    """100 records with V̂ = 1/2, B̂ = 0, n = 2, no arithmetic bound: r_EB(δ) = sqrt(ln(4/δ)) exactly
    (:func:`truncsens.certificates.estimator.eb_sum_radius`): 1.731, 1.921, 2.093, 2.448 at δ = 0.2,
    0.1, 0.05, 0.01. Errors 1.0 (80 records), 1.8 (10), 2.0 (5), 2.3 (4), 3.0 (1): coverage at
    nominal q is exactly q for q = 80, 90, 95, 99 %."""
    error = np.repeat([1.0, 1.8, 2.0, 2.3, 3.0], [80, 10, 5, 4, 1])
    return {"attn_error": error, "attn_variance": np.full(100, 0.5), "value_range": np.zeros(100),
            "n_random": np.full(100, 2.0), "has_tail": np.ones(100), "arith_bound": np.zeros(100)}


def test_calibration_rates_and_wilson_intervals_equal_the_hand_values():
    rel = reliability(calibration_records())
    assert [r["nominal"] for r in rel] == pytest.approx([0.8, 0.9, 0.95, 0.99])
    for r, k in zip(rel, (80, 90, 95, 99)):
        c = r["certificate"]
        assert (c["covered"], c["n"], c["rate"]) == (k, 100, k / 100)
        assert c["ci"] == pytest.approx(wilson(k, 100), abs=1e-12)
        assert r["eb"]["covered"] == k  # no arithmetic bound: the certificate is r_EB
        assert r["certificate_above_floor"]["n"] == 100  # b = 0: no record at the floor (errors > 0)
        # median of r/e over 100 records: the 80 records at error 1 hold the middle
        assert r["tightness"]["median_ratio"] == pytest.approx(math.sqrt(math.log(4 / r["delta"])))
    # the formula by hand at 95 / 100: centre 0.969207 / 1.038415 = 0.93335, half 1.8875 · sqrt(0.000571) = 0.04510
    assert wilson(95, 100) == pytest.approx((0.88825, 0.97845), abs=5e-5)


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")  # one radius for all: no Spearman
def test_calibration_per_budget_in_the_summary():
    rec = calibration_records()
    ds = records_dataset(rec["attn_error"], np.sqrt(np.log(80)) * np.ones(100), hat_norm=np.ones(100),
                         norm=np.ones(100), has_tail=np.ones(100), variance=rec["attn_variance"], bound=0.0)
    s = summarize(ds, n_boot=0)
    cal = s["budgets"][0]["calibration"]
    assert [c["certificate"]["covered"] for c in cal] == [80, 90, 95, 99]
    assert [c["certificate"]["ci"] for c in cal] == [pytest.approx(wilson(k, 100), abs=1e-12) for k in (80, 90, 95, 99)]
    assert s["budgets"][0]["coverage_certificate"]["covered"] == 95  # the run's delta 0.05


def test_tightness_leaves_out_zero_errors():
    assert tightness(np.array([0.0, 2.0, 3.0, np.nan]), np.array([0.0, 1.0, 1.0, 1.0])) == {"median_ratio": 2.5, "n": 2}


def test_heldout_reading_keeps_the_documents_after_the_first():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("certify_heldout",
                                                  Path(__file__).parents[1] / "benchmarks" / "certify_heldout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ds = records_dataset([0.1] * 6, [1.0] * 6, hat_norm=[1.0] * 6, norm=[1.0] * 6, has_tail=[1] * 6,
                         docs=["a", "a", "b", "b", "c", "c"])
    assert list(mod.heldout(ds, 1)["doc"].values) == ["b", "b", "c", "c"]
    with pytest.raises(ValueError, match="--skip-docs"):
        mod.heldout(ds, 3)


def test_statistical_radius_and_emitted_certificate_have_their_own_coverage():
    # r_EB misses two tiny errors (1e-9 relative, r_EB = 0) that the tolerance tau ||o^|| covers, covers 0.5,
    # and misses 2.0: r_EB alone 1 / 4, the emitted certificate (tau = 64 eps = 7.63e-6) 3 / 4
    v = 1 / (2 * math.log(80))  # r_EB(0.05) = 1 recomputed from V^ (B^ = 0, n = 2)
    ds = records_dataset([1e-9, 1e-9, 0.5, 2.0], [0.0, 0.0, 1.0, 1.0], hat_norm=[1.0] * 4, norm=[1.0] * 4,
                         has_tail=[1] * 4, variance=[0.0, 0.0, v, v])
    s = summarize(ds, n_boot=0)
    b = s["budgets"][0]
    assert (b["coverage_eb"]["covered"], b["coverage_certificate"]["covered"]) == (1, 3)
    assert [c["covered"] for c in b["coverage_eb_by_layer"]] == [1]
    # tau curve at the run's delta: tau <= 1e-10 leaves the 1e-9 errors out; tau >= 1e-8 takes them in
    curve = {t["tau"]: t["coverage"]["covered"] for t in b["tolerance_curve"]}
    assert curve == {0.0: 1, 1e-10: 1, 1e-8: 3, 1e-7: 3, 1e-6: 3, F32: 3}
    st = s["statements"]
    at95 = [d for d in st["statistical"]["by_delta"] if d["delta"] == 0.05][0]
    assert (at95["coverage"]["covered"], at95["coverage"]["n"]) == (1, 4)
    assert at95["coverage"]["ci"] == pytest.approx(wilson(1, 4), abs=1e-12)
    assert at95["by_budget"][0]["budget"] == 64 and at95["by_budget"][0]["by_layer"][0]["covered"] == 1
    em = [d for d in st["emitted"]["by_delta"] if d["delta"] == 0.05][0]
    assert (em["coverage"]["covered"], em["coverage"]["ci"]) == (3, pytest.approx(wilson(3, 4), abs=1e-12))
    assert st["emitted"]["tolerance_relative"] == F32 and "not a rounding bound" in st["emitted"]["tolerance_is"]
    assert "tolerance" in st["emitted"]["says"] and "r_EB alone" in st["statistical"]["says"]
    pooled_curve = [d for d in st["emitted"]["tolerance_curve_by_delta"] if d["delta"] == 0.05][0]["curve"]
    assert [t["coverage"]["covered"] for t in pooled_curve] == [1, 1, 3, 3, 3, 3]
    text = format_summary(s)
    assert "statement 1, statistical" in text and "statement 2, emitted certificate" in text
    assert "a declared tolerance" in text and "arithmetic bound" not in text
    assert "coverage of r_EB alone by layer" in text and "against the tolerance tau" in text
    lines = text.splitlines()
    above = lines.index([ln for ln in lines if ln.startswith("calibration over the records above the floor")][0])
    assert lines[above + 1].split()[-1] == "records"  # its own table follows its title


def test_tolerance_curve_refuses_a_negative_tolerance():
    with pytest.raises(ValueError, match="taus"):
        tolerance_curve(np.zeros(2), np.zeros(2), np.ones(2), [0.0, -1e-6])


def test_variance_check_per_head_by_hand():
    from truncsens.certificates.statistics import variance_check

    # [target 4, layer 1, head 2]; head 0: V^ 1 each, errors 2, 2, 0, 0 -> MSE 2, E[V^]/MSE 0.5;
    # n = 1, 2, 5, 9 -> half below 5. Head 1: the last record has no tail and is left out
    rec = {"attn_error": np.array([[[2.0, 1.0]], [[2.0, 1.0]], [[0.0, 1.0]], [[0.0, 9.0]]]),
           "attn_variance": np.array([[[1.0, 3.0]], [[1.0, 3.0]], [[1.0, 3.0]], [[1.0, 0.0]]]),
           "n_random": np.array([[[1, 9]], [[2, 9]], [[5, 9]], [[9, 0]]]),
           "has_tail": np.array([[[1, 1]], [[1, 1]], [[1, 1]], [[1, 0]]])}
    c = variance_check(rec)
    h = c["by_head"]
    assert h["variance_over_mse"] == [[0.5, 3.0]] and h["share_few_tail_keys"] == [[0.5, 0.0]]
    assert h["mse"] == [[2.0, 1.0]] and h["n"] == [[4, 3]]
    assert c["variance_over_mse"] == pytest.approx((4 + 9) / 7 / ((8 + 3) / 7))  # every record with a tail
    with pytest.raises(ValueError, match="few"):
        variance_check(rec, few=0)
    s = summarize(records_dataset([1e-9, 1e-9, 0.5, 2.0], [0.0, 0.0, 1.0, 1.0], hat_norm=[1.0] * 4, norm=[1.0] * 4,
                                  has_tail=[1] * 4, variance=[0.0, 0.0, 0.5, 0.5], n_random=[2, 2, 8, 8]), n_boot=0)
    v = s["budgets"][0]["variance_check"]  # mean V^ 0.25 over mean error^2 (0.25 + 4) / 4
    assert v["by_head"]["variance_over_mse"][0][0] == pytest.approx(0.25 / ((2e-18 + 0.25 + 4) / 4))
    assert v["by_head"]["share_few_tail_keys"] == [[0.5]]
    assert "variance check" in format_summary(s)


def test_tail_mass_by_hand_and_in_the_variance_check():
    from truncsens.certificates.statistics import variance_check

    rec = floor_head_records()
    # row 0: the tail logits -2000 hold no mass (exp(-2000) = 0 in float64); row 1: two tail keys at -30
    # among 1 + e^0.5 + 2 e^-30
    assert rec.tail_mass[0] == 0
    assert float(rec.tail_mass[1]) == pytest.approx(2 * math.exp(-30) / (1 + math.exp(0.5) + 2 * math.exp(-30)), rel=1e-12)
    ones = np.ones((2, 1, 1))
    c = variance_check({"attn_error": ones, "attn_variance": ones, "n_random": 9 * ones, "has_tail": ones,
                        "tail_mass": np.array([[[0.0]], [[0.3]]])})
    assert c["by_head"]["median_tail_mass"] == [[0.15]] and c["by_head"]["share_negligible_tail_mass"] == [[0.5]]
    assert "median_tail_mass" not in variance_check({k: v for k, v in
                                                     {"attn_error": ones, "attn_variance": ones, "n_random": ones,
                                                      "has_tail": ones}.items()})["by_head"]


def test_coverage_of_r_eb_apart_where_the_tail_holds_no_mass():
    from truncsens.certificates.statistics import coverage_by_tail_mass

    # masses 0, 1e-9 (negligible: errors 1e-9, 0 under r_EB 0 -> 1 of 2 covered, V^ 0) and 0.2, 0.5 (errors
    # 0.5, 2.0 under r_EB 1 -> 1 of 2, V^ 1 each over MSE (0.25 + 4) / 2)
    rec = {"attn_error": np.array([1e-9, 0.0, 0.5, 2.0]), "attn_variance": np.array([0.0, 0.0, 1.0, 1.0]),
           "has_tail": np.ones(4), "tail_mass": np.array([0.0, 1e-9, 0.2, 0.5])}
    c = coverage_by_tail_mass(rec, np.array([0.0, 0.0, 1.0, 1.0]))
    assert (c["negligible"]["coverage"]["covered"], c["negligible"]["coverage"]["n"]) == (1, 2)
    assert (c["with_mass"]["coverage"]["covered"], c["with_mass"]["coverage"]["n"]) == (1, 2)
    assert c["negligible"]["variance_over_mse"] == 0.0 and c["with_mass"]["variance_over_mse"] == pytest.approx(1 / 2.125)
    assert coverage_by_tail_mass({k: v for k, v in rec.items() if k != "tail_mass"}, np.zeros(4)) is None
    with pytest.raises(ValueError, match="threshold"):
        coverage_by_tail_mass(rec, np.zeros(4), threshold=0.0)


def test_summary_gives_r_eb_coverage_apart_by_tail_mass():
    v = 1 / (2 * math.log(80))  # r_EB(0.05) = 1
    ds = records_dataset([1e-9, 1e-9, 0.5, 2.0], [0.0, 0.0, 1.0, 1.0], hat_norm=[1.0] * 4, norm=[1.0] * 4,
                         has_tail=[1] * 4, variance=[0.0, 0.0, v, v])
    ds["attn_tail_mass"] = (ds["attn_error"].dims, np.array([0.0, 1e-9, 0.3, 0.6]).reshape(1, 4, 1, 1, 1))
    b = summarize(ds, n_boot=0)["budgets"][0]
    c = b["coverage_eb_by_tail_mass"]
    assert (c["negligible"]["coverage"]["covered"], c["negligible"]["coverage"]["n"]) == (0, 2)  # 1e-9 > r_EB = 0
    assert (c["with_mass"]["coverage"]["covered"], c["with_mass"]["coverage"]["n"]) == (1, 2)
    assert b["variance_check"]["by_head"]["share_negligible_tail_mass"] == [[0.5]]
    assert "statement 1 by the tail's attention mass" in format_summary(summarize(ds, n_boot=0))
