"""Streaming attention from eviction steps without a T x T mask (so that long contexts fit in memory).

The chunked (SDPA) and flex backends equal scaled dot-product attention under the dense additive mask
built by hand from the eviction steps (0 where ``j <= q < evict_j`` and within the window, the offset
added, -inf elsewhere), for chunk sizes that do not divide T and that exceed it, per-sequence and
per-key/value-head eviction steps, and offsets; through a model, the one-pass streaming forward equals
the dense-mask forward to 1e-5 (tiny Llama, a hybrid windowed Qwen2, the reference model); bad input
gets one clear error and the model's attention implementation is restored.
"""

from __future__ import annotations

import pytest
import torch

from conftest import hybrid_qwen2, requires_reference
from truncsens.divergences import kl
from truncsens.engine.evict_attention import (
    NAME, EvictAttentionError, EvictStepsMissing, chunked_attention, evict_attention, evict_attention_forward, evict_kwargs,
    flex_evict_attention, supported,
)
from truncsens.engine.forward import last_logprobs, next_token_logprobs
from truncsens.engine.attention_windows import LayerWindows
from truncsens.engine.semantics import SEMANTICS
from truncsens.engine.streaming_pass import decide_offline
from truncsens.models import load_model
from truncsens.policies import make_policy
from truncsens.policies.streaming import Evictions

OFFLINE = ("suffix", "sink_recent", "random")


