"""Window budgets w(eps) and KV memory (truncsens.budget.windows, truncsens.budget.kv_spec, truncsens.budget.recommend)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from truncsens.fits.fit_file import write_fit_file
from truncsens.fits.fitting import FitConfig, fit_datasets
from truncsens.budget.kv_spec import KVSpec, kv_spec_for_model
from truncsens.fits.laws import FitError
from truncsens.budget.recommend import load_or_fit, recommend
from truncsens.report.printed import format_recommendations
from truncsens.stats import percentile_interval
from truncsens.budget.windows import check_eps, kv_bytes_per_sequence, measured_window, window_for_eps, window_samples
from truncsens.results import load, save
from truncsens.results.constructed import curve_results

POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_check_eps():
    assert check_eps(0.01, "tv") == 0.01
    assert check_eps(1.0, "tv") == 1.0
    assert check_eps(3.0, "kl") == 3.0
    for bad, metric in ((0.0, "tv"), (-1e-3, "kl"), (math.nan, "tv"), (math.inf, "kl"), (1.5, "tv"), (0.7, "js"), ("x", "tv")):
        with pytest.raises(ValueError, match="eps"):
            check_eps(bad, metric)


def test_window_for_eps_by_hand():
    assert window_for_eps(0.1, 0.5, 0.01) == pytest.approx(100.0, rel=1e-15)  # (10)^2
    assert window_for_eps(0.02, 1.0, 0.001) == pytest.approx(20.0, rel=1e-15)
    for C, a in ((0.1, 0.0), (0.1, -0.3), (0.1, math.nan), (0.0, 0.5)):
        with pytest.raises(ValueError):
            window_for_eps(C, a, 0.01)
    w = window_samples(np.array([0.1, 0.1, 0.1, -1.0]), np.array([0.5, 1.0, -0.2, 0.5]), 0.01)
    assert w[0] == pytest.approx(100.0) and w[1] == pytest.approx(10.0) and w[2] == math.inf and math.isnan(w[3])


def test_interval_handles_infinite_samples():
    assert percentile_interval(np.arange(101.0), keep_inf=True) == pytest.approx((2.5, 97.5))
    lo, hi = percentile_interval(np.r_[np.arange(90.0), np.full(10, np.inf)], keep_inf=True)
    assert lo == pytest.approx(2.475) and hi == math.inf
    assert all(math.isnan(v) for v in percentile_interval(np.array([np.nan]), keep_inf=True))


def test_measured_window_and_crossing_by_hand():
    windows, means = [1, 2, 4, 8], [0.1, 0.05, 0.02, 0.01]
    w, cross = measured_window(windows, means, 0.03)
    t = (math.log(0.03) - math.log(0.05)) / (math.log(0.02) - math.log(0.05))
    assert w == 4 and cross == pytest.approx(math.exp(math.log(2) + t * math.log(2)))
    assert measured_window(windows, means, 0.02) == (4, pytest.approx(4.0))
    assert measured_window(windows, means, 0.2) == (1, None)
    assert measured_window(windows, means, 0.001) == (None, None)
    # unsorted; a mean of exactly 0 reaches every eps (D = 0 is a measured answer), +inf never does
    assert measured_window([4, 1, 2], [0.02, 0.0, 0.05], 0.03) == (1, None)
    assert measured_window([1, 2, 4, 8], [0.1, 0.05, 0.0, 0.0], 0.01) == (4, None)
    assert measured_window([1, 2, 4], [0.05, math.inf, 0.02], 0.03) == (4, None)


def test_kv_bytes_by_hand(tmp_path):
    assert kv_bytes_per_sequence(2, 2, 16, 4, 100, 4) == 2 * 2 * 2 * 16 * 4 * 104
    with pytest.raises(ValueError):
        kv_bytes_per_sequence(0, 2, 16, 4, 10)
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3).save_pretrained(tmp_path)
    spec, note = kv_spec_for_model(str(tmp_path), "bfloat16")
    assert spec == KVSpec(3, 2, 16, 2, str(tmp_path / "config.json"))
    assert spec.bytes_for(10, 2) == 2 * 3 * 2 * 16 * 2 * 12
    assert "3 layers" in note
    none, note = kv_spec_for_model("synthetic:0.5", "float32")
    assert none is None and "is a synthetic source, not a transformer with a KV cache" in note


def _fit_doc(tmp_path, model="synthetic-curve", n_sink=0, C=0.02, alpha=0.5, max_context=None):
    attrs = {"model": model, "n_sink": n_sink}
    if max_context:
        attrs["max_context"] = max_context
    ds = curve_results({"tv": lambda w: C * w**-alpha, "kl": lambda w: 1e-3 * w**-1.0}, POW2, n_docs=30,
                       doc_noise=0.15, seed=3, attrs=attrs)
    save(ds, tmp_path / "r.nc")
    return fit_datasets([load(tmp_path / "r.nc")], FitConfig(metrics=("tv", "kl"), n_boot=300), [tmp_path / "r.nc"]).to_json()


def test_recommend_is_the_law_exactly_with_interval_and_warnings(tmp_path):
    doc = _fit_doc(tmp_path)
    p = next(f for f in doc["fits"] if f["metric"] == "tv" and f["family"] == "power")["params"]
    recs = recommend(doc, [0.006, 0.0001], "tv")  # 0.006 lies between D(8) ~ 0.0071 and D(16) ~ 0.005
    assert [r.eps for r in recs] == [0.006, 0.0001]
    inside, beyond = recs
    assert inside.w_law == pytest.approx((p["C"]["value"] / 0.006) ** (1 / p["alpha"]["value"]), rel=1e-12)
    assert inside.w_law_ci[0] < inside.w_law < inside.w_law_ci[1]
    assert inside.measured_window == 16 and 8 < inside.measured_crossing <= 16
    # inside the measured range the measurement is the answer, with its own bootstrap interval
    assert inside.basis == "measured" and inside.window == math.ceil(inside.measured_crossing)
    assert inside.measured_crossing_ci[0] <= inside.measured_crossing <= inside.measured_crossing_ci[1]
    assert inside.window_ci == tuple(float(math.ceil(c)) for c in inside.measured_crossing_ci)
    assert inside.eps_in_measured_range and not inside.warnings
    assert beyond.basis == "law" and beyond.window == math.ceil(beyond.w_law)
    assert inside.kv_bytes is None and any("synthetic source" in n for n in inside.notes)
    assert beyond.w_law == pytest.approx((0.02 / 1e-4) ** 2, rel=0.15)  # ~40000 tokens
    assert any("beyond the largest measured window" in w for w in beyond.warnings)
    assert any("reaches the reference context N = 1024" in w for w in beyond.warnings)
    assert not beyond.eps_in_measured_range and beyond.measured_window is None
    text = format_recommendations(recs)
    assert "warning:" in text and "0.006" in text
    assert recs[0].to_json()["w_law"] == inside.w_law


def test_recommend_errors(tmp_path):
    doc = _fit_doc(tmp_path)
    with pytest.raises(ValueError, match="eps"):
        recommend(doc, [1.5], "tv")
    with pytest.raises(ValueError, match="eps"):
        recommend(doc, [0.0], "tv")
    with pytest.raises(FitError, match="js"):
        recommend(doc, [0.01], "js")
    rising = _fit_doc(tmp_path, C=0.001, alpha=-0.3)  # means 0.001 .. 0.0065: nothing measured reaches 5e-4
    [rec] = recommend(rising, [5e-4], "tv")
    assert rec.law_status == "not_reachable" and rec.window is None and rec.w_law == math.inf
    assert any("does not decrease" in w for w in rec.warnings)
    assert "inf (eps not reachable with this law)" in format_recommendations([rec])


def test_recommend_kv_memory_from_a_local_config(tmp_path):
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3).save_pretrained(model_dir)
    doc = _fit_doc(tmp_path, model=str(model_dir), n_sink=4)
    [rec] = recommend(doc, [0.005], "tv")
    assert rec.kv_bytes == 2 * 3 * 2 * 16 * 4 * (rec.window + 4)  # float32 attr: 4 bytes
    assert rec.kv_bytes_ci[0] <= rec.kv_bytes <= rec.kv_bytes_ci[1]


def test_load_or_fit_reads_fits_and_results(tmp_path):
    doc = _fit_doc(tmp_path)
    write_fit_file(doc, tmp_path / "f.json")
    assert load_or_fit(tmp_path / "f.json", ["tv"])["fits"] == doc["fits"]
    fresh = load_or_fit(tmp_path / "r.nc", ["tv"], FitConfig(n_boot=50))
    assert {f["metric"] for f in fresh["fits"]} == {"tv"} and fresh["settings"]["bootstrap"] == 50
    (tmp_path / "junk.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a NetCDF"):
        load_or_fit(tmp_path / "junk.txt", ["tv"])
    with pytest.raises(FileNotFoundError):
        load_or_fit(tmp_path / "nope.json", ["tv"])


def test_kv_spec_from_a_cached_hub_config(monkeypatch):
    """A hub id is looked up in the local cache only (local_files_only=True), never fetched."""
    import transformers
    from transformers import Qwen2Config

    calls = []

    def cached(name, **kwargs):
        calls.append((name, kwargs))
        if name != "Org/Cached-Model":
            raise OSError("not in the cache")
        return Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", cached)
    spec, note = kv_spec_for_model("Org/Cached-Model", "bfloat16")
    assert spec is not None and (spec.layers, spec.kv_heads, spec.head_dim, spec.bytes_per_element) == (24, 2, 64, 2)
    assert spec.bytes_for(1000, 4) == 2 * 24 * 2 * 64 * 2 * 1004 and "24 layers" in note
    assert all(kw.get("local_files_only") for _, kw in calls)
    none, note = kv_spec_for_model("Org/Not-Cached", "bfloat16")
    assert none is None and "not available locally" in note


def test_budget_sweeps_count_their_sinks_once(tmp_path):
    """A retention budget k already holds the sinks: KV bytes use k, not k + n_sink,
    while a window w with n_sink sinks costs w + n_sink."""
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3).save_pretrained(model_dir)
    per_token = 2 * 3 * 2 * 16 * 4  # K and V, 3 layers, 2 kv heads, head dim 16, float32
    for sweep, extra in (("window", 4), ("budget", 0)):
        ds = curve_results({"tv": lambda w: 0.02 * w**-0.5}, POW2, n_docs=10, doc_noise=0.1, seed=5,
                           attrs={"model": str(model_dir), "n_sink": 4})
        if sweep == "budget":
            ds = ds.rename({"window": "budget"})
            ds.attrs["policy"] = "sink_recent"
        save(ds, tmp_path / f"{sweep}.nc")
        doc = fit_datasets([load(tmp_path / f"{sweep}.nc")], FitConfig(metrics=("tv",), families=("power",), n_boot=50),
                           [tmp_path / f"{sweep}.nc"]).to_json()
        [rec] = recommend(doc, [0.004], "tv")
        assert rec.n_sink == extra and rec.kv_bytes == per_token * (rec.window + extra), sweep
