"""Per-window summaries: summarize_values, summarize, format_table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from truncsens import results
from truncsens.divergences import METRICS
from truncsens.report.summary import COUNTS, STATS, format_table, summarize, summarize_values


def test_summarize_values_by_hand():
    s = summarize_values(np.array([1.0, 2.0, 3.0, 4.0]))
    assert s["mean"] == 2.5
    # sample std = sqrt(((1.5^2 + 0.5^2) * 2) / 3) = sqrt(5/3); se = that / sqrt(4)
    assert s["se"] == pytest.approx(math.sqrt(5 / 3) / 2)
    assert s["median"] == 2.5
    # linear interpolation: rank 0.9 * 3 = 2.7 -> 3 + 0.7; rank 0.99 * 3 = 2.97 -> 3 + 0.97
    assert s["p90"] == pytest.approx(3.7)
    assert s["p99"] == pytest.approx(3.97)
    assert list(s) == list(COUNTS) + list(STATS) and (s["n"], s["n_inf"], s["n_nan"]) == (4, 0, 0)


def test_summarize_values_counts_nan_and_keeps_inf():
    # the instance: KL values [inf, .5, .5, .5] are n = 4 with one inf, and their mean is inf (not 0.5)
    s = summarize_values(np.array([np.inf, 0.5, 0.5, 0.5]))
    assert (s["n"], s["n_inf"], s["n_nan"]) == (4, 1, 0)
    assert s["mean"] == math.inf and math.isnan(s["se"]) and s["median"] == 0.5
    # sorted [.5, .5, .5, inf]: p90 at rank 2.7 interpolates towards inf -> inf; p50 at rank 1.5 -> 0.5
    assert s["p90"] == math.inf and s["p99"] == math.inf
    s = summarize_values(np.array([np.nan, 2.0, np.inf, 4.0]))
    assert (s["n"], s["n_inf"], s["n_nan"]) == (3, 1, 1)
    assert s["mean"] == math.inf and s["median"] == 4.0  # sorted [2, 4, inf], middle value
    s = summarize_values(np.array([np.nan, 2.0, 4.0]))
    assert (s["n"], s["n_inf"], s["n_nan"]) == (2, 0, 1)
    assert s["mean"] == 3.0 and s["se"] == pytest.approx(1.0)  # std (ddof 1) = sqrt(2), / sqrt(2)
    assert summarize_values(np.array([np.inf, -np.inf, 1.0]))["n_inf"] == 2
    assert math.isnan(summarize_values(np.array([np.inf, -np.inf, 1.0]))["mean"])


def test_summarize_values_small_samples():
    one = summarize_values(np.array([0.25]))
    assert one["mean"] == 0.25 and one["median"] == 0.25 and one["p99"] == 0.25
    assert math.isnan(one["se"])
    empty = summarize_values(np.array([np.nan]))
    assert (empty["n"], empty["n_nan"]) == (0, 1) and all(math.isnan(empty[k]) for k in STATS)
    assert all(math.isnan(summarize_values(np.array([]))[k]) for k in STATS)


def _attrs():
    return {
        "truncsens_version": "0.1.0", "model": "m", "model_revision": "", "tokenizer": "t", "dtype": "float32",
        "device": "cpu", "semantics": "reencode", "positions": "original", "n_sink": 0, "reference_context": 8,
        "corpus": "c", "corpus_sha256": "", "domain": "code", "seed": 0, "created": "", "command": "",
    }


def _ds():
    # 4 targets x 2 windows; tv column w=1: [0.1, 0.2, 0.3, 0.4], w=2: [0.0, 0.0, 0.0, nan]
    tv = np.array([[0.1, 0.0], [0.2, 0.0], [0.3, 0.0], [0.4, np.nan]])
    m = {name: np.zeros((4, 2)) for name in METRICS}
    m["tv"] = tv
    m["top1_agree"] = np.array([[1, 1], [0, 1], [0, 1], [0, 1]])
    return results.make_results(m, "window", [1, 2], ["a", "a", "b", "b"], [8, 9, 8, 9], [0, 1, 2, 3], _attrs())


def test_summarize_rows():
    rows = summarize(_ds(), ["tv", "top1_agree"])
    assert [(r["metric"], r["window"], r["n"]) for r in rows] == [
        ("tv", 1, 4), ("tv", 2, 3), ("top1_agree", 1, 4), ("top1_agree", 2, 4)]
    assert rows[0]["mean"] == pytest.approx(0.25)
    assert rows[0]["median"] == pytest.approx(0.25)
    # clustered by document: docs a = {0.1, 0.2}, b = {0.3, 0.4}; CR1 se^2 = G/(G-1) * sum_g (S_g - n_g mean)^2 / n^2
    #   = 2 * ((0.3 - 0.5)^2 + (0.7 - 0.5)^2) / 16 = 0.01  ->  se = 0.1 (the plain s/sqrt(n) would be 0.0645)
    assert rows[0]["se"] == pytest.approx(0.1)
    assert rows[1]["mean"] == 0.0 and rows[1]["se"] == 0.0
    assert rows[2]["mean"] == 0.25 and rows[3]["mean"] == 1.0
    assert "policy" not in rows[0]


def test_summarize_all_metrics_and_unknown():
    rows = summarize(_ds())
    assert len(rows) == len(METRICS) * 2
    assert [r["metric"] for r in rows[::2]] == list(METRICS)
    with pytest.raises(ValueError, match="unknown metric\\(s\\) kl2, foo; the file has tv, kl"):
        summarize(_ds(), ["kl2", "tv", "foo"])


def test_summarize_with_policies():
    m = {name: np.zeros((2, 3, 1)) for name in METRICS}
    m["tv"] = np.array([[[0.1], [0.2], [0.3]], [[0.5], [0.5], [0.8]]])
    ds = results.make_results(m, "budget", [16], ["a", "b", "c"], [1, 2, 3], [0, 0, 0], _attrs(),
                              policies=["suffix", "random"])
    rows = summarize(ds, ["tv"])
    assert [(r["policy"], r["budget"], r["n"]) for r in rows] == [("suffix", 16, 3), ("random", 16, 3)]
    assert rows[0]["mean"] == pytest.approx(0.2)
    assert rows[1]["mean"] == pytest.approx(0.6)
    assert rows[1]["median"] == pytest.approx(0.5)


def test_format_table():
    rows = summarize(_ds(), ["tv", "kl"])
    text = format_table(rows, "window")
    lines = text.splitlines()
    assert lines[0] == "tv"
    # the tv block has a NaN target at w=2: it gets the n_inf / n_nan columns and a note
    assert lines[1].split() == ["window", "n", "n_inf", "n_nan", "mean", "±", "se(doc)", "median", "p90", "p99"]
    assert lines[2].split() == ["1", "4", "0", "0", "0.25", "0.1", "0.25", "0.37", "0.397"]
    assert lines[3].split()[:5] == ["2", "3", "0", "1", "0"]
    assert lines[4].startswith("note: n counts the values that are not NaN")
    assert lines[5] == ""
    assert lines[6] == "kl"
    assert lines[7].split() == ["window", "n", "mean", "±", "se(doc)", "median", "p90", "p99"]  # all finite: no extra columns
    assert len(lines) == 10


def test_show_counts_an_infinite_kl():
    """A stored KL of +inf: the row says n = 4, n_inf = 1, mean inf (never a finite mean without the count)."""
    m = {name: np.zeros((4, 1)) for name in METRICS}
    m["kl"] = np.array([[np.inf], [0.5], [0.5], [0.5]])
    ds = results.make_results(m, "window", [4], ["a", "a", "b", "b"], [8, 9, 8, 9], [0, 1, 2, 3], _attrs())
    [row] = summarize(ds, ["kl"])
    assert (row["n"], row["n_inf"], row["n_nan"], row["mean"]) == (4, 1, 0, math.inf)
    lines = format_table([row], "window").splitlines()
    assert lines[2].split()[:5] == ["4", "4", "1", "0", "inf"]
    m["kl"] = np.array([[np.inf], [np.inf], [0.5], [0.25]])  # a second instance: two infinities
    [row] = summarize(results.make_results(m, "window", [4], ["a", "a", "b", "b"], [8, 9, 8, 9], [0, 1, 2, 3], _attrs()), ["kl"])
    assert (row["n"], row["n_inf"], row["mean"], row["median"]) == (4, 2, math.inf, math.inf)


def test_format_table_policy_titles():
    rows = [{"policy": "random", "metric": "tv", "budget": 8, "n": 2, "mean": 1.0, "se": float("nan"),
             "median": 1.0, "p90": 1.0, "p99": 1.0}]
    lines = format_table(rows, "budget").splitlines()
    assert lines[0] == "tv  (policy random)"
    assert lines[2].split() == ["8", "2", "1", "nan", "1", "1", "1"]
