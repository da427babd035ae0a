"""recommend-window and the fits on the issue's instances: measured crossing inside the measured
range, warnings at the reference context, laws that barely decay, exact zeros, infinite means,
the noise floor, optimizer convergence, per-layer KV windows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from truncsens.fits.points import KL_NOISE_FLOOR, TV_NOISE_FLOOR, classify_points
from truncsens.fits.curves import curves_of
from truncsens.fits.fitting import FitConfig, fit_curve, fit_datasets
from truncsens.budget.kv_spec import KVSpec, layer_windows_from_config
from truncsens.fits.laws import fit_family
from truncsens.budget.recommend import recommend
from truncsens.report.printed import _comparison_line, format_fit_report, format_recommendations
from truncsens.results.constructed import curve_results
from truncsens.budget.windows import cached_tokens_per_layer, kv_bytes_per_sequence, measured_crossings, window_for_eps, window_samples

POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# results files store float32: values agree with the exact curves to ~1e-7 relative


def bent_curve(C: float, alpha: float, w0: int, w1: int, eps: float, crossing: float):
    """Mean curve: C w^-alpha up to w0, then m(w1) chosen so that the log-log crossing of eps between w0 and w1
    lies at ``crossing`` (a curve that bends below the law, as near a finite reference context)."""
    m0 = C * w0**-alpha
    t = math.log(crossing / w0) / math.log(w1 / w0)
    m1 = math.exp(math.log(m0) + (math.log(eps) - math.log(m0)) / t)

    def f(w):
        w = np.asarray(w, dtype=float)
        return np.where(w <= w0, C * w**-alpha, np.where(w == w1, m1, m1 * (w / w1) ** -4.0))
    return f


def _doc(f, windows, n_ref, n_boot=20, metrics=("tv",), attrs=None, doc_noise=0.0, n_docs=6):
    ds = curve_results({m: f for m in metrics}, windows, n_docs=n_docs, doc_noise=doc_noise, seed=2,
                       reference_context=n_ref, attrs=attrs or {})
    return fit_datasets([ds], FitConfig(metrics=metrics, families=("power",), n_boot=n_boot), ["x.nc"]).to_json()


def test_measured_crossing_inside_the_range_not_the_law_543_vs_347():
    # the instance: the law says 543, the measurement crosses at 347 (here 346.5 -> window 347)
    eps = 0.01
    C = eps * 543**0.5
    doc = _doc(bent_curve(C, 0.5, 256, 512, eps, 346.5), POW2, 1024)
    [rec] = recommend(doc, [eps], "tv", kv_lookup=lambda m, d: (KVSpec(2, 2, 16, 4, "test"), "kv"))
    assert rec.w_law == pytest.approx(543.0, rel=1e-6) and rec.law_status == "ok"
    assert rec.measured_window == 512 and rec.measured_crossing == pytest.approx(346.5, rel=1e-5)
    assert rec.basis == "measured" and rec.window == 347
    assert rec.kv_bytes == 2 * 2 * 2 * 16 * 4 * 347  # the KV figure of the measured window, not of 543
    text = format_recommendations([rec])
    assert "347 " in text and "measured" in text and "543" in text


def test_short_reference_context_recommends_97_and_warns_that_770_reaches_n():
    # N = 256: the law (fitted on 4..32) says 770 >= N, the measurement says 97
    eps = 0.01
    doc = _doc(bent_curve(eps * 770**0.5, 0.5, 64, 128, eps, 96.5), [1, 2, 4, 8, 16, 32, 64, 128], 256)
    [rec] = recommend(doc, [eps], "tv")
    assert rec.w_law == pytest.approx(770.0, rel=1e-6)
    assert rec.window == 97 and rec.basis == "measured"
    assert any("the law's w(eps) = 770 (+0 sinks) reaches the reference context N = 256" in w for w in rec.warnings)
    # a law-based window that reaches N is warned about too: eps below every measured mean
    [low] = recommend(doc, [1e-4], "tv")
    assert low.basis == "law" and low.window == math.ceil(low.w_law) >= 256
    assert any("reaches the reference context N = 256" in w for w in low.warnings)


def test_window_beyond_the_models_whole_context_is_warned_once():
    """N = the model's context (1024) and the law's window 1600 exceeds it: one warning says eps is not
    reachable with this model's context; the N warning (implied) is left out. With a model context of
    4096 the window fits the model, and the N warning is the one given."""
    eps = 0.01
    f = lambda w: eps * (1599.5 / w) ** 0.5  # noqa: E731 - w(eps) = 1599.5 > every measured window
    [rec] = recommend(_doc(f, POW2, 1024, attrs={"max_context": 1024}), [eps], "tv")
    assert rec.basis == "law" and rec.window == 1600
    assert [w for w in rec.warnings if "context" in w] == [
        "w(eps) = 1600 (+0 sinks) exceeds the model's context of 1024 tokens: eps is not reachable with this model's context"]
    [roomy] = recommend(_doc(f, POW2, 1024, attrs={"max_context": 4096}), [eps], "tv")
    assert [w.split(":")[0] for w in roomy.warnings if "context" in w] == [
        "the law's w(eps) = 1600 (+0 sinks) reaches the reference context N = 1024"]


def test_measured_crossing_interval_from_the_document_bootstrap():
    ds = curve_results({"tv": lambda w: 0.05 * w**-0.5}, POW2, n_docs=30, doc_noise=0.3, seed=7)
    doc = fit_datasets([ds], FitConfig(metrics=("tv",), families=("power",), n_boot=200), ["x.nc"]).to_json()
    [rec] = recommend(doc, [0.005], "tv")  # 0.05 w^-0.5 = 0.005 at w = 100: between 64 and 128
    lo, hi = rec.measured_crossing_ci
    assert 64 <= lo <= rec.measured_crossing <= hi <= 128 and lo < hi
    means = np.array(doc["curves"][0]["metrics"]["tv"]["bootstrap_mean"])  # [200, 10]
    assert means.shape == (200, 10)
    from truncsens.stats import percentile_interval

    assert (lo, hi) == percentile_interval(measured_crossings(POW2, means, 0.005), 0.95, keep_inf=True)


def test_measured_crossings_by_hand():
    means = np.array([[0.1, 0.05, 0.02], [0.1, 0.2, 0.3], [0.01, 0.005, 0.001], [0.1, 0.0, 0.0]])
    out = measured_crossings([1, 2, 4], means, 0.03)
    t = (math.log(0.03) - math.log(0.05)) / (math.log(0.02) - math.log(0.05))
    assert out[0] == pytest.approx(2 * 2**t) and out[1] == math.inf and out[2] == 1.0 and out[3] == 2.0


def test_law_that_barely_decays_is_not_reachable():
    # the instance: TV = 0.3 w^-0.001, eps 0.1: (3)^1000 overflows a float
    assert window_for_eps(0.3, 0.001, 0.1) == math.inf
    assert window_for_eps(1.0, 1e-4, 1e-3) == math.inf  # 1000^10000
    assert window_for_eps(0.3, 0.5, 0.1) == pytest.approx(9.0)
    assert window_samples(np.array([0.3]), np.array([0.001]), 0.1)[0] == math.inf
    doc = _doc(lambda w: 0.3 * np.asarray(w, float) ** -0.001, POW2, 1024)
    [rec] = recommend(doc, [0.1], "tv")
    assert rec.law_status == "not_reachable" and rec.w_law == math.inf and rec.window is None
    js = json.loads(json.dumps(rec.to_json(), allow_nan=False))
    assert js["w_law"] is None and js["law_status"] == "not_reachable" and js["window"] is None
    assert "inf (eps not reachable with this law)" in format_recommendations([rec])


def test_a_law_that_did_not_converge_is_marked_and_never_used(monkeypatch):
    import scipy.optimize

    real = scipy.optimize.least_squares
    monkeypatch.setattr(scipy.optimize, "least_squares", lambda *a, **k: real(*a, **{**k, "max_nfev": 1}))
    x = np.array([4.0, 8, 16, 32, 64])
    y = np.log(0.02 * x**-0.5 + 1e-3)
    p = fit_family("power_floor", x, y, np.ones(5))
    assert p["converged"] is False and "status 0" in p["optimizer"]
    monkeypatch.setattr(scipy.optimize, "least_squares", real)
    assert fit_family("power_floor", x, y, np.ones(5))["converged"] is True
    assert fit_family("power", x, y, np.ones(5))["converged"] is True
    # a power fit marked not converged: recommend falls back to the measurement, or says none
    doc = _doc(lambda w: 0.02 * np.asarray(w, float) ** -0.5, POW2, 1024)
    doc["fits"][0].update(status="not_converged", converged=False, optimizer="scipy: status 0")
    inside, outside = recommend(doc, [0.0015, 1e-5], "tv")
    assert inside.basis == "measured" and inside.law_status == "not_converged" and inside.window is not None
    assert outside.window is None and outside.basis == "none"
    assert any("did not converge" in w for w in outside.warnings)
    text = format_fit_report({**doc, "fits": [doc["fits"][0]]})
    assert "NOT CONVERGED (not used)" in text


def test_exact_zero_is_a_measured_answer():
    # a sliding-window model measured beyond its window: D = 0 from w = 64 on
    f = lambda w: np.where(np.asarray(w) >= 64, 0.0, 0.02 * np.asarray(w, float) ** -0.5)  # noqa: E731
    doc = _doc(f, POW2, 1024)
    fit = doc["fits"][0]
    assert fit["status"] == "ok" and fit["fit_points"] == [4, 8, 16, 32] and fit["holdout_points"] == []
    assert doc["curves"][0]["metrics"]["tv"]["excluded"]["exact_zero_at"] == 64
    assert fit["params"]["alpha"]["value"] == pytest.approx(0.5, rel=1e-6)
    [rec] = recommend(doc, [1e-4], "tv")  # below every positive mean: D reaches 0 at 64
    assert rec.window == 64 and rec.basis == "measured" and rec.measured_crossing is None
    # all zero from the first window: no fit at all, still an answer
    zero = _doc(lambda w: np.zeros(np.shape(w)), POW2, 1024)
    assert zero["fits"][0]["status"] == "skipped" and "exactly 0 at window 1" in zero["fits"][0]["reason"]
    [rec] = recommend(zero, [0.01], "tv")
    assert rec.window == 1 and rec.basis == "measured"


def test_infinite_means_are_left_out_of_the_fit_and_said():
    ds = curve_results({"kl": lambda w: 1e-3 * np.asarray(w, float) ** -1.0}, POW2, n_docs=4, reference_context=1024)
    ds["kl"].loc[{"window": 256}] = ds["kl"].sel(window=256).values
    kl = ds["kl"].values.copy()  # [target, window]
    kl[0, 8] = np.inf  # one target at window 256 has q = 0 < p
    ds["kl"].values = kl
    [curve] = curves_of(ds, ["kl"])
    mean, _ = curve.mean_se("kl")
    assert mean[8] == math.inf and np.isfinite(mean[:8]).all()
    cf = fit_curve(curve, FitConfig(metrics=("kl",), families=("power",), n_boot=10))
    m = cf.metrics["kl"]
    assert m["excluded"]["infinite"] == [256] and m["n_inf"][8] == 1 and 256 in m["excluded_points"]
    assert cf.fits[0]["holdout_points"] == [512]
    assert any("256" in n and "infinite mean" in n for n in cf.notes)


def test_noise_floor_points_are_not_fitted():
    assert TV_NOISE_FLOOR == 1.5e-7 and KL_NOISE_FLOOR == 1e-13
    # TV 2e-8 where the exact value is 0 (the float32 reading): at the floor, left out
    cls = classify_points(np.array([4, 8, 16]), np.array([1e-3, 2e-8, 0.0]), "tv")
    assert cls.noise_floor == [8] and cls.zero == [16] and cls.exact_zero_at == 16 and cls.usable.tolist() == [True, False, False]
    f = lambda w: np.where(np.asarray(w) >= 256, 5e-14, 1e-3 * np.asarray(w, float) ** -1.0)  # noqa: E731
    doc = _doc(f, POW2, 1024, metrics=("kl",))
    assert doc["curves"][0]["metrics"]["kl"]["excluded"]["noise_floor"] == [256, 512]
    fit = doc["fits"][0]
    assert fit["holdout_points"] == [] and fit["params"]["alpha"]["value"] == pytest.approx(1.0, rel=1e-6)
    assert any("noise floor" in n for n in doc["curves"][0]["notes"])


def test_model_comparison_undecided_when_the_interval_contains_one():
    c = {"label": "x", "metric": "tv", "winner": "power_floor", "runner_up": "power", "basis": "extrapolation",
         "factor": {"value": 1.6, "ci": [0.115, 11.7]}, "undecided": True, "power_vs_exponential": None}
    assert "undecided between power_floor and power" in _comparison_line(c) and "wins" not in _comparison_line(c)
    c2 = {**c, "factor": {"value": 3.0, "ci": [1.5, 6.0]}, "undecided": False}
    assert "power_floor wins held-out extrapolation" in _comparison_line(c2)
    from truncsens.fits.comparison import ratio_undecided

    assert ratio_undecided([0.115, 11.7]) and ratio_undecided([0.9, 1.0]) and not ratio_undecided([1.01, 2])
    assert not ratio_undecided(None)


def test_per_layer_kv_windows_from_configs():
    from transformers import Gemma2Config

    g = Gemma2Config(num_hidden_layers=4, sliding_window=64)
    assert layer_windows_from_config(g) == (64, None, 64, None)
    qwen = {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}
    assert layer_windows_from_config(qwen) == (None, None, 32, 32)
    assert layer_windows_from_config({**qwen, "use_sliding_window": False}) == (None,) * 4
    assert layer_windows_from_config({"num_hidden_layers": 2, "sliding_window": 4096}) == (4096, 4096)  # Mistral v0.1
    assert layer_windows_from_config({"num_hidden_layers": 2}) == (None, None)
    assert cached_tokens_per_layer([64, None, 64, None], 100, 4) == [64, 104, 64, 104]
    assert cached_tokens_per_layer([64, None], 10, 0) == [10, 10]
    spec = KVSpec(4, 2, 16, 2, "gemma", (64, None, 64, None))
    assert spec.bytes_for(100, 4) == 2 * 2 * 16 * 2 * (64 + 104 + 64 + 104)
    assert kv_bytes_per_sequence(4, 2, 16, 2, 100, 4) == 2 * 4 * 2 * 16 * 2 * 104  # all full
    with pytest.raises(ValueError):
        KVSpec(2, 2, 16, 2, "bad", (64,))


def test_kv_spec_for_a_sliding_window_checkpoint(tmp_path):
    from transformers import Qwen2Config

    from truncsens.budget.kv_spec import kv_spec_for_model

    Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, use_sliding_window=True,
                sliding_window=32, max_window_layers=2).save_pretrained(tmp_path)
    spec, note = kv_spec_for_model(str(tmp_path), "float32")
    assert spec.layer_windows == (None, None, 32, 32)
    assert spec.bytes_for(100) == 2 * 2 * 16 * 4 * (100 + 100 + 32 + 32)
    assert "2 sliding-window layers (W = 32)" in note


def test_a_metric_missing_from_the_fit_says_whether_a_refit_can_help():
    """A known metric the fit lacks: refit with it; an unknown name: no refit can give it."""
    from truncsens.fits.laws import FitError

    doc = _doc(lambda w: 0.5 * np.asarray(w, float) ** -0.5, POW2, 1024, n_boot=0)
    with pytest.raises(FitError, match=r"no power law for metric 'kl' \(it has: tv\); refit with --metric kl"):
        recommend(doc, [0.01], "kl")
    with pytest.raises(FitError, match=r"'bogus' is no metric truncsens measures; use one of those"):
        recommend(doc, [0.01], "bogus")


@pytest.mark.parametrize("metric", ["top1_agree", "nll_ref", "nll_kept"])
def test_a_metric_that_is_no_divergence_gets_no_window(metric):
    """top1_agree rises with w and the NLLs do not fall to 0: "the window where D(w) <= eps" would be
    w = 1 for top1_agree at any eps, so it is refused, naming the divergences."""
    from truncsens.budget.windows import check_eps

    with pytest.raises(ValueError, match=rf"^metric {metric} \(--metric\) is not a divergence .* use one of tv, kl, "
                                         r"kl_reverse, js$"):
        check_eps(0.9, metric)
    assert check_eps(0.9, "kl") == 0.9
