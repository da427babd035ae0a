"""certify --draws D and --variance: repeated Poisson draws of one target equal single-draw runs with
the same seeds, the squared error over the draws against V̂ by hand, the bias-corrected variance
against a naive loop, and the file, report, refusals and resume of both options."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import sharp_tiny_llama
from truncsens import results
from truncsens.certificates.config import CertifyConfig, CertifyError
from truncsens.certificates.draw_report import draw_check, eb_coverage_by_variance
from truncsens.certificates.driver import DRAW_VARS, compute_arrays, run_certify, shard_dataset
from truncsens.certificates.estimator import attention_records, eb_sum_radius
from truncsens.certificates.passes import certify_batch
from truncsens.cli.main import app
from truncsens.engine.config import MeasureError
from truncsens.engine.run.shards import MeasureInterrupted
from truncsens.engine.semantics import SEMANTICS
from truncsens.engine.sweep import Sweep
from truncsens.policies import make_policy
from truncsens.policies.poisson_design import hajek_bias
from truncsens.results.schema import REQUIRED_ATTRS
from truncsens.targets import TargetSet, doc_seed

runner = CliRunner()


def naive_bias(logits, values, kept, pi, tail):
    """-(1/Ẑ²) Σ_{S∩tail} (1 − π)/π² w² (v − ô), one key at a time (docs/method.md section 5)."""
    n, d = len(logits), len(values[0])
    w = [float(np.exp(logits[i])) for i in range(n)]
    z = sum(w[i] / pi[i] for i in range(n) if kept[i])
    o_hat = [sum(w[i] / pi[i] * values[i][c] for i in range(n) if kept[i]) / z for c in range(d)]
    b = [0.0] * d
    for i in range(n):
        if kept[i] and tail[i]:
            for c in range(d):
                b[c] -= (1 - pi[i]) / pi[i] ** 2 * w[i] ** 2 * (values[i][c] - o_hat[c]) / z ** 2
    return b, o_hat, z, w


def test_bias_and_corrected_variance_equal_a_naive_loop():
    logits = [0.3, -1.0, 2.0, 0.5, -0.2, 1.1]
    values = [[1.0, 0.0], [0.5, 2.0], [-1.0, 1.0], [3.0, -2.0], [0.0, 0.5], [2.0, 2.0]]
    kept = [True, True, False, True, True, True]
    pi = [1.0, 0.4, 0.3, 0.25, 0.6, 1.0]
    tail = [False, True, True, True, True, False]
    b, o_hat, z, w = naive_bias(logits, values, kept, pi, tail)
    t = lambda x, dt=torch.float64: torch.tensor(x, dtype=dt)  # noqa: E731
    got = hajek_bias(t(logits), t(values), t(kept, torch.bool), t(pi), t(tail, torch.bool))
    np.testing.assert_allclose(got.numpy(), b, rtol=1e-12)
    assert abs(b[0]) > 1e-3  # a real correction, not zero
    v_plain = sum((1 - pi[i]) / pi[i] ** 2 * w[i] ** 2 * sum((values[i][c] - o_hat[c]) ** 2 for c in range(2))
                  for i in range(6) if kept[i] and tail[i]) / z ** 2
    args = (t(logits), t(values), t([True] * 6, torch.bool), t(kept, torch.bool), t(pi), t(tail, torch.bool))
    plain = attention_records(*args)
    corrected = attention_records(*args, variance="hajek_bias")
    assert float(plain.variance) == pytest.approx(v_plain, rel=1e-12) and float(plain.variance_hajek) == float(plain.variance)
    assert float(corrected.variance) == pytest.approx(v_plain + b[0] ** 2 + b[1] ** 2, rel=1e-12)
    assert float(corrected.variance_hajek) == float(plain.variance)
    want = eb_sum_radius(corrected.variance, corrected.value_range, corrected.n_random, corrected.has_tail, 0.05)
    assert float(corrected.radius_eb) == float(want) > float(plain.radius_eb)
    with pytest.raises(ValueError, match="variance must be one of hajek, hajek_bias"):
        attention_records(*args, variance="bootstrap")


def test_draw_check_by_hand():
    # 2 targets x 3 draws x 1 layer x 2 heads; head 1 of target 1 has no random tail
    error = np.array([[[[1.0, 2.0]], [[3.0, 0.0]], [[1.0, 2.0]]],
                      [[[2.0, 5.0]], [[0.0, 5.0]], [[2.0, 5.0]]]])
    variance = np.array([[[[2.0, 1.0]], [[2.0, 1.0]], [[5.0, 4.0]]],
                         [[[1.0, 9.0]], [[1.0, 9.0]], [[4.0, 9.0]]]])
    has_tail = np.array([[[1, 1]], [[1, 0]]])
    out = draw_check(error, variance, has_tail)
    # head 0: MSE_r = (1 + 9 + 1)/3 = 11/3 and (4 + 0 + 4)/3 = 8/3; E[V]_r = 3 and 2
    mse0, ev0 = (11 / 3 + 8 / 3) / 2, (3 + 2) / 2
    assert out["by_head"]["mse"][0][0] == pytest.approx(mse0)
    assert out["by_head"]["mean_variance"][0][0] == pytest.approx(ev0)
    assert out["by_head"]["variance_over_mse"][0][0] == pytest.approx(ev0 / mse0)
    assert out["by_head"]["median_record_ratio"][0][0] == pytest.approx((3 / (11 / 3) + 2 / (8 / 3)) / 2)
    # head 1: target 0 only (MSE 8/3, E[V] 2)
    assert out["by_head"]["variance_over_mse"][0][1] == pytest.approx(2 / (8 / 3))
    assert out["by_head"]["n"] == [[2, 1]]
    assert out["variance_over_mse"] == pytest.approx((3 + 2 + 2) / (11 / 3 + 8 / 3 + 8 / 3))
    assert out["draws"] == 3 and out["n_records"] == 3
    with pytest.raises(ValueError, match="target, draw, layer, head"):
        draw_check(error[:, 0], variance[:, 0], has_tail)


def test_r_eb_coverage_with_each_variance_by_hand():
    error = np.array([1.0, 1.0, 1.0, 0.0])
    n = np.array([10.0, 10.0, 10.0, 10.0])
    value_range = np.zeros(4)
    small, large = np.full(4, 0.01), np.full(4, 1.0)
    out = eb_coverage_by_variance(error, {"hajek": small, "hajek_bias": large}, value_range, n, np.ones(4), deltas=(0.05,))
    # r = sqrt(2 V ln(4/δ)): 0.296 misses the errors of 1, 2.96 covers them
    assert out[0]["by_variance"]["hajek"]["covered"] == 1 and out[0]["by_variance"]["hajek_bias"]["covered"] == 4
    assert not out[0]["by_variance"]["hajek"]["reaches_nominal"] and out[0]["by_variance"]["hajek_bias"]["reaches_nominal"]


def _batch(model, ids, policies, k, seeds, **kw):
    return certify_batch(model, ids, policies, [k], seeds, 0.05, **kw)


def test_each_further_draw_equals_a_single_draw_run_with_its_seeds():
    model = sharp_tiny_llama(layers=2).double()
    B, T, k = 2, 40, 12
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(5))
    poisson, topk = make_policy("poisson", n_sink=2), make_policy("topk", n_sink=2)
    seeds = [[[11, 12]], [[11, 12]]]
    extra = [[[[21, 22], [31, 32]]], [[[21, 22], [31, 32]]]]  # draws 1 and 2 of each policy
    out = _batch(model, ids, [poisson, topk], k, seeds, draw_seeds=extra, variance="hajek_bias")
    one = _batch(model, ids, [poisson, topk], k, seeds)
    assert out.draws["error"].shape == (2, 1, 3, B, 2, 4)
    for name in ("error", "radius_eb", "kept_share", "tail_mass"):  # draw 0 is the run as before (radii: corrected V)
        if name != "radius_eb":
            torch.testing.assert_close(out.records[name], one.records[name], rtol=0, atol=0)
    torch.testing.assert_close(out.records["variance_hajek"], one.records["variance"], rtol=0, atol=0)
    torch.testing.assert_close(out.logprobs, one.logprobs, rtol=0, atol=0)
    for d, s in ((1, [21, 22]), (2, [31, 32])):
        alone = _batch(model, ids, [poisson], k, [[s]], variance="hajek_bias")
        for name in ("error", "variance", "value_range", "n_random", "o_hat_norm", "variance_hajek"):
            torch.testing.assert_close(out.draws[name][0, 0, d], alone.records[name][0, 0], rtol=0, atol=0)
    assert not torch.equal(out.draws["error"][0, 0, 1], out.draws["error"][0, 0, 2])  # independent draws
    for d in (1, 2):  # topk is not randomized: its one draw, repeated
        torch.testing.assert_close(out.draws["error"][1, 0, d], one.records["error"][1, 0], rtol=0, atol=0)


def test_draw_seeds_of_a_run_are_the_documented_strings(tmp_path):
    model = sharp_tiny_llama(layers=2).double()
    N, k, seed = 32, 10, 3
    g = torch.Generator().manual_seed(9)
    context = torch.randint(0, model.config.vocab_size, (2, N), generator=g)
    plan = TargetSet(["a.txt", "b.txt"], np.array([40, 77]), context, torch.tensor([1, 2]))
    poisson = make_policy("poisson", n_sink=2)
    sweep = Sweep("budget", [k], [k], [poisson], SEMANTICS["prefill_evict"])
    arrays = compute_arrays(model, plan, sweep, seed, 0.05, "cpu", 10_000, lambda n: None, draws=3)
    plain = compute_arrays(model, plan, sweep, seed, 0.05, "cpu", 10_000, lambda n: None)
    np.testing.assert_array_equal(arrays["records"]["error"], plain["records"]["error"])
    assert "draws" not in plain and arrays["draws"]["error"].shape == (1, 2, 1, 3, 2, 4)
    attrs = {**{a: "test" for a in REQUIRED_ATTRS}, "n_sink": 2, "seed": seed, "reference_context": N, "delta": 0.05,
             "semantics": "prefill_evict", "positions": "original", "dtype": "float64", "device": "cpu"}
    ds = shard_dataset(arrays, plan, sweep, attrs)  # the file a shard writes: every draw round-trips exactly
    back = results.load(results.save(ds, tmp_path / "s.nc"))
    for var, rec in DRAW_VARS.items():
        if rec in arrays["draws"]:
            np.testing.assert_array_equal(back[var].transpose("policy", "target", "budget", "certify_draw", "layer",
                                                              "head").values, arrays["draws"][rec])
    assert back["certify_draw"].values.tolist() == [0, 1, 2]
    for i, (doc, pos) in enumerate((("a.txt", 40), ("b.txt", 77))):
        for d in range(3):
            text = f"{doc}:{pos}:poisson:{k}" + (f":{d}" if d else "")  # draw 0: certify's seed as before
            alone = _batch(model, context[i : i + 1], [poisson], k, [[[doc_seed(seed, text)]]])
            got, want = arrays["draws"]["error"][0, i, 0, d], alone.records["error"][0, 0, 0].numpy()
            np.testing.assert_allclose(got, want, rtol=1e-12)  # batch of 2 against 1: float64 rounding only


BASE = ["certify", "--reference-context", "64", "--budgets", "25%", "--targets-per-doc", "2", "--max-docs", "2",
        "--no-progress"]


def test_a_run_with_draws_and_the_corrected_variance_writes_reads_and_reports_them(tmp_path, tiny_llama_dir, corpus_dir):
    args = ["--model", tiny_llama_dir, "--corpus", corpus_dir]
    res = runner.invoke(app, [*BASE, *args, "--out", str(tmp_path / "a.nc")])
    assert res.exit_code == 0, res.output
    assert "variance estimate" not in res.output and "own draws" not in res.output  # a default run: as before
    res = runner.invoke(app, [*BASE, *args, "--out", str(tmp_path / "b.nc"), "--draws", "3", "--variance", "hajek_bias",
                              "--json"])
    assert res.exit_code == 0, res.output
    a, b = results.load(tmp_path / "a.nc"), results.load(tmp_path / "b.nc")
    assert "certify_draw" not in a.dims and "attn_variance_hajek" not in a
    assert b.sizes["certify_draw"] == 3 and b.attrs["draws"] == 3 and b.attrs["variance"] == "hajek_bias"
    np.testing.assert_array_equal(b["attn_variance_hajek"].values, a["attn_variance"].values)
    np.testing.assert_array_equal(b["attn_error"].values, a["attn_error"].values)
    np.testing.assert_array_equal(b["draw_attn_error"].isel(certify_draw=0).values, a["attn_error"].values)
    assert (b["attn_variance"].values >= a["attn_variance"].values).all()
    summary = json.loads(res.output[res.output.index("{"):])
    draws = summary["budgets"][0]["draws"]
    sel = b.sel(policy="poisson", budget=16)
    get = lambda v: sel[v].transpose("target", "certify_draw", "layer", "head").values  # noqa: E731
    want = draw_check(get("draw_attn_error"), get("draw_attn_variance_hajek"), sel["has_tail"].values)
    assert draws["draw_check"]["hajek"]["variance_over_mse"] == pytest.approx(want["variance_over_mse"])
    mass = sel["attn_tail_mass"].values
    split = draws["draw_check_by_tail_mass"]["hajek"]
    low = draw_check(get("draw_attn_error"), get("draw_attn_variance_hajek"), (sel["has_tail"].values > 0) & (mass < 1e-7))
    assert split["negligible"]["n_records"] == low["n_records"]
    assert split["negligible"]["n_records"] + split["with_mass"]["n_records"] == want["n_records"]
    assert split["with_mass"]["variance_over_mse"] == pytest.approx(draw_check(
        get("draw_attn_error"), get("draw_attn_variance_hajek"), (sel["has_tail"].values > 0) & (mass >= 1e-7))["variance_over_mse"])
    tail = sel["has_tail"].values[:, None] > 0
    e = get("draw_attn_error")
    mask = np.broadcast_to(tail, e.shape)
    eb = eb_sum_radius(*(torch.as_tensor(get(v)) for v in ("draw_attn_variance", "draw_value_range", "draw_n_random")),
                       torch.as_tensor(np.array(mask)), 0.05)
    at_05 = [c for c in draws["eb_coverage_by_variance"] if c["delta"] == 0.05][0]["by_variance"]["hajek_bias"]
    assert at_05["n"] == int(mask.sum()) == 3 * int(tail.sum())
    assert at_05["covered"] == int((e[mask] <= eb.numpy()[mask]).sum())
    res = runner.invoke(app, [*BASE, *args, "--out", str(tmp_path / "c.nc"), "--draws", "2"])
    assert res.exit_code == 0 and "r_EB alone (no tolerance) with each variance estimate" in res.output
    assert "variance against the squared error over the run's own draws" in res.output


@pytest.mark.parametrize("extra,message", [
    (["--draws", "0"], "draws (--draws) must be at least 1, got 0"),  # measure's wording
    (["--variance", "bootstrap"], "variance (--variance) must be one of hajek, hajek_bias, got 'bootstrap'"),
    (["--semantics", "streaming", "--draws", "2"], "measured under prefill_evict only"),
    (["--semantics", "streaming", "--variance", "hajek_bias"], "measured under prefill_evict only"),
])
def test_bad_draws_or_variance_one_error_line_nothing_written(tmp_path, tiny_llama_dir, corpus_dir, extra, message):
    res = runner.invoke(app, [*BASE, "--model", tiny_llama_dir, "--corpus", corpus_dir, "--out", str(tmp_path / "c.nc"),
                              *extra])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CertifyError, match=message.split(" (")[0]):
        CertifyConfig(model=tiny_llama_dir, corpus=corpus_dir, **{k.strip("-"): (int(v) if v.isdigit() else v)
                                                                 for k, v in zip(extra[::2], extra[1::2])})


def test_resume_refuses_other_draws_and_reuses_its_own(tmp_path, tiny_llama_dir, corpus_dir, monkeypatch):
    import truncsens.certificates.driver as driver

    out = tmp_path / "r.nc"

    def cfg(resume, **kw):
        return CertifyConfig(model=tiny_llama_dir, corpus=corpus_dir, reference_context=64, budgets="25%", max_docs=4,
                             docs_per_shard=2, out=str(out), resume=resume, progress=False, **kw)

    real = driver.run_sharded
    monkeypatch.setattr(driver, "run_sharded", lambda run: real(run, stop_after_shards=1))  # as a killed run
    with pytest.raises(MeasureInterrupted):
        run_certify(cfg(False, draws=2))
    monkeypatch.setattr(driver, "run_sharded", real)
    for other in (dict(draws=3), dict(), dict(draws=2, variance="hajek_bias")):
        with pytest.raises(MeasureError, match="draws|variance"):
            run_certify(cfg(True, **other))
    assert run_certify(cfg(True, draws=2)).shards_reused == 1
