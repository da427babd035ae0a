"""The synthetic lagged-copy source: spec, weights, forward pass, corpus, implied exponents."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from truncsens.divergences import kl, tv
from truncsens.results.constructed import curve_results
from truncsens.models.synthetic import (COPY_STRENGTH, FLOOR, SCALE, SyntheticLM, lag_weights,
                                 load_synthetic, parse_spec, synthetic_documents, tail_mass)


def test_parse_spec():
    s = parse_spec("synthetic:0.5")
    assert (s.kind, s.exponent, s.max_lag, s.alpha_tv, s.alpha_kl) == ("power", 0.5, 1024, 0.5, 1.0)
    g = parse_spec("synthetic-geometric:0.02:256")
    assert (g.kind, g.exponent, g.max_lag) == ("geometric", 0.02, 256)
    for bad in ("synthetic", "synthetic:", "synthetic:abc", "synthetic:-1", "synthetic:0", "synthetic:inf",
                "synthetic-foo:0.5", "synthetic:0.5:4", "synthetic:0.5:1:2"):
        with pytest.raises(ValueError, match="synthetic"):
            parse_spec(bad)


def test_tail_mass_and_lag_weights_by_hand():
    s = parse_spec("synthetic:0.5:16")
    g4 = SCALE * 4**-0.5  # 0.1
    assert tail_mass(s, 4) == pytest.approx(g4 / (1 + g4), rel=1e-14)
    assert tail_mass(s, 0) == pytest.approx(1 - FLOOR)
    assert tail_mass(s, 16) == 0.0
    lam = lag_weights(s)
    assert lam.shape == (17,)
    assert lam.sum() == pytest.approx(1.0, abs=1e-14)
    assert lam[0] == FLOOR
    t1, t2 = SCALE / (1 + SCALE), SCALE * 2**-0.5 / (1 + SCALE * 2**-0.5)
    assert lam[1] == pytest.approx(1 - FLOOR - t1, rel=1e-14)
    assert lam[2] == pytest.approx(t1 - t2, rel=1e-14)
    g15 = SCALE * 15**-0.5
    assert lam[16] == pytest.approx(g15 / (1 + g15), rel=1e-14)  # lag L collects the whole tail
    # mass dropped by a window of w tokens is exactly T(w): sum of lam beyond w
    assert lam[5:].sum() == pytest.approx(tail_mass(s, 4), rel=1e-12)
    # lam_k = -dT/dk ~ m beta k^-(1+beta) / (1 + g)^2 for large k
    big = parse_spec("synthetic:0.5:100000")
    lam_big = lag_weights(big)
    g = SCALE * 5000**-0.5
    assert lam_big[5000] / (SCALE * 0.5 * 5000**-1.5 / (1 + g) ** 2) == pytest.approx(1.0, abs=1e-3)
    geo = lag_weights(parse_spec("synthetic-geometric:0.1:64"))
    assert geo[50] / geo[51] == pytest.approx(math.exp(0.1), rel=1e-3)  # g(50) ~ 1e-3: nearly geometric


def _p_one(lam: np.ndarray, tokens: list[int], lags: list[int]) -> float:
    s = COPY_STRENGTH
    q1 = {1: (1 - s) / 2 + s, 0: (1 - s) / 2}
    num = lam[0] / 2 + sum(lam[k] * q1[x] for x, k in zip(tokens, lags))
    return num / (lam[0] + sum(lam[k] for k in lags))


def test_forward_by_hand_and_lags_from_position_ids():
    spec = parse_spec("synthetic:0.5:8")
    lam = lag_weights(spec)
    model = SyntheticLM(spec, torch.float64)
    ids = torch.tensor([[1, 0, 1]])
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.tensor([[0, 1, 2]]), logits_to_keep=1)
    assert out.logits.shape == (1, 1, 2)
    p = out.logits[0, 0].exp()
    assert p.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert p[1].item() == pytest.approx(_p_one(lam, [1, 0, 1], [3, 2, 1]), rel=1e-12)
    # a sink at position 0 and two recent tokens at 9, 10: predicted position 11, lags 11 (> L: ignored), 2, 1
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.tensor([[0, 9, 10]]), logits_to_keep=1)
    assert out.logits[0, 0, 1].exp().item() == pytest.approx(_p_one(lam, [0, 1], [2, 1]), rel=1e-12)
    # a masked token is not seen
    out = model(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1]]), position_ids=torch.tensor([[0, 1, 2]]), logits_to_keep=1)
    assert out.logits[0, 0, 1].exp().item() == pytest.approx(_p_one(lam, [1, 1], [3, 1]), rel=1e-12)


def test_all_positions_equal_prefix_passes_and_dtype():
    spec = parse_spec("synthetic:0.7:32")
    model = SyntheticLM(spec, torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2, (3, 20), generator=g)
    pos = torch.arange(20).expand(3, 20)
    full = model(ids, torch.ones_like(ids), pos, logits_to_keep=0).logits  # [3, 20, 2]
    assert full.shape == (3, 20, 2) and full.dtype == torch.float32
    for i in (0, 5, 19):
        last = model(ids[:, : i + 1], torch.ones_like(ids[:, : i + 1]), pos[:, : i + 1], logits_to_keep=1).logits
        torch.testing.assert_close(full[:, i : i + 1], last)
    # with nothing shown, only the uniform floor is left
    assert full[0, 0].exp().tolist() != [0.5, 0.5]  # token 0 is shown at position 0 ...
    empty = model(ids[:, :1], torch.zeros_like(ids[:, :1]), pos[:, :1], logits_to_keep=1).logits
    assert empty[0, 0].exp().tolist() == pytest.approx([0.5, 0.5])  # ... unless it is masked


def test_load_synthetic_and_model_dispatch():
    from truncsens.models import LoadedModel, load_model

    loaded = load_model("synthetic:0.5", "cpu", "float32")
    assert isinstance(loaded, LoadedModel)
    assert (loaded.tokenizer, loaded.name, loaded.max_context, loaded.dtype) == (None, "synthetic:0.5", 1024, "float32")
    assert loaded.model.config.vocab_size == 2 and not loaded.model.training
    geo = load_synthetic("synthetic-geometric:0.02:512", dtype="float64")
    assert geo.max_context == 512 and geo.model.spec.kind == "geometric"
    with pytest.raises(ValueError):
        load_synthetic("synthetic:nope")


def test_documents_are_deterministic_and_prefix_stable():
    a = synthetic_documents("synthetic:0.5:64", n_docs=3, length=100, seed=7)
    b = synthetic_documents("synthetic:0.5:64", n_docs=5, length=100, seed=7)
    c = synthetic_documents("synthetic:0.5:64", n_docs=3, length=100, seed=8)
    assert [d for d, _ in a] == ["synthetic-00000", "synthetic-00001", "synthetic-00002"]
    for (ia, xa), (ib, xb) in zip(a, b):
        assert ia == ib and torch.equal(xa, xb)
    assert xa.dtype == torch.long and xa.shape == (100,) and set(xa.unique().tolist()) <= {0, 1}
    assert not all(torch.equal(x, y) for (_, x), (_, y) in zip(a, c))
    with pytest.raises(ValueError):
        synthetic_documents("synthetic:0.5", n_docs=0, length=10)


def test_documents_are_sampled_from_the_model():
    """Calibration: x_t - p(1 | x_<t) has mean 0 and is uncorrelated with p (many positions)."""
    spec = "synthetic:0.5:64"
    docs = synthetic_documents(spec, n_docs=60, length=400, seed=1)
    ids = torch.stack([x for _, x in docs])  # [60, 400]
    model = load_synthetic(spec, dtype="float64").model
    p1 = model(ids, torch.ones_like(ids), torch.arange(400).expand(60, 400), logits_to_keep=0).logits[:, :-1, 1].exp()
    x = ids[:, 1:].double()  # token t+1 is predicted from the prefix ending at t
    resid = (x - p1).flatten()
    se = resid.std().item() / math.sqrt(resid.numel())
    assert abs(resid.mean().item()) < 4 * se
    centered = (p1 - p1.mean()).flatten()
    slope = (centered * (x.flatten() - x.mean())).sum() / (centered**2).sum()
    assert slope.item() == pytest.approx(1.0, abs=0.08)  # a miscalibrated sampler gives a slope far from 1
    assert p1.std().item() > 0.1  # and p really varies with the context


def _truncation_curve(spec: str, windows: list[int], n_docs: int = 400, seed: int = 3):
    """Exact mean TV and KL between p(. | L tokens) and p(. | last w tokens), via the forward pass."""
    loaded = load_synthetic(spec)
    L = loaded.max_context
    ctx = torch.stack([x[:L] for _, x in synthetic_documents(spec, n_docs, L + 1, seed)])  # [n, L]
    pos = torch.arange(L).expand(n_docs, L)
    model = loaded.model

    def logp(w: int) -> torch.Tensor:
        c = ctx[:, -w:]
        return torch.log_softmax(model(c, torch.ones_like(c), pos[:, -w:], logits_to_keep=1).logits[:, -1].float(), -1)

    ref = logp(L)
    tvs = np.array([tv(ref, logp(w)).mean().item() for w in windows])
    kls = np.array([kl(ref, logp(w)).mean().item() for w in windows])
    return tvs, kls


def _slope(x, y):
    return float(np.polyfit(x, y, 1)[0])


def test_power_source_has_the_documented_exponents():
    windows = [4, 8, 16, 32, 64, 128]
    tvs, kls = _truncation_curve("synthetic:0.5", windows)
    lw = np.log(windows)
    assert -_slope(lw, np.log(tvs)) == pytest.approx(0.5, abs=0.02)  # alpha_TV = beta
    assert -_slope(lw[:4], np.log(kls[:4])) == pytest.approx(1.0, abs=0.1)  # alpha_KL = 2 beta for w << L
    lam1 = lag_weights(parse_spec("synthetic:0.5"))[1]
    c_tv = tvs * np.asarray(windows, float) ** 0.5
    assert c_tv.mean() == pytest.approx(COPY_STRENGTH / 2 * SCALE * lam1, rel=0.06)  # C_TV ~= (s/2) m lam_1


def test_geometric_source_decays_exponentially():
    windows = [16, 64, 128, 256]
    tvs, kls = _truncation_curve("synthetic-geometric:0.01", windows, n_docs=300)
    assert -_slope(np.asarray(windows, float), np.log(tvs)) == pytest.approx(0.01, rel=0.05)  # tau = 1/rate
    assert -_slope(np.asarray(windows[:3], float), np.log(kls[:3])) == pytest.approx(0.02, rel=0.1)


def test_curve_results_has_exact_means():
    ds = curve_results({"tv": lambda w: 0.1 * w**-0.5}, [1, 2, 4, 8], n_docs=3, targets_per_doc=4, noise=0.5, seed=1)
    assert ds.sizes == {"target": 12, "window": 4}
    np.testing.assert_allclose(ds.tv.mean("target").values, 0.1 * np.array([1, 2, 4, 8.0]) ** -0.5, rtol=1e-6)
    assert ds.tv.std("target").values.min() > 0.005  # targets do scatter
    assert ds.attrs["reference_context"] == 1024 and float(ds.kl.max()) == 0.0
    noisy = curve_results({"tv": lambda w: 0.1 * w**-0.5}, [1, 2], n_docs=50, doc_noise=0.3, seed=1)
    assert not np.allclose(noisy.tv.mean("target").values, [0.1, 0.1 * 2**-0.5], rtol=1e-4)
    with pytest.raises(ValueError):
        curve_results({"tv": lambda w: w}, [1, 2], n_docs=2, targets_per_doc=3)
