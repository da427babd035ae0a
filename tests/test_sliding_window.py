"""Sliding-window and hybrid models: every semantics keeps, in each layer, the
policy's kept set within that layer's window; equal to naive token-by-token oracles that apply the
windows themselves (1e-5), and, with nothing evicted, to the model's own output."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import build_tokenizer
from engine_calls import prefill_evict_logprobs, retention_targets, streaming_logprobs
from oracles import windowed_prefill_evict, windowed_reencode, windowed_streaming_loop
from truncsens.divergences import kl
from truncsens.engine.forward import next_token_logprobs
from truncsens.budget.windows import cached_tokens_per_layer
from truncsens.engine.attention_windows import (
    FULL, SLIDING, LayerWindows, WindowError, attention_windows, layer_windows,
    own_window_differs)
from truncsens.engine.reference_pass import reference_pass
from truncsens.engine.semantics import SEMANTICS, SemanticsError
from truncsens.models import load_model
from truncsens.policies import Kept, make_policy
from truncsens.targets import TargetSet

WINDOW = 5
QWEN_TYPES = [FULL, SLIDING, SLIDING]  # max_window_layers=1: layers from index 1 slide
QWEN_WINDOWS = {FULL: None, SLIDING: WINDOW}


def _randomize(model) -> None:
    with torch.no_grad():  # larger weights than the default init, so distributions differ visibly
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)


def save_tiny(path, family: str) -> str:
    """Save a tiny random windowed checkpoint + tokenizer: ``mistral`` (1 layer, window 4) or
    ``qwen2`` (3 layers: full, sliding, sliding; window 5)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=1, sliding_window=4, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1, **common))
    _randomize(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_mistral_sw4"), "mistral")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen2_hybrid"), "qwen2")


def random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """[B, V] log-probabilities agree to 1e-5 (absolute + 1e-5 relative; probabilities absolute)."""
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.exp(), b.exp(), atol=1e-5, rtol=0)


def targets_of(ids: torch.Tensor) -> TargetSet:
    n, N = ids.shape
    return TargetSet([f"d{i}" for i in range(n)], np.arange(n) + N, ids, torch.zeros(n, dtype=torch.long))


# --- reading the windows -------------------------------------------------------------------------

def test_layer_windows_of_families():
    """Windows as the models decide them (config fields, transformers 5.x)."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GPTNeoConfig, GPTNeoForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    tiny = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    mistral = layer_windows(MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=4, **tiny)))
    assert mistral.windows == (4, 4) and not mistral.keyed and mistral.windowed
    assert attention_windows(MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=None, **tiny))) == [None, None]
    qwen = layer_windows(Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=7,
                                                      max_window_layers=2, **tiny)))
    assert qwen.windows == (None, None, 7, 7) and qwen.keyed and qwen.type_windows() == {FULL: None, SLIDING: 7}
    off = layer_windows(Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=7, **tiny)))
    assert off.windows == (None, None) and not off.windowed
    gemma = layer_windows(Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=4, sliding_window=6, head_dim=8, **tiny)))
    assert gemma.windows == (6, None, 6, None) and gemma.keyed
    assert attention_windows(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **tiny))) == [None, None]
    neo = layer_windows(GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                                                      window_size=3, attention_types=[[["global", "local"], 1]])))
    assert neo.windows == (None, 3) and neo.applies_own
    assert "of 4 tokens (2 of 2 layers)" in mistral.describe()


def test_cached_tokens_per_layer():
    assert cached_tokens_per_layer([None, 4, 4096], window=16, n_sink=4) == [20, 4, 20]
    assert cached_tokens_per_layer([8, None], window=3) == [3, 3]
    with pytest.raises(ValueError, match="must be non-negative"):
        cached_tokens_per_layer([None], window=-1)


def test_unsupported_layers_are_refused_naming_the_window():
    """Chunked attention (and any type neither full nor sliding) gets one clear error naming the
    model's windows, not a tensor-size error; so do different windows given one mask."""
    config = SimpleNamespace(num_hidden_layers=2, layer_types=[SLIDING, "chunked_attention"], sliding_window=4096,
                             _name_or_path="x")
    fake = SimpleNamespace(config=config, set_attn_implementation=lambda impl: None)
    for name in ("streaming", "prefill_evict"):
        with pytest.raises(SemanticsError, match=r"model m has chunked_attention layers .*4096 tokens.*semantics " + name):
            SEMANTICS[name].check_model(fake, "m")
    lw = LayerWindows((4, None), (SLIDING, FULL), keyed=False)
    with pytest.raises(WindowError, match="sliding-window layers of 4 tokens .* semantics streaming is not supported"):
        lw.check_supported("m", "streaming")
    LayerWindows((4, None), (SLIDING, FULL), keyed=True).check_supported("m", "streaming")


