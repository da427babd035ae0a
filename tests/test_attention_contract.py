"""One contract for every path that computes attention (a path that disagreed with the model's own attention went unnoticed).

For tiny random models of every architecture family the tests can build from a config: with
nothing evicted (k = N) every semantics and every policy path gives the model's own output (KL below
1e-8: before the fix, soft-capped Gemma 2 and GPT-OSS with learned sinks were 0.05 and 0.25 TV away
on the streaming one-pass path), and at a small budget the one-pass streaming forward equals a
token-by-token run over a cache that holds only the kept keys (the model's own attention; oracle in
tests/oracles.py), as does prefill-evict, and the online run (h2o, tova) equals a real cache that
evicts as it goes. DeepSeek-V2/V3 (multi-head latent attention: cached keys and values of different
widths) and StableLM and Falcon (decoder layers that do not pass the call's keyword arguments on to
attention: the one-pass path falls back to the dense mask) are among the families. What a path
cannot reproduce is refused with one error naming the feature.

Every registered policy that a semantics accepts runs on every family (a new policy cannot skip
one): before, only sink_recent, random and h2o did, and ``snapkv`` (kept sets per layer and key/value
head) crashed under prefill_evict on DeepSeek-V2/V3, whose cache holds one latent head for all heads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_calls import prefill_evict_logprobs, retention_targets
from oracles import evicting_loop, layer_head_prefill_evict, merging_loop, windowed_prefill_evict, windowed_streaming_loop
from truncsens.engine.attention_features import attention_features
from truncsens.engine.attention_windows import layer_windows
from truncsens.engine.evict_attention import EvictAttentionError, evict_attention, evict_kwargs
from truncsens.engine.reference_pass import reference_pass
from truncsens.engine.semantics import SEMANTICS, SemanticsError
from truncsens.policies import POLICIES, make_policy
from truncsens.policies.kept import HeadKept
from truncsens.targets import TargetSet

V = 64
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64)
# multi-head latent attention: the cache holds a 16-wide latent as keys and the 4-wide rotary key part
# as values; keys of 8 + 4 = 12 and values of 6 per head (a dense first layer, then two experts)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=32,
           first_k_dense_replace=1)


def build(family: str):
    """A seeded random model of ``family`` with peaked attention (weights at std 0.3)."""
    import transformers as tf

    torch.manual_seed(0)
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **COMMON)),
        "mistral_swa": lambda: tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=4, **COMMON)),
        "qwen2_hybrid": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, use_sliding_window=True,
                                                                   sliding_window=4, max_window_layers=1, **COMMON)),
        "gemma2_softcap": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
            num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=1.0,
            final_logit_softcapping=None, **COMMON)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                                   sliding_window_pattern=2, **COMMON)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                         bos_token_id=0, eos_token_id=0)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(bos_token_id=0, eos_token_id=0, **COMMON)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, bos_token_id=0,
                                                         eos_token_id=0, **COMMON)),
        "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(num_key_value_heads=2, pad_token_id=0, bos_token_id=0,
                                                            eos_token_id=0, **COMMON)),
        "gpt_oss_sinks": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(
            num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)),
        "deepseek_v2_mla": lambda: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**MLA, **COMMON)),
        "deepseek_v3_mla": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(n_group=1, topk_group=1, **MLA,
                                                                                **COMMON)),
        # decoder layers that call their attention without the forward call's keyword arguments
        "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(num_key_value_heads=2, **COMMON)),
        "falcon_rotary": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=False, multi_query=True,
            new_decoder_architecture=False, bos_token_id=0, eos_token_id=0)),
    }
    model = configs[family]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith("sinks"):
                p.normal_(0.0, 0.3 if p.dim() >= 2 else 1.0)
    return model.eval()


FAMILIES = ("llama", "mistral_swa", "qwen2_hybrid", "gemma2_softcap", "gemma3", "gpt2", "gpt_neox", "phi3", "olmo2",
            "gpt_oss_sinks", "deepseek_v2_mla", "deepseek_v3_mla", "stablelm", "falcon_rotary")
T = 16


def random_ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(seed))  # [B, T]


def targets_of(ids: torch.Tensor) -> TargetSet:
    n, N = ids.shape
    return TargetSet([f"d{i}" for i in range(n)], np.arange(n) + N, ids, torch.zeros(n, dtype=torch.long))


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.exp(), b.exp(), atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, build(request.param)


def accepted_policies(semantics: str) -> list:
    """Every registered policy whose needs ``semantics`` provides (2 sinks; SnapKV's observation window
    of 4 queries, so that at k = 6 of 16 it votes for prefix keys), in registry order."""
    out = []
    for name in POLICIES:
        policy = make_policy(name, n_sink=2, window=4)
        if policy.requirements() <= SEMANTICS[semantics].provides:
            out.append(policy)
    return out


def refused_on(model, semantics: str, policy) -> bool:
    """Kept sets per layer and key/value head are refused on sliding-window layers (prefill_evict);
    merging policies run on their own (tests below) and are refused on sliding-window layers."""
    return (semantics == "prefill_evict" and policy.layer_heads and layer_windows(model).windowed) or policy.merges


def test_every_registered_policy_is_accepted_somewhere():
    accepted = {p.name for s in ("streaming", "prefill_evict") for p in accepted_policies(s)}
    assert accepted == set(POLICIES)
    assert {p.name for p in accepted_policies("prefill_evict")} == set(POLICIES)


def test_the_families_have_the_features_they_are_built_for(family_model):
    family, model = family_model
    names = {f.name for f in attention_features(model)}
    assert names == {"gemma2_softcap": {"softcap"}, "gpt_oss_sinks": {"sinks"}}.get(family, set())


@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict"])
def test_nothing_evicted_is_the_models_own_output(family_model, semantics):
    """k = N: every registered policy the semantics accepts (streaming: the one-pass path from eviction
    steps, or the online path with the model's eager attention; prefill_evict: the masked decode, or the
    decode of per-layer, per-head kept sets) gives KL < 1e-8 to the full context; at k = 3 eviction
    moves (inside the windows of 4 too) the output (the check can fail). ``snapkv`` on sliding-window
    layers is refused, naming snapkv_shared, which runs there."""
    family, model = family_model
    policies = accepted_policies(semantics)
    runs = [p for p in policies if not refused_on(model, semantics, p)]
    targets = targets_of(random_ids(3, 1))
    metrics, _, _ = retention_targets(model, targets, runs, [3, T], semantics, "original", 0, "cpu", 10_000)
    kl = metrics["kl"]  # [P, n, K]
    assert kl[:, :, 1].max() < 1e-8, (family, dict(zip([p.name for p in runs], kl[:, :, 1].max(axis=1))))
    assert kl[0, :, 0].min() > 1e-4
    for policy in policies:
        if policy.merges:  # at their smallest budget (sinks, a slot to merge into and the query)
            k = policy.min_budget()
            if layer_windows(model).windowed:
                with pytest.raises(SemanticsError, match=rf"policy {policy.name} merges keys of different positions "
                                                         "into one slot, which sliding-window layers cannot window"):
                    retention_targets(model, targets, [policy], [k, T], semantics, "original", 0, "cpu", 10_000)
                continue
            metrics, _, _ = retention_targets(model, targets, [policy], [k, T], semantics, "original", 0, "cpu", 10_000)
            assert metrics["kl"][0, :, 1].max() < 1e-8, (family, policy.name)
            assert metrics["kl"][0, :, 0].min() > 1e-4, (family, policy.name)
        elif policy not in runs:
            with pytest.raises(SemanticsError, match=rf"policy {policy.name} keeps a kept set per layer and key/value "
                                                     rf"head.*use --policy {policy.shared_variant} "):
                retention_targets(model, targets, [policy], [3, T], semantics, "original", 0, "cpu", 10_000)


def test_streaming_one_pass_equals_a_cache_of_the_kept_keys(family_model):
    """k = 6 of 16 with 2 sinks: the engine's one-pass streaming forward equals a token-by-token run
    whose cache holds exactly the kept keys of each step (within each layer's window)."""
    family, model = family_model
    ids = random_ids(2, 2)
    fast, ev = SEMANTICS["streaming"].stream(model, ids, make_policy("sink_recent", n_sink=2), 6, [0, 1], 1, "token")
    kept = ev.kept()  # [B, T, T]
    windows = layer_windows(model)
    slow = windowed_streaming_loop(model, ids, kept.keep, None, list(windows.layer_types), windows.type_windows())
    assert_same(fast, slow)


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_streaming_online_equals_an_evicting_cache(family_model, name, monkeypatch):
    """k = 6 of 16, online attention scores: the engine's sequential run equals a real cache that drops
    each evicted key, with its own statistics and decisions (oracles.evicting_loop: the same eviction
    steps); for windowed models (that oracle's cache keeps every key it is not told to drop) a
    token-by-token run over a cache of the keys the engine kept, within each layer's window. Slack 0
    compacts the engine's cache (``kvcache.gather_slots``) as soon as dead slots outnumber the cached
    keys, so compaction runs within 16 tokens (multi-head latent attention caches keys and values of
    different widths: before gathering each by its own shape, DeepSeek-V2/V3 failed here)."""
    import functools

    from truncsens.engine.semantics import streaming as streaming_semantics

    family, model = family_model
    monkeypatch.setattr(streaming_semantics, "stream_online",
                        functools.partial(streaming_semantics.stream_online, slack=0))
    ids = random_ids(2, 4)
    policy = make_policy(name, n_sink=2)
    fast, ev = SEMANTICS["streaming"].stream(model, ids, policy, 6, [0, 1], 1, "token")
    windows = layer_windows(model)
    if windows.windowed:
        kept = ev.kept()  # [B, T, T]
        slow = windowed_streaming_loop(model, ids, kept.keep, kept.offset, list(windows.layer_types),
                                       windows.type_windows())
    else:
        slow, evict = evicting_loop(model, ids, policy, 6, [0, 1])
        assert torch.equal(ev.evict, evict), "the engine and the real cache evicted different keys"
    assert_same(fast, slow)


def test_prefill_evict_equals_a_pruned_cache(family_model):
    family, model = family_model
    ids = random_ids(2, 3)
    kept = make_policy("sink_recent", n_sink=2).keep(T, 6, torch.tensor([T - 1]), [0, 1])
    keep_last = kept.keep[:, 0]  # [B, T]
    ref = reference_pass(model, ids, keep_cache=True)
    windows = layer_windows(model)
    fast = prefill_evict_logprobs(model, ref.cache, ids, keep_last, None)
    assert_same(fast, windowed_prefill_evict(model, ids, keep_last, None, list(windows.layer_types),
                                             windows.type_windows()))


def test_every_prefill_evict_policy_equals_its_naive_reference(family_model):
    """k = 6 of 16: the kept set every accepted policy decides (from the engine's own scores) decodes
    under prefill_evict to what a naive run over that kept set gives, one sequence at a time: a
    token-level set (with its Hájek offsets) against a cache that holds only its keys within each
    layer's window; ``snapkv``'s sets per layer and key/value head against a decode whose layers each
    mask every query head with its key/value head's set (on DeepSeek-V2/V3, whose cache holds one
    latent head for all heads, the engine crashed with a raw gather error before)."""
    family, model = family_model
    ids = random_ids(2, 3)
    semantics = SEMANTICS["prefill_evict"]
    windows = layer_windows(model)
    queries = semantics.queries(T, "cpu")
    for policy in accepted_policies("prefill_evict"):
        if refused_on(model, "prefill_evict", policy):
            continue
        ref = semantics.reference(model, ids, [policy])
        kept = policy.keep(T, 6, queries, [5, 6], semantics.scores(policy, ref, queries))
        fast = semantics.kept_logprobs(model, ids, kept, ref, "original")
        if isinstance(kept, HeadKept):
            sets = {tuple(kept.heads[layer, b, h].tolist()) for layer in range(kept.heads.shape[0])
                    for b in range(2) for h in range(kept.heads.shape[2])}
            assert len(sets) > 1, (family, policy.name)  # the sets differ between layers and heads
            slow = layer_head_prefill_evict(model, ids, kept.heads)
        else:
            slow = windowed_prefill_evict(model, ids, kept.keep[:, 0], kept.offset[:, 0], list(windows.layer_types),
                                          windows.type_windows())
        assert_same(fast, slow)


@pytest.mark.parametrize("semantics", ["streaming", "prefill_evict"])
def test_merging_caches_equal_a_naive_merging_loop(family_model, semantics):
    """k = 6 of 16, 2 sinks: each merging policy equals a k-slot cache rebuilt from lists of merged
    tokens at every step (oracles.merging_loop) on every family without sliding-window layers
    (multi-head latent attention merges its cached latents and rotary parts alike)."""
    family, model = family_model
    if layer_windows(model).windowed:
        return  # refused (test_nothing_evicted_is_the_models_own_output)
    ids = random_ids(2, 4)
    sem = SEMANTICS[semantics]
    for name, rule in (("merge_mean", "mean"), ("merge_nearest", "nearest")):
        policy = make_policy(name, n_sink=2)
        fast, _ = sem.policy_logprobs(model, ids, policy, 6, [0, 1], sem.reference(model, ids, [policy]), "original")
        assert_same(fast, merging_loop(model, ids, rule, 6, 2, semantics=semantics))


def test_attention_from_eviction_steps_refuses_what_it_cannot_apply():
    """An attention argument it cannot apply (ALiBi, a position bias) stops the forward with one error
    naming the feature and the semantics that run the model's own attention."""
    from truncsens.engine import evict_attention as ea

    q = torch.zeros(1, 2, 3, 4)
    kwargs = evict_kwargs(torch.full((1, 3), 3), torch.zeros(1, 3))
    module = torch.nn.Module()
    with pytest.raises(EvictAttentionError, match=r"ALiBi position biases \(alibi\) is not applied .* reencode and prefill_evict"):
        ea.evict_attention_forward(module, q, q[:, :1], q[:, :1], None, alibi=torch.zeros(1), **kwargs)
    with pytest.raises(EvictAttentionError, match="position bias"):
        ea.evict_attention_forward(module, q, q[:, :1], q[:, :1], None, position_bias=torch.zeros(1), **kwargs)


def test_a_model_that_ignores_the_attention_interface_gets_the_dense_mask(monkeypatch):
    """When fewer layers called the eviction-step attention than the model has (a model whose
    attention does not go through the interface), the one-pass output is discarded and the dense
    mask is used: the result still equals the token-by-token cache."""
    from truncsens.engine import evict_attention as ea

    model = build("llama")
    monkeypatch.setattr(ea, "attention_calls", lambda kwargs: 0)
    ids = random_ids(2, 2)
    fast, ev = SEMANTICS["streaming"].stream(model, ids, make_policy("sink_recent", n_sink=2), 6, [0, 1], 1, "token")
    windows = layer_windows(model)
    assert_same(fast, windowed_streaming_loop(model, ids, ev.kept().keep, None, list(windows.layer_types),
                                              windows.type_windows()))


@pytest.mark.parametrize("family,feature", [("gemma2_softcap", "sliding-window"), ("gpt_oss_sinks", "sliding-window")])
def test_certify_refuses_with_the_feature_named(family, feature):
    from truncsens.certificates.probe import CertifyModelError, check_model

    with pytest.raises(CertifyModelError, match=feature):
        check_model(build(family), family)


def test_certify_refuses_softcapping_by_name():
    import transformers as tf

    from truncsens.certificates.probe import CertifyModelError, check_model

    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(num_key_value_heads=2, head_dim=8, attn_logit_softcapping=1.0,
                                                 sliding_window=None, layer_types=["full_attention"] * 2, **COMMON))
    with pytest.raises(CertifyModelError, match=r"soft-capping \(attn_logit_softcapping\).*truncsens measure applies"):
        check_model(model, "gemma2")
