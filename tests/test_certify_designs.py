"""Per-head certificate designs: each (layer, key/value head) draws its own kept set with
π from its own prefill score; the probed run equals an independent per-layer masked decode; the
coverage certify reports for layer 0 agrees with a float64 Monte Carlo of the same design written
here from scratch; honest counting leaves records at the floor out of coverage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import sharp_tiny_llama
from oracles import _cache_keyword
from truncsens.certificates import passes
from truncsens.certificates.designs import CertifyDesign, DesignError, layer_head_seeds
from truncsens.certificates.statistics import coverage
from truncsens.policies import make_policy


def test_design_options_are_checked_and_described():
    assert CertifyDesign().describe() == "per layer and key/value head, score window (W = 32), tempered (score^0.5)"
    assert CertifyDesign(temper=1.0).describe() == "per layer and key/value head, score window (W = 32)"
    assert "shared" in CertifyDesign("token").describe()
    for bad, match in ((dict(granularity="layer"), "--granularity"), (dict(score="oracle"), "--score"),
                       (dict(obs_window=0), "--obs-window")):
        with pytest.raises(DesignError, match=match):
            CertifyDesign(**bad)


def test_layer_head_seeds_are_distinct_and_independent_of_batching():
    a = layer_head_seeds([7, 8], 2, 3)
    assert len(a) == 12 and len(set(a)) == 12
    assert layer_head_seeds([8], 2, 3) == a[6:]  # target 8's seeds do not depend on target 7


def test_head_designs_follow_each_heads_own_score():
    """Two layers x two heads with different score peaks: topk keeps each head's own top keys, and
    poisson's pi follows each head's own score."""
    T, k = 16, 8
    scores = torch.full((1, 2, 2, T), 0.01)
    peaks = [[3, 5], [7, 9]]
    for l in range(2):
        for h in range(2):
            scores[0, l, h, peaks[l][h]] = 5.0
    topk = make_policy("topk", n_sink=2)
    kept, pi, tail = passes.head_design_of(topk, T, k, [0], scores)
    assert kept.shape == (1, 2, 2, T)
    for l in range(2):
        for h in range(2):
            assert bool(kept[0, l, h, peaks[l][h]])  # each head keeps its own peak
    assert not torch.equal(kept[0, 0, 0], kept[0, 1, 1])  # heads of other peaks keep other sets
    kept, pi, tail = passes.head_design_of(make_policy("poisson", n_sink=2), T, k, [0], scores)
    assert float(pi[0, 0, 0, 3]) == 1.0 and float(pi[0, 0, 1, 3]) < 1.0  # the peak is surely kept only in its head


class PerLayerMask:
    """An attention function for a test: plain softmax attention with an additive mask per layer
    (a dict layer -> [B, H, 1, T]), registered under its own name."""

    NAME = "test_per_layer_mask"

    def __init__(self, masks):
        self.masks = masks

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n_rep = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
        s = torch.matmul(query, k.transpose(-1, -2)) * scaling  # [B, H, 1, T]
        if query.shape[2] == 1:
            s = s + self.masks[module.layer_idx]
        else:
            T = s.shape[-1]
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v).transpose(1, 2), None


def test_probed_per_head_run_equals_a_per_layer_masked_decode(monkeypatch):
    """The certify forward with per-layer, per-head poisson designs equals a decode whose every layer
    adds its own mask (0 on surely kept keys, log 1/pi on drawn tail keys, -inf on evicted ones):
    the Hajek output is that softmax (docs/method.md section 5)."""
    from transformers import AttentionInterface, DynamicCache

    model = sharp_tiny_llama(layers=2).double()
    B, T, k = 2, 40, 12
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(4))
    designs = []
    real = passes.head_design_of
    monkeypatch.setattr(passes, "head_design_of", lambda *a: designs.append(real(*a)) or designs[-1])
    out = passes.certify_batch(model, ids, [make_policy("poisson", n_sink=2)], [k], [[[3, 4]]], 0.05)
    kept, pi, tail = designs[0]  # [B, L, Hkv, T]
    assert not torch.equal(kept[:, 0], kept[:, 1]) and not torch.equal(kept[:, :, 0], kept[:, :, 1])
    H, Hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    masks = {}
    for l in range(2):
        m = torch.where(kept[:, l], torch.log(1 / pi[:, l].clamp_min(1e-300)), torch.tensor(float("-inf"), dtype=torch.float64))
        masks[l] = m.repeat_interleave(H // Hkv, 1).unsqueeze(2)  # [B, Hkv, T] -> [B, H, 1, T]
    AttentionInterface.register(PerLayerMask.NAME, PerLayerMask(masks))
    model.set_attn_implementation(PerLayerMask.NAME)
    try:
        with torch.no_grad():
            kw = {_cache_keyword(model): DynamicCache()}  # "cache" in transformers >= 5.24, else past_key_values
            pos = torch.arange(T).expand(B, T)
            model(input_ids=ids[:, : T - 1], position_ids=pos[:, : T - 1], use_cache=True, **kw)
            logits = model(input_ids=ids[:, T - 1 :], position_ids=pos[:, T - 1 :], use_cache=True, **kw).logits[:, -1]
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(out.logprobs[0, 0], logits.log_softmax(-1), atol=1e-9, rtol=1e-9)
    assert float((out.logprobs[0, 0] - out.ref_logprobs).abs().max()) > 1e-3  # eviction moved the output


def naive_pi(score: np.ndarray, tail: np.ndarray, m: float) -> np.ndarray:
    """pi_i = min(1, c score_i) on the tail with sum pi = m, c by plain bisection (written here)."""
    lo, hi = 0.0, 1.0
    while np.minimum(1, hi * score[tail]).sum() < m:
        hi *= 2
    for _ in range(200):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if np.minimum(1, c * score[tail]).sum() < m else (lo, c)
    out = np.ones_like(score)
    out[tail] = np.minimum(1, hi * score[tail])
    return out


def test_certify_layer0_coverage_agrees_with_a_float64_monte_carlo(monkeypatch):
    """One target, one fixed design per layer-0 head; certify run R = 120 times with fresh draws gives
    a coverage (layer 0, records off the floor) that a Monte Carlo of 4,000 draws written from scratch
    (float64: pi by bisection, the Hajek ratio, V-hat and the empirical-Bernstein sum radius of
    docs/method.md) lies inside the binomial interval of."""
    from statsmodels.stats.proportion import proportion_confint

    model = sharp_tiny_llama(layers=2).double()
    T, k, delta = 48, 12, 0.05
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(9))
    captured = {}
    real = passes.head_design_of

    def spy(*args):
        out = real(*args)
        captured.setdefault("design", out)
        return out

    monkeypatch.setattr(passes, "head_design_of", spy)
    policy = make_policy("poisson", n_sink=2)
    errors, radii, norms = [], [], []
    for r in range(120):
        out = passes.certify_batch(model, ids, [policy], [k], [[[1000 + r]]], delta)
        errors.append(out.records["error"][0, 0, 0, 0].numpy())  # layer 0: [H]
        radii.append(out.records["radius_eb"][0, 0, 0, 0].numpy())
        norms.append(out.records["o_norm"][0, 0, 0, 0].numpy())
    errors, radii = np.stack(errors), np.stack(radii)  # [R, H]
    floor = 10 * np.finfo(np.float64).eps * np.stack(norms)
    got = coverage(errors, radii, floor=floor)

    # the Monte Carlo: layer-0 query, keys and values of the target from a plain eager forward
    kept, pi, tail = (t[0, 0].numpy() for t in captured["design"])  # [Hkv, T] of layer 0
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        h = model.model.layers[0].input_layernorm(h)
        cos, sin = model.model.rotary_emb(h, torch.arange(T).unsqueeze(0))
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        hd = attn.head_dim
        q = attn.q_proj(h).view(1, T, -1, hd).transpose(1, 2)
        kk = attn.k_proj(h).view(1, T, -1, hd).transpose(1, 2)
        vv = attn.v_proj(h).view(1, T, -1, hd).transpose(1, 2)
        q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
    H, Hkv = q.shape[1], kk.shape[1]
    rng = np.random.default_rng(0)
    ln4 = math.log(4 / delta)
    hits, n = 0, 0
    for head in range(H):
        g = head // (H // Hkv)
        qv, K, Vv = q[0, head, -1].numpy(), kk[0, g].numpy(), vv[0, g].numpy()
        w = np.exp(K @ qv * attn.scaling - (K @ qv * attn.scaling).max())  # [T]
        o = (w[:, None] * Vv).sum(0) / w.sum()
        p, t = pi[g], tail[g].astype(bool)
        draws = rng.random((4000, T)) < p  # Poisson draws, independent keys
        for I in draws:
            S = np.where(t, I, kept[g].astype(bool) & ~t)  # tail drawn, certain keys kept
            wt = np.where(S, w / p, 0.0)
            o_hat = (wt[:, None] * Vv).sum(0) / wt.sum()
            Z = wt.sum()
            sel = S & t
            var = (((1 - p[sel]) / p[sel] ** 2) * w[sel] ** 2 * ((Vv[sel] - o_hat) ** 2).sum(1)).sum() / Z ** 2
            m = int(sel.sum())
            if t.any() and m < 2:
                radius = math.inf
            elif not t.any():
                radius = 0.0
            else:
                B = (w[sel] * np.linalg.norm(Vv[sel] - o_hat, axis=1) / (p[sel] * Z)).max()
                radius = math.sqrt(2 * var * ln4) + 7 / 3 * B * ln4 * m / (m - 1)
            err = np.linalg.norm(o_hat - o)
            if err <= 10 * np.finfo(np.float64).eps * np.linalg.norm(o):
                continue  # at the floor, as certify counts it
            n += 1
            hits += err <= radius
    mc = hits / n
    lo, hi = proportion_confint(got["covered"], got["n"], alpha=0.01, method="wilson")
    assert got["n"] >= 100 and n >= 4000
    assert lo <= mc <= hi, (got, mc)


def test_a_head_whose_window_scores_underflow_still_gets_a_design():
    """A sharp head's window attention is exactly 0 on most keys (float32 underflow); a tail budget
    larger than its positive-score keys was refused ("poisson tail budget 60 exceeds the 0 tail tokens
    with a positive score", certify-attribution at N = 256, 50 %). The score floor spreads it."""
    from truncsens.certificates.probe import CertifyProbe

    T = 64
    window = torch.zeros(1, 2, T - 1)  # [B, Hkv, T - 1]
    window[0, 0, 5] = 3.0  # head 0: one key, head 1: nothing at all
    probe = CertifyProbe(head_scores={"window": {0: window}})
    scores = passes._head_scores(probe, CertifyDesign(), T)  # [1, 1, 2, T]
    assert scores.shape == (1, 1, 2, T) and bool((scores[..., : T - 1] > 0).all())
    kept, pi, tail = passes.head_design_of(make_policy("poisson", n_sink=4), T, 32, [0], scores)
    expected = pi[tail].reshape(-1)
    assert float(pi[0, 0, 0, 5]) == pytest.approx(1.0)
    sums = (pi * tail).sum(-1)  # [1, 1, 2] expected kept tail keys per head
    assert torch.allclose(sums, sums[..., :1].expand_as(sums)) and float(expected.min()) > 0


def test_the_design_benchmark_names_certifys_default_design():
    """benchmarks/certify_designs.py reports the default design's held-out coverage under a name; its
    options must be certify's defaults, or docs/findings-certify.md quotes another design."""
    import importlib.util
    import sys
    from pathlib import Path

    from truncsens.certificates.options import CertifyOptions

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "certify_designs.py"
    spec = importlib.util.spec_from_file_location("certify_designs", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["certify_designs"] = bench
    spec.loader.exec_module(bench)
    options = {**dict(bench.CANDIDATES), **dict(bench.CANDIDATES_2)}[bench.DEFAULT_DESIGN]
    defaults = CertifyOptions()
    assert options == {k: getattr(defaults, k) for k in options} and defaults.granularity == "head"
    assert bench.rates([{"rate": 0.965, "budget": 128}, {"rate": 0.97, "budget": 256}]) == (
        "96.5 / 97.0 % (budgets 128 / 256)")


def test_the_process_line_names_the_design_the_run_drew():
    """The results' ``certified_process`` says per head or shared as the run's design does (a shared-design
    run once said "one design per layer and key/value head"); streaming's words name no design."""
    from truncsens.certificates.semantics import CERTIFY_SEMANTICS

    prefill, streaming = CERTIFY_SEMANTICS["prefill_evict"], CERTIFY_SEMANTICS["streaming"]
    assert prefill.process_for(CertifyDesign()) == (
        "prefill-evict: keys computed with the full prompt, then evicted before the target's query reads them "
        "(one design per layer and key/value head)")
    assert prefill.process_for(CertifyDesign("token")).endswith("them (one design shared by every layer and head)")
    assert streaming.process_for(CertifyDesign("token")) == streaming.process
