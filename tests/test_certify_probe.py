"""Attention-level certificates: the Hájek output and V̂ against a float64 loop, the recorded exact
output against the model's own attention (forward hooks), and the probed evicted decode against the
prefill-evict engine (to 1e-5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine_calls import prefill_evict_logprobs
from truncsens.policies.poisson_design import empirical_bernstein_radius
from truncsens.certificates.estimator import attention_records, eb_sum_radius
from truncsens.certificates.designs import CertifyDesign
from truncsens.certificates.passes import certify_batch, design_of
from truncsens.certificates.probe import CertifyModelError, CertifyProbe, check_model, probed
from truncsens.engine.reference_pass import reference_pass
from truncsens.models import load_model
from truncsens.policies import make_policy


def poisson_case(seed: int, T: int = 40, d: int = 6, budget: int = 16):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, generator=g, dtype=torch.float64) * 2
    values = torch.randn(T, d, generator=g, dtype=torch.float64)
    scores = torch.rand(1, 1, T, generator=g, dtype=torch.float64) + 0.05
    policy = make_policy("poisson", n_sink=2)
    q = torch.tensor([T - 1])
    pi, tail = policy.design(budget, q, scores)
    kept = policy.keep(T, budget, q, [seed], scores).keep
    return logits, values, kept[0, 0], pi[0, 0], tail[0, 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_records_equal_a_float64_loop(seed):
    logits, values, kept, pi, tail = poisson_case(seed)
    rec = attention_records(logits, values, torch.ones_like(kept), kept, pi, tail, delta=0.05)
    T = logits.numel()
    w = [math.exp(float(logits[i])) for i in range(T)]
    z = sum(w)
    o = [sum(w[i] * float(values[i, c]) for i in range(T)) / z for c in range(values.shape[1])]
    idx = [i for i in range(T) if kept[i]]
    p = [float(pi[i]) if tail[i] else 1.0 for i in range(T)]
    z_hat = sum(w[i] / p[i] for i in idx)
    o_hat = [sum(w[i] / p[i] * float(values[i, c]) for i in idx) / z_hat for c in range(values.shape[1])]
    var = sum((1 - p[i]) / p[i] ** 2 * w[i] ** 2 * sum((float(values[i, c]) - o_hat[c]) ** 2 for c in range(values.shape[1]))
              for i in idx if tail[i]) / z_hat**2
    np.testing.assert_allclose(rec.o.numpy(), o, rtol=1e-12)
    np.testing.assert_allclose(rec.o_hat.numpy(), o_hat, rtol=1e-12)
    np.testing.assert_allclose(float(rec.variance), var, rtol=1e-10)
    assert float(rec.variance) > 0 and float(rec.error) > 0
    np.testing.assert_allclose(float(rec.error), math.dist(o, o_hat), rtol=1e-10)
    np.testing.assert_allclose(float(rec.radius_normal), 1.959963984540054 * math.sqrt(var), rtol=1e-10)
    b = max(w[i] / p[i] * math.dist([float(v) for v in values[i]], o_hat) / z_hat for i in idx if tail[i])
    n = sum(1 for i in idx if tail[i])
    eb = n * float(empirical_bernstein_radius(torch.tensor(var / n), n, b, 0.05))  # the sum of n draws
    np.testing.assert_allclose(float(rec.radius_eb), eb, rtol=1e-8)


def test_eb_radius_edge_cases():
    r = eb_sum_radius(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1, 5, 0]),
                      torch.tensor([True, True, False]), 0.05)
    assert math.isinf(float(r[0])) and float(r[2]) == 0.0
    log = math.log(80)
    np.testing.assert_allclose(float(r[1]), math.sqrt(2 * 0.5 * log) + 7 * log * 5 / 12, rtol=1e-12)
    with pytest.raises(ValueError, match="delta"):
        eb_sum_radius(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([3]), torch.tensor([True]), 1.0)


def hooked_attention_inputs(model, ids):
    """[B, L, H, d]: input of each layer's o_proj at the last position, from a plain full forward."""
    grabbed = []
    hooks = [layer.self_attn.o_proj.register_forward_hook(lambda m, a, o: grabbed.append(a[0][:, -1].detach()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    H = model.config.num_attention_heads
    return torch.stack([g.view(g.shape[0], H, -1) for g in grabbed], dim=1)


def probed_last(model, ids, kept, pi, tail):
    """Records of one evicted decode of the last token against the full prefill cache."""
    from transformers import DynamicCache

    B, T = ids.shape
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, : T - 1], use_cache=True, cache=cache)
        probe = CertifyProbe()
        probe.evict(kept, pi, tail)
        with probed(model):
            out = model(input_ids=ids[:, T - 1 :], position_ids=torch.full((B, 1), T - 1), use_cache=True,
                        cache=cache, certify_probe=probe)
    return probe, out.logits[:, -1].double().log_softmax(-1)


def test_recorded_o_is_the_models_attention_output(tiny_llama_dir):
    model = load_model(tiny_llama_dir).model
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    expected = hooked_attention_inputs(model, ids).double()  # [B, L, H, d]
    everything = torch.ones(2, 30, dtype=torch.bool)
    probe, lp = probed_last(model, ids, everything, everything.double(), torch.zeros_like(everything))
    torch.testing.assert_close(probe.stacked("o"), expected, atol=1e-5, rtol=1e-5)
    assert float(probe.stacked("error").max()) < 1e-6  # nothing evicted: o_hat = o in every layer
    with torch.no_grad():
        plain = model(input_ids=ids).logits[:, -1].double().log_softmax(-1)
    torch.testing.assert_close(lp, plain, atol=1e-5, rtol=1e-5)
    kept = everything.clone()
    kept[:, 3:20] = False  # evict: layer 0 reads the same query, later layers do not
    probe, _ = probed_last(model, ids, kept, kept.double(), torch.zeros_like(kept))
    o = probe.stacked("o")
    torch.testing.assert_close(o[:, 0], expected[:, 0], atol=1e-5, rtol=1e-5)
    assert float((o[:, 1] - expected[:, 1]).abs().max()) > 1e-4
    assert float(probe.stacked("error")[:, 0].min()) > 1e-4


def test_probed_logits_equal_prefill_evict_engine(tiny_llama_dir):
    model = load_model(tiny_llama_dir).model
    B, T, k = 3, 32, 12
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(5))
    policies = [make_policy(n, n_sink=2) for n in ("poisson", "topk", "random")]
    seeds = [[[11 + b for b in range(B)]] for _ in policies]
    out = certify_batch(model, ids, policies, [k], seeds, 0.05, CertifyDesign("token"))  # the shared design
    ref = reference_pass(model, ids, attention=True, keep_cache=True)
    torch.testing.assert_close(out.ref_logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.scores, ref.attention.sum(1), atol=1e-5, rtol=1e-5)  # H2O score of query T-1
    for p, policy in enumerate(policies):
        q = torch.tensor([T - 1])
        kept = policy.keep(T, k, q, seeds[p][0], ref.attention.sum(1, keepdim=True))
        mine, _, _ = design_of(policy, T, k, seeds[p][0], out.scores)
        assert torch.equal(mine, kept.keep[:, 0])
        with torch.no_grad():
            engine = prefill_evict_logprobs(model, ref.cache, ids, kept.keep[:, 0], kept.offset[:, 0])
        torch.testing.assert_close(out.logprobs[p, 0], engine, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logprobs[p, 0].exp(), engine.exp(), atol=1e-5, rtol=0)
        assert float((engine - ref.logprobs).abs().max()) > 1e-3  # eviction changed the output
        assert out.records["error"][p, 0].shape == (B, 2, 4)
        np.testing.assert_array_equal(out.kept_tokens[p, 0].numpy(), kept.keep[:, 0].sum(-1).numpy())
    assert torch.isfinite(out.records["radius_eb"][0]).all() and torch.isnan(out.records["radius_eb"][1]).all()


def test_a_model_without_the_attention_interface_is_refused():
    loaded = load_model("synthetic:1.0")
    with pytest.raises(CertifyModelError, match="attention interface"):
        check_model(loaded.model, loaded.name)
