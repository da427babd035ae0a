"""Streaming semantics: the one-pass 4D-mask forward equals a token-by-token loop that rebuilds the
cache at every step (to 1e-5 in float32), on a tiny random Llama and on the reference model."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_reference
from truncsens.divergences import kl
from engine_calls import prefill_evict_logprobs, streaming_logprobs
from oracles import streaming_loop as streaming_logprobs_loop
from truncsens.engine.forward import next_token_logprobs
from truncsens.engine.masks import additive_mask, streaming_mask
from truncsens.engine.reference_pass import reference_pass
from truncsens.models import load_model
from truncsens.policies import make_policy

POLICIES = ("suffix", "sink_recent", "random", "poisson")


def random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


def assert_same(fast: torch.Tensor, slow: torch.Tensor, full: torch.Tensor | None = None) -> None:
    """Two [B, V] float32 log-probability tensors agree to 1e-5: log-probabilities (absolute plus
    1e-5 relative, for logits of large magnitude), probabilities, and divergences from ``full``."""
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.exp(), slow.exp(), atol=1e-5, rtol=0)
    if full is not None:
        torch.testing.assert_close(kl(full, fast), kl(full, slow), atol=1e-5, rtol=0)


def streaming_kept(model, ids: torch.Tensor, name: str, budget: int):
    """Per-query kept sets of a policy (poisson scores from the reference pass)."""
    B, T = ids.shape
    policy = make_policy(name, n_sink=2)
    queries = torch.arange(T)
    scores = reference_pass(model, ids, attention=True).attention.cumsum(1) if policy.needs_scores else None
    return policy.keep(T, budget, queries, seeds=list(range(B)), scores=scores)


def test_additive_mask_values_and_errors():
    keep = torch.tensor([[[True, False, True]]])
    offset = torch.tensor([[[0.0, 5.0, 0.7]]])
    m = additive_mask(keep, offset, torch.float32)
    assert m.shape == (1, 1, 1, 3)
    lowest = torch.finfo(torch.float32).min  # transformers' masked value, not -inf (a row of -inf gives NaN)
    assert m[0, 0, 0, 0] == 0 and m[0, 0, 0, 1] == lowest and m[0, 0, 0, 2] == pytest.approx(0.7)
    assert additive_mask(keep, None, torch.bfloat16)[0, 0, 0, 1] == torch.finfo(torch.bfloat16).min
    with pytest.raises(ValueError, match="keeps no key"):
        additive_mask(torch.zeros(1, 1, 3, dtype=torch.bool), None, torch.float32)
    with pytest.raises(ValueError, match="not causal"):
        streaming_mask(torch.ones(1, 3, 3, dtype=torch.bool), None, torch.float32)
    sm = streaming_mask(torch.tensor([[[True, False, False], [False, True, False], [True, False, True]]]), None,
                        torch.float32)  # [1, 1, 3, 3]
    want = torch.tensor([[0, -1, -1], [-1, 0, -1], [0, -1, 0]], dtype=torch.float32)
    assert torch.equal(sm[0, 0] == lowest, want == -1) and sm[0, 0, 2, 2] == 0 and torch.isfinite(sm).all()


def test_mask_reaches_the_model(tiny_llama_dir):
    """A full causal mask gives the unmasked forward; a suffix mask changes the distribution."""
    model = load_model(tiny_llama_dir).model
    ids = random_ids(model.config.vocab_size, 2, 40)
    full = next_token_logprobs(model, ids, torch.arange(40).expand(2, 40))
    same = streaming_logprobs(model, ids, torch.ones(40, 40, dtype=torch.bool).tril().expand(2, 40, 40), None)
    assert_same(same, full)
    kept = make_policy("suffix").keep(40, 4, torch.arange(40), [0, 1])
    assert kl(full, streaming_logprobs(model, ids, kept.keep, kept.offset)).min() > 1e-3


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", POLICIES)
def test_streaming_equals_token_loop_tiny_llama(tiny_llama_dir, name, impl):
    model = load_model(tiny_llama_dir).model
    model.set_attn_implementation(impl)
    ids = random_ids(model.config.vocab_size, 2, 40, seed=1)
    kept = streaming_kept(model, ids, name, budget=9)
    if name == "poisson":
        assert kept.has_offsets()  # the Hájek offsets take part in the comparison
    fast = streaming_logprobs(model, ids, kept.keep, kept.offset)
    slow = streaming_logprobs_loop(model, ids, kept.keep, kept.offset)
    full = next_token_logprobs(model, ids, torch.arange(40).expand(2, 40))
    assert_same(fast, slow, full)
    assert kl(full, fast).min() > 1e-4  # eviction really changed the output: the test can fail


@pytest.mark.parametrize("name", ["sink_recent", "poisson"])
def test_streaming_equals_token_loop_tiny_gpt2(tiny_gpt2_dir, name):
    """Learned absolute positions, fused qkv, modules named ``attn``: the same equality."""
    model = load_model(tiny_gpt2_dir).model
    ids = random_ids(model.config.vocab_size, 2, 30, seed=11)
    kept = streaming_kept(model, ids, name, budget=7)
    fast = streaming_logprobs(model, ids, kept.keep, kept.offset)
    full = next_token_logprobs(model, ids, torch.arange(30).expand(2, 30))
    assert_same(fast, streaming_logprobs_loop(model, ids, kept.keep, kept.offset), full)
    assert (full - fast).abs().amax(-1).min() > 1e-3  # (small-init GPT-2: eviction changes log-probs by ~1e-2)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_poisson_with_every_pi_one_equals_no_eviction(tiny_llama_dir, impl):
    model = load_model(tiny_llama_dir).model
    model.set_attn_implementation(impl)
    check_no_eviction(model, T=32)


@requires_reference
def test_poisson_with_every_pi_one_equals_no_eviction_reference():
    check_no_eviction(load_model("reference").model, T=64)


def check_no_eviction(model, T: int) -> None:
    """Poisson at a budget covering the context: every pi = 1, no offsets, the full-context output."""
    B = 3
    ids = random_ids(model.config.vocab_size, B, T, seed=2)
    ref = reference_pass(model, ids, attention=True, keep_cache=True)
    policy = make_policy("poisson", n_sink=2)
    queries = torch.arange(T)
    pi, _ = policy.design(T, queries, ref.attention.cumsum(1))
    assert torch.all(pi[torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)] == 1)
    kept = policy.keep(T, T, queries, list(range(B)), ref.attention.cumsum(1))
    assert not kept.has_offsets()
    full = next_token_logprobs(model, ids, torch.arange(T).expand(B, T))
    assert_same(streaming_logprobs(model, ids, kept.keep, kept.offset), full)
    assert_same(prefill_evict_logprobs(model, ref.cache, ids, kept.keep[:, -1], kept.offset[:, -1]), full)


def test_reference_pass_statistics(tiny_llama_dir):
    """Attention means equal eager output_attentions; key norms equal the cache's; the model's
    attention implementation is restored."""
    model = load_model(tiny_llama_dir).model
    before = model.config._attn_implementation
    B, T = 2, 24
    ids = random_ids(model.config.vocab_size, B, T, seed=3)
    ref = reference_pass(model, ids, last_attention=True, attention=True, key_norm=True, keep_cache=True)
    assert model.config._attn_implementation == before
    model.set_attn_implementation("eager")
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True, use_cache=True)
    want = torch.stack(out.attentions).mean(dim=(0, 2))  # [L, B, H, T, T] -> [B, T, T]
    torch.testing.assert_close(ref.attention, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref.last_attention, want[:, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(ref.attention.sum(-1), torch.ones(B, T), atol=1e-5, rtol=0)
    norms = torch.stack([out.past_key_values.layers[l].keys.norm(dim=-1).mean(1) for l in range(model.config.num_hidden_layers)]).mean(0)
    torch.testing.assert_close(ref.key_norm, norms, atol=1e-5, rtol=1e-5)
    assert_same(ref.logprobs, torch.log_softmax(out.logits[:, -1].float().double(), -1))
    assert ref.cache.get_seq_length() == T - 1


@requires_reference
@pytest.mark.parametrize("name", POLICIES)
def test_streaming_equals_token_loop_reference(name):
    model = load_model("reference").model
    ids = random_ids(model.config.vocab_size, 2, 64, seed=4)
    kept = streaming_kept(model, ids, name, budget=16)
    fast = streaming_logprobs(model, ids, kept.keep, kept.offset)
    slow = streaming_logprobs_loop(model, ids, kept.keep, kept.offset)
    assert_same(fast, slow, next_token_logprobs(model, ids, torch.arange(64).expand(2, 64)))