def random_evictions(B: int, T: int, heads: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """evict [B, (heads,) T] with j < evict_j <= T (every key read at least by its own query) and
    offsets [B, (heads,) T] in [0, 2)."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, T) if heads is None else (B, heads, T)
    j = torch.arange(T)
    evict = j + 1 + (torch.rand(shape, generator=g) * (T - j)).long()  # in j+1 .. T
    evict = torch.where(torch.rand(shape, generator=g) < 0.3, torch.full(shape, T), evict)  # some never evicted
    return evict, 2 * torch.rand(shape, generator=g)


def dense_reference(query, key, value, evict, offset, scaling, window=None) -> torch.Tensor:
    """SDPA with the [B, H, T, T] additive mask written out from the eviction steps (the naive reference)."""
    B, H, T, D = query.shape
    groups = H // key.shape[1]
    q = torch.arange(T).view(T, 1)
    j = torch.arange(T).view(1, T)
    mask = torch.full((B, H, T, T), float("-inf"))
    for b in range(B):
        for h in range(H):
            ev = evict[b] if evict.dim() == 2 else evict[b, h // groups]  # [T]
            off = offset[b] if offset.dim() == 2 else offset[b, h // groups]
            keep = (j <= q) & (q < ev.view(1, T))
            if window is not None:
                keep &= q - j < window
            mask[b, h] = torch.where(keep, off.view(1, T).expand(T, T), mask[b, h])
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)


def qkv(B=2, H=4, Hkv=2, T=23, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
            torch.randn(B, Hkv, T, D, generator=g))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("query_chunk", [1, 5, 23, 64])  # 5 does not divide T = 23; 64 > T
def test_chunked_equals_dense_mask(query_chunk, window, per_head):
    query, key, value = qkv()
    evict, offset = random_evictions(2, 23, 2 if per_head else None, seed=query_chunk)
    want = dense_reference(query, key, value, evict, offset, 0.3, window)
    got = chunked_attention(query, key, value, evict, offset, 0.3, window, query_chunk)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    plain = dense_reference(query, key, value, evict, torch.zeros_like(offset), 0.3, window)
    assert (plain - want).abs().max() > 1e-2  # the offsets took part: the test can fail


def test_layers_of_one_window_share_one_plan():
    """A second layer (other keys and values, the same eviction steps) reuses the first layer's plan and
    still equals the dense reference; another window gets a plan of its own."""
    evict, offset = random_evictions(2, 23, None, seed=3)
    plans: dict = {}
    for layer, window in enumerate((None, None, 6)):
        query, key, value = qkv(seed=10 + layer)
        got = chunked_attention(query, key, value, evict, offset, 0.3, window, 5, plans)
        torch.testing.assert_close(got, dense_reference(query, key, value, evict, offset, 0.3, window), atol=1e-6, rtol=1e-5)
    assert sorted(k[0] or 0 for k in plans) == [0, 6] and len(plans[(None, 23, torch.float32)]) == 5  # 23 rows by 5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_values_of_another_width_than_keys(backend):
    """Multi-head latent attention (DeepSeek-V2/V3) attends with keys of 12 and values of 6 per head:
    both backends equal the dense mask and return [B, H, T, 6] (the chunked backend gathered values
    with the keys' width before)."""
    query, key, _ = qkv(T=20, D=12)
    value = torch.randn(2, 2, 20, 6, generator=torch.Generator().manual_seed(7))  # [B, Hkv, T, Dv]
    evict, offset = random_evictions(2, 20, None, seed=4)
    with torch.no_grad():
        if backend == "chunked":
            got = chunked_attention(query, key, value, evict, offset, 0.3, 5, 7)
        else:
            got = flex_evict_attention(query, key, value, evict, offset, 0.3, 5, compiled=False)
    assert got.shape == (2, 4, 20, 6)
    torch.testing.assert_close(got, dense_reference(query, key, value, evict, offset, 0.3, 5), atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("per_head", [False, True])
def test_flex_equals_dense_mask(per_head):
    """FlexAttention's mask_mod / score_mod (uncompiled on CPU) give the same attention."""
    query, key, value = qkv(T=20)
    evict, offset = random_evictions(2, 20, 2 if per_head else None, seed=3)
    with torch.no_grad():
        got = flex_evict_attention(query, key, value, evict, offset, None, 5, compiled=False)
    torch.testing.assert_close(got, dense_reference(query, key, value, evict, offset, 8 ** -0.5, 5), atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_built_once_per_window(monkeypatch):
    """With a per-call ``plans`` dict, layers of one window share one block mask (built twice for
    windows None, None, 6), and every layer still equals the dense mask."""
    import torch.nn.attention.flex_attention as fa

    built = []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    evict, offset = random_evictions(2, 20, None, seed=4)
    plans: dict = {}
    for layer, window in enumerate((None, None, 6)):
        query, key, value = qkv(T=20, seed=20 + layer)
        with torch.no_grad():
            got = flex_evict_attention(query, key, value, evict, offset, None, window, compiled=False, plans=plans)
        torch.testing.assert_close(got, dense_reference(query, key, value, evict, offset, 8 ** -0.5, window),
                                   atol=1e-6, rtol=1e-5)
    assert len(built) == 2 and len(plans) == 2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_shares_its_block_mask_over_the_layers_of_one_call(monkeypatch):
    """The attention function of a forward call passes the call's plans to the flex backend: three
    layers (no windows) build one block mask, and each still equals the dense mask."""
    import types

    import torch.nn.attention.flex_attention as fa

    built = []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    evict, offset = random_evictions(2, 20, None, seed=5)
    call = evict_kwargs(evict, offset, backend="flex")  # what one model(...) call carries
    for layer in range(3):
        query, key, value = qkv(T=20, seed=30 + layer)
        with torch.no_grad():
            out, _ = evict_attention_forward(types.SimpleNamespace(layer_idx=layer, training=False), query, key, value,
                                             None, None, **call)
        want = dense_reference(query, key, value, evict, offset, 8 ** -0.5).transpose(1, 2)  # [B, T, H, D]
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    assert len(built) == 1


def test_only_last_queries():
    """Tq < Tk: the queries are the last Tq positions (a decode of 3 tokens against 23 keys)."""
    query, key, value = qkv()
    evict, offset = random_evictions(2, 23, None, seed=7)
    want = dense_reference(query, key, value, evict, offset, 0.5)[:, :, -3:]
    torch.testing.assert_close(chunked_attention(query[:, :, -3:], key, value, evict, offset, 0.5, query_chunk=2), want,
                               atol=1e-6, rtol=1e-5)


def test_bad_input_is_refused():
    query, key, value = qkv(T=6)
    evict, offset = random_evictions(2, 6, None, seed=0)
    with pytest.raises(EvictAttentionError, match=r"evict must be \[B, 6\] or \[B, 2, 6\]"):
        chunked_attention(query, key, value, evict[:, :5], offset[:, :5], None)
    with pytest.raises(EvictAttentionError, match="differ in shape"):
        chunked_attention(query, key, value, evict, offset[:1], None)
    with pytest.raises(EvictAttentionError, match="integer eviction steps"):
        chunked_attention(query, key, value, evict.float(), offset, None)
    with pytest.raises(EvictAttentionError, match="at least 1 row"):
        chunked_attention(query, key, value, evict, offset, None, query_chunk=0)
    dead = evict.clone()
    dead[1, 3] = 3  # key 3 evicted before its own query reads it, and nothing else kept for query 3
    dead[1, :3] = 3
    with pytest.raises(EvictAttentionError, match="a query keeps no key"):
        chunked_attention(query, key, value, dead, offset, None)
    with pytest.raises(EvictAttentionError, match="backend must be one of"):
        evict_kwargs(evict, offset, backend="triton")


def offline_evictions(name: str, T: int, budget: int, seeds=(3, 4)) -> Evictions:
    return decide_offline(make_policy(name, n_sink=2), budget, T, 1, list(seeds), "cpu")


def assert_same(fast: torch.Tensor, slow: torch.Tensor) -> None:
    """[B, V] log-probabilities agree to 1e-5 (absolute + 1e-5 relative; probabilities absolute)."""
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.exp(), slow.exp(), atol=1e-5, rtol=0)


def check_model(model, T: int, budget: int, name: str, query_chunk: int, with_offset: bool = False) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))  # [B, T]
    ev = offline_evictions(name, T, budget)
    if with_offset:
        ev = Evictions(ev.evict, torch.rand(ev.evict.shape, generator=torch.Generator().manual_seed(2)))
    streaming = SEMANTICS["streaming"]
    before = model.config._attn_implementation
    fast = streaming.kept_logprobs(model, ids, ev, None, "original", query_chunk=query_chunk)
    assert model.config._attn_implementation == before
    dense = streaming.kept_logprobs(model, ids, ev.kept(), None, "original")  # [B, 1, T, T] mask
    assert_same(fast, dense)
    full = next_token_logprobs(model, ids, torch.arange(T).expand(2, T))
    assert kl(full, fast).min() > 1e-5  # eviction changed the output: the test can fail


@pytest.mark.parametrize("name", OFFLINE)
def test_streaming_equals_dense_tiny_llama(tiny_llama_dir, name):
    check_model(load_model(tiny_llama_dir).model, T=40, budget=8, name=name, query_chunk=7)


def test_streaming_offsets_equal_dense_tiny_llama(tiny_llama_dir):
    check_model(load_model(tiny_llama_dir).model, T=40, budget=8, name="random", query_chunk=16, with_offset=True)


@pytest.mark.parametrize("name", OFFLINE)
def test_streaming_equals_dense_hybrid_qwen2(name):
    """Windows applied per layer inside the chunk mask equal the dense dict of masks per layer type."""
    check_model(hybrid_qwen2(), T=30, budget=8, name=name, query_chunk=4)


def test_per_head_evictions_equal_dense_mask(tiny_llama_dir):
    """evict/offset [B, Hkv, T]: query heads of a group share their key/value head's row; the dense
    reference is a [B, H, T, T] additive mask written out by hand."""
    model = load_model(tiny_llama_dir).model
    B, T, H, Hkv = 2, 24, 4, 2
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(5))
    evict, offset = random_evictions(B, T, Hkv, seed=9)
    q, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    keep = (j <= q) & (q < evict.unsqueeze(2))  # [B, Hkv, T, T]
    mask = torch.where(keep, offset.unsqueeze(2).expand(B, Hkv, T, T), torch.tensor(float("-inf")))
    mask = mask.repeat_interleave(H // Hkv, dim=1)  # [B, H, T, T]
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        dense = last_logprobs(model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, -1])
        with evict_attention(model):
            out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1,
                        **evict_kwargs(evict, offset, query_chunk=5))
    assert_same(last_logprobs(out.logits[:, -1]), dense)
    shared = evict.amin(1, keepdim=True).expand(B, Hkv, T)  # one row for both heads: a different kept set
    with torch.no_grad(), evict_attention(model):
        other = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1,
                      **evict_kwargs(shared, offset))
    assert kl(dense, last_logprobs(other.logits[:, -1])).min() > 1e-6  # heads differ: the test can fail


