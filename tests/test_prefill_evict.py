"""Prefill-evict semantics: the cached decode with a mask and the one-forward 4D mask both equal an
explicit cache surgery on a full prefill (to 1e-5 in float32); evicted attention mass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import requires_reference
from truncsens.divergences import kl
from truncsens.engine import kvcache
from engine_calls import prefill_evict_logprobs, retention_targets, streaming_logprobs
from oracles import prefill_evict_one_pass as prefill_evict_masked_logprobs
from oracles import prefill_evict_surgery as prefill_evict_surgery_logprobs
from truncsens.engine.reference_pass import reference_pass
from truncsens.models import load_model
from truncsens.policies import make_policy
from truncsens.targets import TargetSet

POLICIES = ("suffix", "sink_recent", "random", "poisson")


def random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """[B, V] log-probabilities agree to 1e-5 (absolute + 1e-5 relative; probabilities absolute)."""
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.exp(), b.exp(), atol=1e-5, rtol=0)


def target_kept(model, ids: torch.Tensor, name: str, budget: int, ref=None):
    """Kept keys of the last query only: keep [B, T], offset [B, T]."""
    B, T = ids.shape
    policy = make_policy(name, n_sink=2)
    q = torch.tensor([T - 1])
    scores = None
    if policy.needs_scores:
        ref = ref or reference_pass(model, ids, attention=True)
        scores = ref.attention.sum(1, keepdim=True)  # [B, 1, T] attention received over all queries
    kept = policy.keep(T, budget, q, seeds=list(range(B)), scores=scores)
    return kept.keep[:, 0], kept.offset[:, 0]


def check(model, T: int, budget: int, name: str, seed: int) -> None:
    ids = random_ids(model.config.vocab_size, 3, T, seed=seed)
    ref = reference_pass(model, ids, attention=True, keep_cache=True)
    keep, offset = target_kept(model, ids, name, budget, ref)
    assert int(keep[:, : T - 1].sum(-1).min()) < T - 1  # something was evicted
    surgery = prefill_evict_surgery_logprobs(model, ids, keep, offset)
    cached = prefill_evict_logprobs(model, ref.cache, ids, keep, offset)
    masked = prefill_evict_masked_logprobs(model, ids, keep, offset)
    assert_same(cached, surgery)
    assert_same(masked, surgery)
    assert (ref.logprobs - surgery).abs().amax(-1).min() > 1e-3  # eviction changed the output: the test can fail


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", POLICIES)
def test_prefill_evict_equals_cache_surgery_tiny_llama(tiny_llama_dir, name, impl):
    model = load_model(tiny_llama_dir).model
    model.set_attn_implementation(impl)
    check(model, T=40, budget=9, name=name, seed=5)


def test_prefill_evict_equals_cache_surgery_tiny_gpt2(tiny_gpt2_dir):
    check(load_model(tiny_gpt2_dir).model, T=30, budget=7, name="random", seed=12)


def test_cache_is_left_as_it_was_and_reused(tiny_llama_dir):
    model = load_model(tiny_llama_dir).model
    ids = random_ids(model.config.vocab_size, 2, 30, seed=6)
    ref = reference_pass(model, ids, keep_cache=True)
    before = [kvcache.layer_kv(ref.cache, l)[0].clone() for l in range(kvcache.n_layers(ref.cache))]
    a = prefill_evict_logprobs(model, ref.cache, ids, *target_kept(model, ids, "suffix", 4))
    prefill_evict_logprobs(model, ref.cache, ids, *target_kept(model, ids, "random", 7))
    b = prefill_evict_logprobs(model, ref.cache, ids, *target_kept(model, ids, "suffix", 4))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert ref.cache.get_seq_length() == 29
    for l, k in enumerate(before):
        assert torch.equal(kvcache.layer_kv(ref.cache, l)[0], k)


def test_prefill_evict_differs_from_streaming(tiny_llama_dir):
    """With multiple layers, evicting only before the target query is not streaming eviction."""
    model = load_model(tiny_llama_dir).model
    T = 40
    ids = random_ids(model.config.vocab_size, 2, T, seed=7)
    ref = reference_pass(model, ids, keep_cache=True)
    kept = make_policy("suffix").keep(T, 6, torch.arange(T), [0, 1])
    pe = prefill_evict_logprobs(model, ref.cache, ids, kept.keep[:, -1], kept.offset[:, -1])
    st = streaming_logprobs(model, ids, kept.keep, kept.offset)
    assert kl(pe, st).min() > 1e-4


@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict"])
def test_evicted_attention_mass(tiny_llama_dir, semantics):
    """The recorded mass is the full-context target query's attention (eager, mean over layers and
    heads) summed over the keys the policy evicted."""
    model = load_model(tiny_llama_dir).model
    n, N = 4, 32
    ids = random_ids(model.config.vocab_size, n, N, seed=8)
    targets = TargetSet([f"d{i}" for i in range(n)], np.arange(n) + N, ids, torch.zeros(n, dtype=torch.long))
    budgets = [4, 8, 32]
    policies = [make_policy("suffix"), make_policy("sink_recent", n_sink=2)]
    _, extras, _ = retention_targets(model, targets, policies, budgets, semantics, "original", 0, "cpu", 10_000)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    last = torch.stack(out.attentions)[:, :, :, -1, :].mean(dim=(0, 2))  # [L, B, H, T] -> [B, T]
    for j, k in enumerate(budgets):
        want_suffix = last[:, : N - k].sum(-1)
        want_sink = last[:, 2 : N - (k - 2)].sum(-1)
        np.testing.assert_allclose(extras["evicted_attention_mass"][0, :, j], want_suffix.numpy(), atol=1e-5)
        np.testing.assert_allclose(extras["evicted_attention_mass"][1, :, j], want_sink.numpy(), atol=1e-5)
        np.testing.assert_array_equal(extras["kept_tokens"][:, :, j], k)
    assert extras["evicted_attention_mass"][:, :, 0].min() > 0.05 and np.all(extras["evicted_attention_mass"][:, :, -1] == 0)


@requires_reference
@pytest.mark.parametrize("name", POLICIES)
def test_prefill_evict_equals_cache_surgery_reference(name):
    model = load_model("reference").model
    check(model, T=96, budget=16, name=name, seed=9)