def test_own_window_differs():
    lw = LayerWindows((None, 3), (FULL, SLIDING), applies_own=True)
    assert not own_window_differs(lw, torch.tensor([[10, 11, 12, 13]]))  # contiguous: indices = positions - 10
    assert own_window_differs(lw, torch.tensor([[0, 11, 12, 13]]))  # a sink in front: index 1 apart, position 11
    assert own_window_differs(lw, torch.tensor([[0, 1, 12, 13]]))  # index 2 apart from the sink, position 12
    assert not own_window_differs(LayerWindows((None, 1), (FULL, SLIDING), applies_own=True), torch.tensor([[0, 9]]))


# --- the instance: 1-layer Mistral, window 4, suffix ------------------------------------

@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict", "reencode"])
def test_mistral_window_4_suffix_budgets(mistral_dir, semantics):
    """--policy suffix --budgets 2,3,4,8,16: no error; at budgets >= the window nothing a layer could
    see is evicted, so the metrics are those of the model's own output; below it they are not."""
    model = load_model(mistral_dir).model
    ids = random_ids(model.config.vocab_size, 3, 16, seed=1)
    budgets = [2, 3, 4, 8, 16]
    metrics, extras, _ = retention_targets(model, targets_of(ids), [make_policy("suffix")], budgets, semantics,
                                           "original", 0, "cpu", 10_000)
    k = metrics["kl"][0]  # [n, K]
    assert np.all(k[:, 2:] < 1e-6) and np.all(metrics["tv"][0][:, 2:] < 1e-5)
    assert np.all(metrics["top1_agree"][0][:, 2:] == 1)
    assert k[:, 0].min() > 1e-2  # budget 2 < window 4 really evicts
    np.testing.assert_array_equal(extras["kept_tokens"][0], np.array([budgets] * 3))


