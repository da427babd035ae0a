"""Upper bounds on the undrawn tail's logits and the range they imply (truncsens/certificates/tail_bounds.py)."""
from __future__ import annotations

import math

import pytest
import torch

from truncsens.certificates.estimator import attention_records, eb_sum_radius
from truncsens.certificates.tail_bounds import page_logit_bound, page_max, quantized_logit_bound, tail_range


def _qk(seed: int = 0, T: int = 37, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, d, generator=g, dtype=torch.float64)  # [rows, d]
    k = torch.randn(3, T, d, generator=g, dtype=torch.float64)  # [rows, T, d]
    members = torch.rand(3, T, generator=g) < 0.6  # [rows, T]
    return q, k, members


def test_quantized_bound_by_hand():
    # one channel, keys 0, 1, 3 (all members), 1 bit: lo 0, hi 3, step 3: shadows 0, 0, 3;
    # q = 2, scale 0.5: u = 0.5 * (2 * shadow + |2| * 3 / 2) = shadow + 1.5
    q = torch.tensor([[2.0]], dtype=torch.float64)
    k = torch.tensor([[[0.0], [1.0], [3.0]]], dtype=torch.float64)
    u = quantized_logit_bound(q, k, torch.ones(1, 3, dtype=torch.bool), bits=1, scaling=0.5)
    assert torch.allclose(u, torch.tensor([[1.5, 1.5, 4.5]], dtype=torch.float64))
    exact = 0.5 * 2 * k[..., 0]
    assert bool((u >= exact).all()) and not torch.allclose(u, exact)


def test_quantized_bound_holds_and_tightens_with_bits():
    q, k, m = _qk()
    exact = torch.einsum("rd,rtd->rt", q, k) * 0.3
    slack = []
    for bits in (1, 2, 4, 8):
        u = quantized_logit_bound(q, k, m, bits, 0.3)
        assert bool((u[m] >= exact[m] - 1e-12).all())
        assert bool(torch.isneginf(u[~m]).all())
        slack.append(float((u - exact)[m].max()))
    assert slack == sorted(slack, reverse=True) and slack[-1] < 0.05 * slack[0]
    with pytest.raises(ValueError, match="bits"):
        quantized_logit_bound(q, k, m, 0, 0.3)


def test_page_bound_by_hand_and_exact_for_single_key_pages():
    # two channels, q = (1, -1); page of 2 members (1, 0), (3, 2): min (1, 0), max (3, 2);
    # bound max(1*1, 1*3) + max(-1*0, -1*2) = 3 + 0 = 3 (the keys' own logits are 1 and 1)
    q = torch.tensor([[1.0, -1.0]])
    k = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [5.0, 5.0]]])
    members = torch.tensor([[True, True, False]])
    u = page_logit_bound(q, k, members, page=2, scaling=1.0)
    assert u[0, 0] == 3.0 and u[0, 1] == 3.0 and math.isinf(u[0, 2]) and u[0, 2] < 0
    q, k, m = _qk(1)
    exact = torch.einsum("rd,rtd->rt", q, k) * 0.3
    assert torch.allclose(page_logit_bound(q, k, m, 1, 0.3)[m], exact[m])  # one key a page: the logit itself
    for page in (4, 16):
        u = page_logit_bound(q, k, m, page, 0.3)
        assert bool((u[m] >= exact[m] - 1e-12).all()) and bool(torch.isneginf(u[~m]).all())
    with pytest.raises(ValueError, match="page"):
        page_logit_bound(q, k, m, 0, 0.3)


def test_page_max_by_hand():
    x = torch.tensor([[1.0, 5.0, 2.0, 7.0, 3.0]])
    members = torch.tensor([[True, False, True, True, True]])
    got = page_max(x, members, 2)  # pages {0,1}, {2,3}, {4}: member maxima 1, 7, 3
    assert got[0].tolist()[0] == 1.0 and math.isinf(got[0, 1]) and got[0, 2:].tolist() == [7.0, 7.0, 3.0]


def _design():
    # 4 keys of one query: key 0 sure, keys 1-3 tail with pi 0.5, 0.5, 0.1; kept: 0, 1, 2 (3 not drawn)
    logits = torch.tensor([[0.0, 1.0, 0.5, 2.0]], dtype=torch.float64)
    values = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-2.0, 0.0]]], dtype=torch.float64)
    kept = torch.tensor([[True, True, True, False]])
    pi = torch.tensor([[1.0, 0.5, 0.5, 0.1]], dtype=torch.float64)
    tail = torch.tensor([[False, True, True, True]])
    return logits, values, kept, pi, tail


def test_tail_range_by_hand():
    logits, values, kept, pi, tail = _design()
    rec = attention_records(logits, values, torch.ones_like(kept), kept, pi, tail, 0.05)
    # shift m = 1 (largest kept logit); Ẑ = e^-1 + e^0/0.5 + e^-0.5/0.5
    z_hat = math.exp(-1) + 2 + 2 * math.exp(-0.5)
    o_hat = (math.exp(-1) * values[0, 0] + 2 * values[0, 1] + 2 * math.exp(-0.5) * values[0, 2]) / z_hat
    assert torch.allclose(rec.o_hat[0], o_hat)
    # the undrawn key 3 with its exact logit: e^(2 - 1) * (||v_3|| + ||ô||) / (0.1 * Ẑ)
    hidden = math.exp(1) * (2 + float(o_hat.norm())) / (0.1 * z_hat)
    v_norm = values.norm(dim=-1)
    got = tail_range(logits, logits, v_norm, rec.o_hat, kept, pi, tail, rec.value_range)
    assert got.item() == pytest.approx(hidden, rel=1e-12)
    assert hidden > rec.value_range.item()  # the plug-in range misses it
    # a bound below every kept term leaves the plug-in range
    low = torch.full_like(logits, -50.0)
    assert tail_range(logits, low, v_norm, rec.o_hat, kept, pi, tail, rec.value_range).item() == rec.value_range.item()


def test_tail_range_radius_covers_an_undrawn_heavy_key():
    # six kept tail keys of small weight and one undrawn key (pi 0.05) the query leans on: the plug-in
    # radius, read off the kept keys, misses the error; the radius with the range over the whole tail covers it
    logits = torch.tensor([[0.0] + [-3.0] * 6 + [2.0]], dtype=torch.float64)  # [1, 8]
    values = torch.tensor([[[1.0, 0.0]] + [[0.0, 1.0], [1.0, 1.0]] * 3 + [[-2.0, 0.0]]], dtype=torch.float64)
    kept = torch.tensor([[True] * 7 + [False]])
    pi = torch.tensor([[1.0] + [0.5] * 6 + [0.05]], dtype=torch.float64)
    tail = torch.tensor([[False] + [True] * 7])
    rec = attention_records(logits, values, torch.ones_like(kept), kept, pi, tail, 0.05)
    assert rec.error.item() > 2 * rec.radius_eb.item()
    b = tail_range(logits, logits, values.norm(dim=-1), rec.o_hat, kept, pi, tail, rec.value_range)
    r = eb_sum_radius(rec.variance, b, rec.n_random, rec.has_tail, 0.05)
    assert rec.error.item() <= r.item()