def test_model_errors_restore_the_implementation(tiny_llama_dir):
    model = load_model(tiny_llama_dir).model
    before = model.config._attn_implementation
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(match="needs the eviction steps of the forward call"):
        with torch.no_grad(), evict_attention(model):
            assert model.config._attn_implementation == NAME
            model(input_ids=ids, use_cache=False)
    assert model.config._attn_implementation == before
    with pytest.raises(EvictAttentionError, match="an attention mask cannot be combined"):
        with torch.no_grad(), evict_attention(model):
            model(input_ids=ids, attention_mask=torch.zeros(1, 1, 4, 4), use_cache=False,
                  **evict_kwargs(torch.full((1, 4), 4), torch.zeros(1, 4)))
    assert model.config._attn_implementation == before
    with pytest.raises(EvictAttentionError, match="needs a transformers model"):
        with evict_attention(torch.nn.Linear(2, 2)):
            pass


def test_models_applying_their_own_windows_keep_the_dense_path():
    """GPT-Neo applies its local windows on cache indices: not supported, the dense mask is used."""
    own = LayerWindows((4, None), ("sliding_attention", "full_attention"), applies_own=True)
    plain = LayerWindows((4, None), ("sliding_attention", "full_attention"), keyed=True)
    model = torch.nn.Module()
    model.set_attn_implementation = lambda name: None
    assert not supported(model, own) and supported(model, plain)
    assert not supported(torch.nn.Linear(2, 2), plain)


@requires_reference
@pytest.mark.parametrize("name", OFFLINE)
def test_streaming_equals_dense_reference_model(name):
    check_model(load_model("reference").model, T=96, budget=16, name=name, query_chunk=40)


@pytest.mark.parametrize("name", ["sink_recent", "random"])
def test_head_granularity_streaming_equals_dense(tiny_llama_dir, name):
    """--granularity head: the engine's [B, Hkv, T] eviction steps through the evict path equal the
    dense [B, H, T, T] mask of the same decisions."""
    model = load_model(tiny_llama_dir).model
    T = 32
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(4))
    streaming = SEMANTICS["streaming"]
    fast, ev = streaming.stream(model, ids, make_policy(name, n_sink=2), 8, [0, 1], 1, "head")
    assert ev.evict.shape == (2, 2, T)
    assert_same(fast, streaming.kept_logprobs(model, ids, ev.kept(), None, "original"))
    full = next_token_logprobs(model, ids, torch.arange(T).expand(2, T))
    assert kl(full, fast).min() > 1e-5  # eviction changed the output: the equality is not of two no-ops
    if name == "random":  # per-head draws: the two KV heads keep different keys
        assert not torch.equal(ev.evict[:, 0], ev.evict[:, 1])
