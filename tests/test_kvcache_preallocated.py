"""The preallocated cache of token-by-token runs holds what ``DynamicCache`` holds, step by step,
and refuses a write past its capacity."""

import pytest
import torch

from conftest import sharp_tiny_llama
from truncsens.engine import kvcache


@torch.no_grad()
def test_preallocated_cache_equals_dynamic_cache_token_by_token():
    model = sharp_tiny_llama(layers=2)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))  # [B, T]
    dynamic, pre = kvcache.new_cache(model), kvcache.new_preallocated_cache(model, 2, 12)
    kw = kvcache.cache_keyword(model)
    out_d = model(input_ids=ids[:, :5], use_cache=True, **{kw: dynamic}).logits
    out_p = model(input_ids=ids[:, :5], use_cache=True, **{kw: pre}).logits
    assert torch.equal(out_d, out_p)
    for t in range(5, 12):
        out_d = model(input_ids=ids[:, t : t + 1], use_cache=True, **{kw: dynamic}).logits
        out_p = model(input_ids=ids[:, t : t + 1], use_cache=True, **{kw: pre}).logits
        torch.testing.assert_close(out_p, out_d, rtol=0, atol=1e-6)
        for layer in range(2):
            (kd, vd), (kp, vp) = kvcache.layer_kv(dynamic, layer), kvcache.layer_kv(pre, layer)
            assert kp.shape == kd.shape == (3, 2, t + 1, 8)
            torch.testing.assert_close(kp, kd, rtol=0, atol=1e-6)
            torch.testing.assert_close(vp, vd, rtol=0, atol=1e-6)
    assert pre.get_seq_length() == 12


@torch.no_grad()
def test_preallocated_cache_refuses_a_write_past_its_capacity():
    model = sharp_tiny_llama(layers=2)
    cache = kvcache.new_preallocated_cache(model, 2, 4)
    kw = kvcache.cache_keyword(model)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True, **{kw: cache})
    with pytest.raises(ValueError, match="holds 4 positions"):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True, **{kw: cache})