def test_mistral_cli_streaming(mistral_dir, corpus_dir, tmp_path):
    """The issue's command line runs (exit 0) and writes every budget."""
    from truncsens import results
    from truncsens.cli.main import app

    out = tmp_path / "r.nc"
    res = CliRunner().invoke(app, ["measure", "--model", mistral_dir, "--corpus", corpus_dir, "--policy", "suffix",
                                   "--budgets", "2,3,4,8,16", "--semantics", "streaming", "--reference-context", "16",
                                   "--targets-per-doc", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    ds = results.load(out)
    kl_ = ds["kl"].values  # [target, budget]
    assert kl_.shape[1] == 5 and np.all(kl_[:, 2:] < 1e-6) and kl_[:, 0].min() > 1e-2


def test_mistral_streaming_keeps_the_models_window(mistral_dir):
    """With nothing evicted the streaming mask keeps the model's window (the one-pass mask used to
    replace it: TV 0.414 in the issue): equal to the model's own output; a plain causal mask is not."""
    model = load_model(mistral_dir).model
    T = 20
    ids = random_ids(model.config.vocab_size, 2, T, seed=2)
    own = next_token_logprobs(model, ids, torch.arange(T).expand(2, T))
    everything = torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T)
    assert_same(streaming_logprobs(model, ids, everything, None), own)
    no_window = model(input_ids=ids, attention_mask=torch.zeros(2, 1, T, T).masked_fill(~everything.unsqueeze(1), float("-inf")),
                      use_cache=False).logits[:, -1].float().log_softmax(-1)
    assert kl(own, no_window).min() > 1e-2  # the window matters for this model: the test can fail


def test_reencode_original_positions_apply_the_window_on_positions(mistral_dir):
    """Sinks kept in front of a window lie outside the model's window on original positions: with
    sink_recent (2 sinks + 2 recent) the re-encoded output equals suffix 2, not what the model's own
    mask on sequence indices gives (the last of 4 re-encoded tokens would read the sinks)."""
    model = load_model(mistral_dir).model
    T = 24
    ids = random_ids(model.config.vocab_size, 2, T, seed=3)
    reencode = SEMANTICS["reencode"]
    q = torch.tensor([T - 1])
    sinks = reencode.kept_logprobs(model, ids, make_policy("sink_recent", n_sink=2).keep(T, 4, q, [0, 1]), None, "original")
    suffix = reencode.kept_logprobs(model, ids, make_policy("suffix").keep(T, 2, q, [0, 1]), None, "original")
    assert_same(sinks, suffix)
    index = torch.tensor([0, 1] + list(range(T - 2, T)))
    by_index = next_token_logprobs(model, ids[:, index], index.expand(2, 4))  # the model's own mask, on indices
    assert kl(by_index, sinks).min() > 1e-3


# --- a hybrid model in all three semantics, against the oracles -----------------------------------

POLICIES = ("suffix", "sink_recent", "random", "poisson")


def kept_for(model, ids: torch.Tensor, name: str, budget: int, queries: torch.Tensor) -> Kept:
    B, T = ids.shape
    policy = make_policy(name, n_sink=2)
    scores = None
    if policy.needs_scores:
        scores = reference_pass(model, ids, attention=True).attention.cumsum(1)[:, queries, :]  # [B, Q, T]
    return policy.keep(T, budget, queries, seeds=list(range(B)), scores=scores)


def test_hybrid_reference_pass_keeps_every_key(qwen2_dir):
    """The cache of a hybrid model holds all T - 1 keys in every layer; its output is the model's own."""
    model = load_model(qwen2_dir).model
    ids = random_ids(model.config.vocab_size, 2, 18, seed=4)
    ref = reference_pass(model, ids, last_attention=True, key_norm=True, keep_cache=True)
    assert [ref.cache.layers[l].keys.shape[2] for l in range(3)] == [17, 17, 17]
    assert ref.last_attention.shape == (2, 18) and ref.key_norm.shape == (2, 18)
    assert_same(ref.logprobs, next_token_logprobs(model, ids, torch.arange(18).expand(2, 18)))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", POLICIES)
def test_hybrid_streaming_equals_windowed_loop(qwen2_dir, name, impl):
    model = load_model(qwen2_dir).model
    model.set_attn_implementation(impl)
    T = 20
    ids = random_ids(model.config.vocab_size, 2, T, seed=5)
    kept = kept_for(model, ids, name, 8, torch.arange(T))
    fast = streaming_logprobs(model, ids, kept.keep, kept.offset)
    slow = windowed_streaming_loop(model, ids, kept.keep, kept.offset, QWEN_TYPES, QWEN_WINDOWS)
    assert_same(fast, slow)
    own = next_token_logprobs(model, ids, torch.arange(T).expand(2, T))
    assert kl(own, fast).min() > 1e-4  # eviction changed the output: the test can fail


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", POLICIES)
def test_hybrid_prefill_evict_equals_windowed_surgery(qwen2_dir, name, impl):
    model = load_model(qwen2_dir).model
    model.set_attn_implementation(impl)
    T = 20
    ids = random_ids(model.config.vocab_size, 3, T, seed=6)
    ref = reference_pass(model, ids, keep_cache=True)
    kept = kept_for(model, ids, name, 8, torch.tensor([T - 1]))
    keep, offset = kept.keep[:, 0], kept.offset[:, 0]
    fast = prefill_evict_logprobs(model, ref.cache, ids, keep, offset)
    slow = windowed_prefill_evict(model, ids, keep, offset, QWEN_TYPES, QWEN_WINDOWS)
    assert_same(fast, slow)
    assert (ref.logprobs - fast).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["suffix", "sink_recent", "random"])
def test_hybrid_reencode_original_equals_windowed_loop(qwen2_dir, name, impl):
    model = load_model(qwen2_dir).model
    model.set_attn_implementation(impl)
    T = 20
    ids = random_ids(model.config.vocab_size, 2, T, seed=7)
    kept = kept_for(model, ids, name, 9, torch.tensor([T - 1]))
    fast = SEMANTICS["reencode"].kept_logprobs(model, ids, kept, None, "original")
    index, _ = SEMANTICS["reencode"].gather(kept, 9, "original")  # [B, 9]
    assert_same(fast, windowed_reencode(model, ids, index, QWEN_TYPES, QWEN_WINDOWS))


@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict", "reencode"])
def test_hybrid_nothing_evicted_is_the_models_own_output(qwen2_dir, semantics):
    """A budget covering the context: every semantics gives the model's own output (1e-5)."""
    model = load_model(qwen2_dir).model
    ids = random_ids(model.config.vocab_size, 3, 16, seed=8)
    metrics, _, _ = retention_targets(model, targets_of(ids), [make_policy("suffix"), make_policy("sink_recent", n_sink=2)],
                                      [3, 16], semantics, "original", 0, "cpu", 10_000)
    assert np.all(metrics["kl"][:, :, 1] < 1e-6) and np.all(metrics["tv"][:, :, 1] < 1e-5)
    assert metrics["kl"][:, :, 0].min() > 1e-3


