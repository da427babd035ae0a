"""Attention scores read from the model's own attention calls, in blocks of query rows, equal those of
the eager full matrix (to 1e-6 in float32): h2o, tova, snapkv_shared and poisson under prefill_evict, token and
head granularity, on a tiny Llama (one key/value head per query head), a grouped-query Llama, a
hybrid sliding-window Qwen2 and a GPT-2; the model's log-probabilities are unchanged; the eager fallback."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import hybrid_qwen2, peaked, sharp_tiny_llama
from truncsens.engine import reference_pass as reference_module
from truncsens.engine.attention_rows import AttentionNeeds, AttentionRows, RowAccumulator
from truncsens.engine.granularity import fold_reference
from truncsens.engine.reference_pass import head_counts, reference_pass
from truncsens.engine.score_attention import NotInterceptable
from truncsens.engine.semantics import SEMANTICS
from truncsens.policies import make_policy

POLICIES = {"h2o": {}, "tova": {}, "snapkv_shared": {"window": 6}, "poisson": {"n_sink": 2}}
T = 40


def mha_llama():
    """A random 2-layer Llama with 4 query and 4 key/value heads (no grouping), weights at std 0.3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))
    peaked(model)
    return model.eval()


def tiny_gpt2():
    """A random 2-layer GPT-2 (learned positions, 4 heads, no grouping)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)).eval()


MODELS = {"llama": mha_llama, "gqa_llama": sharp_tiny_llama, "hybrid_qwen2": hybrid_qwen2, "gpt2": tiny_gpt2}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def ids_for(model, batch: int = 2, length: int = T) -> torch.Tensor:
    return torch.randint(0, 60, (batch, length), generator=torch.Generator().manual_seed(3))  # [B, T]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("granularity", ["token", "head"])
def test_scores_equal_the_eager_matrix(model, granularity, impl):
    model.set_attn_implementation(impl)
    semantics = SEMANTICS["prefill_evict"]
    ids = ids_for(model)
    policies = [make_policy(name, **kw) for name, kw in POLICIES.items()]
    heads = head_counts(model)[1] if granularity == "head" else None
    ref = semantics.reference(model, ids, policies, granularity)
    eager = reference_pass(model, ids, attention=True, heads=heads)
    assert ref.attention is None and ref.rows is not None
    assert ref.rows.rows.shape[-2] < T  # only the rows the scores read
    if heads:
        ref, eager = fold_reference(ref), fold_reference(eager)
    queries = semantics.queries(T, "cpu")
    for policy in policies:
        got = semantics.scores(policy, ref, queries)
        want = semantics.scores(policy, eager, queries)
        assert got.shape == (ids.shape[0] * (heads or 1), 1, T)
        close(got, want)
    close(ref.last_attention, eager.last_attention)


def test_block_protocol_prefixes_equal_the_eager_matrix(model):
    """The last q queries' references (the block protocol's targets), cut to their c_j tokens."""
    semantics, q = SEMANTICS["prefill_evict"], 4
    ids = ids_for(model)
    policies = [make_policy(name, **kw) for name, kw in POLICIES.items()]
    ref = semantics.reference(model, ids, policies, queries=q)
    eager = reference_pass(model, ids, attention=True, queries=q)
    for c in range(T - q + 1, T + 1):
        query = torch.tensor([c - 1])
        for policy in policies:
            got = semantics.scores(policy, type(ref)(None, rows=ref.rows.prefix(c)), query)
            want = semantics.scores(policy, type(eager)(None, attention=eager.attention[:, :c, :c]), query)
            close(got, want)  # [B, 1, c]


def test_logprobs_are_those_of_the_models_own_attention(model):
    model.set_attn_implementation("sdpa")
    ids = ids_for(model)
    plain = reference_pass(model, ids, queries=3)
    needs = AttentionNeeds.of(rows=range(T), cumulative=range(T))
    read = reference_pass(model, ids, queries=3, needs=needs)
    torch.testing.assert_close(read.logprobs, plain.logprobs, atol=0, rtol=0)
    close(read.rows.rows, reference_pass(model, ids, attention=True, queries=3).attention)


def test_blocks_of_one_row_give_the_same_values():
    model = sharp_tiny_llama()
    ids = ids_for(model)
    needs = AttentionNeeds.of(rows=[0, 7, 38, 39], cumulative=[20, 38, 39])
    ref = reference_pass(model, ids, needs=needs)

    @contextlib.contextmanager
    def one_row(*args, **kwargs):
        with original(*args, **kwargs, block_elements=1) as acc:
            yield acc

    original = reference_module.intercept_attention
    try:
        reference_module.intercept_attention = one_row
        small = reference_pass(model, ids, needs=needs)
    finally:
        reference_module.intercept_attention = original
    close(small.rows.rows, ref.rows.rows)
    close(small.rows.cumulative, ref.rows.cumulative)


def test_eager_fallback_when_attention_cannot_be_read(monkeypatch):
    model = sharp_tiny_llama()
    ids = ids_for(model)
    needs = AttentionNeeds.of(rows=[5, 38], cumulative=[39])
    read = reference_pass(model, ids, needs=needs, heads=2)

    @contextlib.contextmanager
    def refuse(*args, **kwargs):
        raise NotInterceptable("test")
        yield

    monkeypatch.setattr(reference_module, "intercept_attention", refuse)
    fallback = reference_pass(model, ids, needs=needs, heads=2)
    assert fallback.rows.rows.shape[-2] == 2 + 1  # the asked rows and the last query's, cut from the full matrix
    for pos in (torch.tensor([5, 38, 39]),):
        close(read.rows.row(pos), fallback.rows.row(pos))
    close(read.rows.accumulated(torch.tensor([39])), fallback.rows.accumulated(torch.tensor([39])))


def test_a_row_not_collected_is_refused():
    rows = AttentionRows.of_matrix(torch.eye(4).unsqueeze(0)).prefix(3)
    with pytest.raises(ValueError, match="did not collect"):
        rows.row(torch.tensor([3]))


def naive_rows(query, key, mask, scaling, softcap):
    """[B, H, Tq, Tk] softmax by the textbook formula (keys repeated over each group)."""
    G = query.shape[1] // key.shape[1]
    s = query @ key.repeat_interleave(G, 1).transpose(-1, -2) * scaling  # [B, H, Tq, Tk]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.softmax(s + mask, -1)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_accumulator_with_softcap_and_a_float_mask(kv_heads):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Tq, Tk, d = 2, 4, 2, 5, 9, 8
    query, key = torch.randn(B, H, Tq, d, generator=g), torch.randn(B, Hkv, Tk, d, generator=g)
    mask = torch.where(torch.rand(B, 1, Tq, Tk, generator=g) < 0.3, -1e30, 0.0)  # float mask, some keys masked
    mask[..., 0] = 0.0
    acc = RowAccumulator(AttentionNeeds.of(rows=[4, 6], cumulative=[5, 8]), Tk, kv_heads, block_elements=B * H * Tk)
    acc.add(object(), query, key, mask, 0.3, softcap=2.0)
    p = naive_rows(query, key, mask, 0.3, 2.0)  # [B, H, Tq, Tk]; query i at position Tk - Tq + i = 4 + i
    p = p.sum(1) / H if kv_heads is None else p.view(B, Hkv, H // Hkv, Tq, Tk).sum(2) / (H // Hkv)  # mean over heads
    got = acc.result()
    close(got.row(torch.tensor([4, 6])), p[..., [0, 2], :])
    close(got.accumulated(torch.tensor([5, 8])), torch.stack([p[..., :2, :].sum(-2), p.sum(-2)], -2))


def test_the_dense_streaming_fallback_refuses_above_its_size(monkeypatch):
    from truncsens.engine import evict_attention
    from truncsens.engine.semantics import streaming as streaming_module
    from truncsens.engine.semantics.base import SemanticsError
    from truncsens.policies.streaming import Evictions

    model = sharp_tiny_llama()
    ids = ids_for(model, 1, 24)
    evictions = Evictions(torch.full((1, 24), 24), torch.zeros(1, 24))  # nothing evicted
    monkeypatch.setattr(evict_attention, "supported", lambda model, windows: False)
    semantics = SEMANTICS["streaming"]
    full = semantics.kept_logprobs(model, ids, evictions, None, "original")
    torch.testing.assert_close(full, reference_pass(model, ids).logprobs, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(streaming_module, "DENSE_MAX_BYTES", 24 * 24 * 8)  # below 1 + 4 + 4 bytes per entry
    with pytest.raises(SemanticsError, match="dense fallback"):
        semantics.kept_logprobs(model, ids, evictions, None, "original")


def test_a_local_override_of_the_attention_functions_is_read_too():
    """Importing NVIDIA kvpress sets ``ALL_ATTENTION_FUNCTIONS[name] = wrapped`` for every name (a local
    override of the shared instance, which the models read first): the rows are still read from the
    model's own calls, through the override, not from the eager fallback."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = sharp_tiny_llama()
    model.set_attn_implementation("sdpa")
    ids = ids_for(model)
    needs = AttentionNeeds.of(rows=[5, 38], windows=[(39, 6)])
    plain = reference_pass(model, ids, needs=needs)
    calls = []
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def wrapped(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    had = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapped
    try:
        read = reference_pass(model, ids, needs=needs)
    finally:
        if had:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert calls and ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    close(read.rows.rows, plain.rows.rows)
    close(read.rows.layer_windows, plain.rows.layer_windows)