# --- other families: Gemma3 (alternating layers), GPT-Neo (windows inside the attention module) ----

def _load_random(cls, config, tmp_path) -> object:
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = cls(config)
    _randomize(model)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return load_model(str(tmp_path)).model


def test_gemma3_alternating_layers_equal_the_oracles(tmp_path):
    """Gemma3 text (sliding, full, sliding; window 5, keyed masks): streaming and prefill-evict equal
    the windowed oracles; with nothing evicted both give the model's own output."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=len(build_tokenizer()), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, num_hidden_layers=3, sliding_window=5,
                              sliding_window_pattern=2)
    model = _load_random(Gemma3ForCausalLM, config, tmp_path)
    types, windows = [SLIDING, FULL, SLIDING], {SLIDING: 5, FULL: None}
    assert list(layer_windows(model).layer_types) == types
    T = 16
    ids = random_ids(model.config.vocab_size, 2, T, seed=9)
    kept = kept_for(model, ids, "random", 7, torch.arange(T))
    assert_same(streaming_logprobs(model, ids, kept.keep, kept.offset),
                windowed_streaming_loop(model, ids, kept.keep, kept.offset, types, windows))
    ref = reference_pass(model, ids, keep_cache=True)
    keep, offset = kept.keep[:, -1], kept.offset[:, -1]
    assert_same(prefill_evict_logprobs(model, ref.cache, ids, keep, offset),
                windowed_prefill_evict(model, ids, keep, offset, types, windows))
    everything = torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T)
    assert_same(streaming_logprobs(model, ids, everything, None), ref.logprobs)
    assert_same(prefill_evict_logprobs(model, ref.cache, ids, everything[:, -1], None), ref.logprobs)


def test_gpt_neo_local_layers(tmp_path):
    """GPT-Neo applies its local window inside the attention module on cache indices, which are the
    original positions in streaming and prefill-evict (nothing evicted: the model's own output);
    re-encoding with original positions and a gap is refused, naming the window."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(vocab_size=len(build_tokenizer()), hidden_size=32, num_layers=2, num_heads=4, window_size=5,
                          attention_types=[[["global", "local"], 1]])
    model = _load_random(GPTNeoForCausalLM, config, tmp_path)
    ids = random_ids(model.config.vocab_size, 2, 16, seed=10)
    for semantics in ("streaming", "prefill_evict"):
        metrics, _, _ = retention_targets(model, targets_of(ids), [make_policy("sink_recent", n_sink=2)], [4, 16],
                                          semantics, "original", 0, "cpu", 10_000)
        assert np.all(metrics["kl"][0][:, 1] < 1e-6) and metrics["kl"][0][:, 0].min() > 1e-3
    kept = make_policy("sink_recent", n_sink=2).keep(16, 4, torch.tensor([15]), [0, 1])
    with pytest.raises(SemanticsError, match="sliding-window layers of 5 tokens .* --positions reindexed"):
        SEMANTICS["reencode"].kept_logprobs(model, ids, kept, None, "original")
    SEMANTICS["reencode"].kept_logprobs(model, ids, kept, None, "reindexed")


def test_two_layer_window_receptive_field(tmp_path):
    """2 layers of window 4: streaming with suffix k >= 4 evicts nothing any layer reads (exact zero
    from k = 4), while a re-encoded suffix of w tokens is exact only from the receptive field
    L·(W - 1) + 1 = 7 on (lower layers of earlier tokens read up to 3 tokens further back each)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=len(build_tokenizer()), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=2, sliding_window=4)
    model = _load_random(MistralForCausalLM, config, tmp_path)
    ids = random_ids(model.config.vocab_size, 3, 16, seed=11)
    budgets = [3, 4, 6, 7, 8]
    suffix = [make_policy("suffix")]
    streaming, _, _ = retention_targets(model, targets_of(ids), suffix, budgets, "streaming", "original", 0, "cpu", 10_000)
    reencode, _, _ = retention_targets(model, targets_of(ids), suffix, budgets, "reencode", "original", 0, "cpu", 10_000)
    s, r = streaming["kl"][0], reencode["kl"][0]  # [n, K]
    assert s[:, 0].min() > 1e-3 and np.all(s[:, 1:] < 1e-6)
    assert r[:, 2].min() > 1e-4 and np.all(r[:, 3:] < 1e-6)
