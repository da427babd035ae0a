"""Key re-rotation under prefill_evict (--positions reindexed) and decoding on a gathered cache.

The strong check: in a ONE-layer RoPE model a key depends only on its token and its position, so a
prefill_evict cache whose kept keys are re-rotated to positions 0..k-2 holds exactly the keys (and
values) of re-encoding the kept tokens at positions 0..k-1: the two next-token distributions agree.
(With more layers the keys of layer >= 1 carry the evicted context, and they legitimately differ.)
"""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from truncsens.cli.main import app
from truncsens.engine.config import MeasureConfig
from truncsens.engine.rerotation import HeadKept, RotaryError, decode_gathered, rerotate
from truncsens.engine.semantics import SemanticsError, semantics_for
from truncsens.policies import Kept, make_policy
from conftest import sharp_tiny_llama

T = 24


def ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (batch, T), generator=torch.Generator().manual_seed(seed))


def prefill_evict(model, x, policy, budget, positions):
    sem = semantics_for("prefill_evict")
    ref = sem.reference(model, x, [policy])
    return sem.policy_logprobs(model, x, policy, budget, [0] * x.shape[0], ref, positions)[0]


def reencode(model, x, policy, budget, positions):
    sem = semantics_for("reencode")
    kept = policy.keep(T, budget, sem.queries(T, x.device), [0] * x.shape[0])
    return sem.kept_logprobs(model, x, kept, None, positions)


def test_rerotate_equals_rope_at_the_new_position():
    """R(p' - p) applied to a key rotated at p equals transformers' own RoPE at p' (independent code)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0)
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(0))  # [B, H, n, d] before RoPE
    old = torch.tensor([[3, 7, 11, 40, 41]])
    new = torch.tensor([[0, 1, 2, 3, 4]])

    def at(pos):
        cos, sin = rope(x, pos)
        return apply_rotary_pos_emb(x, x, cos, sin)[1]

    moved = rerotate(at(old), (new - old).view(1, 1, 5), rope.inv_freq)
    assert torch.allclose(moved, at(new), atol=1e-5)
    assert (at(old) - at(new)).abs().max() > 0.1  # the rotation matters


def test_rerotate_partial_rotary_closed_form():
    """One rotary pair (θ = 1) of a 4-dim head: (x0, x1) turns by delta radians, x2 and x3 are untouched."""
    k = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # [n=1, d=4]
    out = rerotate(k, torch.tensor([2]), torch.tensor([1.0]))
    c, s = math.cos(2.0), math.sin(2.0)
    assert torch.allclose(out, torch.tensor([[1.0 * c - 2.0 * s, 2.0 * c + 1.0 * s, 3.0, 4.0]]), atol=1e-6)


@pytest.mark.parametrize("name,params,budget", [("suffix", {}, 8), ("sink_recent", {"n_sink": 4}, 10)])
def test_rerotated_prefill_evict_equals_reindexed_reencode_on_one_layer(name, params, budget, monkeypatch):
    model, x = sharp_tiny_llama(1), ids()
    policy = make_policy(name, **params)
    rerotated = prefill_evict(model, x, policy, budget, "reindexed")
    assert (rerotated - reencode(model, x, policy, budget, "reindexed")).abs().max() < 1e-4
    original = prefill_evict(model, x, policy, budget, "original")
    assert (original - reencode(model, x, policy, budget, "original")).abs().max() < 1e-4
    # RoPE sees relative positions only: a contiguous kept set reads the same either way, sinks do not
    assert ((original - rerotated).abs().max() < 1e-4) == (name == "suffix")
    # the check can fail: the query moved to k - 1 without re-rotating the keys is another distribution
    monkeypatch.setattr("truncsens.engine.rerotation.rerotate", lambda keys, delta, inv_freq: keys)
    assert (prefill_evict(model, x, policy, budget, "reindexed") - rerotated).abs().max() > 1e-2


def test_gathered_decode_equals_masked_decode():
    """Token-level kept sets of different sizes per row, with logit offsets, and the same sets given per
    head: decoding on a gathered cache equals the masked decode of the full prefill cache (2 layers)."""
    model, x = sharp_tiny_llama(2), ids(3)
    sem = semantics_for("prefill_evict")
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(3, 1, T, generator=g) < torch.tensor([0.3, 0.5, 0.8]).view(3, 1, 1)
    keep[:, :, -1] = True
    offset = torch.where(keep, torch.rand(3, 1, T, generator=g), torch.zeros(3, 1, T))
    kept = Kept(keep, offset, torch.tensor([T - 1]))
    ref = sem.reference(model, x, [make_policy("suffix")])
    masked = sem.kept_logprobs(model, x, kept, ref, "original")
    assert len({int(c) for c in keep.sum(-1).flatten()}) == 3  # rows of different sizes: padding is exercised
    assert (decode_gathered(model, x, kept, ref.cache, reindex=False) - masked).abs().max() < 1e-5
    # per-head sets, all heads equal (one row size, no offsets)
    same = torch.zeros(3, 1, T, dtype=torch.bool)
    same[:, :, [0, 2, 5, 9, 17, T - 1]] = True
    plain = sem.kept_logprobs(model, x, Kept(same, torch.zeros(3, 1, T), kept.queries), ref, "original")
    heads = torch.tensor([0, 2, 5, 9, 17]).expand(2, 3, 2, 5)  # [L, B, H_kv, n]
    per_head = HeadKept(same, torch.zeros(3, 1, T), kept.queries, heads)
    assert (sem.kept_logprobs(model, x, per_head, ref, "original") - plain).abs().max() < 1e-5
    assert ref.cache.get_seq_length() == T - 1  # the prefill cache is left as it was


def test_non_rope_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64)).eval()
    with pytest.raises(RotaryError, match="needs a RoPE model"):
        prefill_evict(model, ids(), make_policy("suffix"), 8, "reindexed")


def tiny_deepseek_v2():
    """Multi-head latent attention, 2 layers: the cache holds a 16-wide latent ("keys") and the 4-wide
    rotary key part ("values") per token."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1)).eval()


def test_multi_head_latent_attention_gathers_by_own_widths_and_refuses_rerotation():
    """DeepSeek-V2 caches a latent and a rotary part of different widths: decoding on a gathered cache
    equals the masked decode (it raised a size mismatch before, gathering the values with the keys'
    width), and re-rotation, which would rotate the latent, is refused by name."""
    model, x = tiny_deepseek_v2(), ids(2)
    sem = semantics_for("prefill_evict")
    ref = sem.reference(model, x, [make_policy("suffix")])
    keep = torch.zeros(2, 1, T, dtype=torch.bool)
    keep[0, :, [0, 3, 7, 20, T - 1]] = True
    keep[1, :, [1, 2, 11, 15, 19, 22, T - 1]] = True
    kept = Kept(keep, torch.zeros(2, 1, T), torch.tensor([T - 1]))
    masked = sem.kept_logprobs(model, x, kept, ref, "original")
    assert (decode_gathered(model, x, kept, ref.cache, reindex=False) - masked).abs().max() < 1e-5
    assert (masked - ref.logprobs).abs().max() > 1e-3  # eviction moved the output: the check can fail
    with pytest.raises(RotaryError, match=r"DeepseekV2ForCausalLM uses multi-head latent attention \(kv_lora_rank\)"):
        prefill_evict(model, x, make_policy("suffix"), 8, "reindexed")


def test_positions_reindexed_accepted_by_prefill_evict_only():
    MeasureConfig(policies=["suffix"], semantics="prefill_evict", positions="reindexed", out="x.nc")
    with pytest.raises(SemanticsError, match=r"works only with semantics \(--semantics\) reencode or prefill_evict"):
        MeasureConfig(policies=["suffix"], semantics="streaming", positions="reindexed", out="x.nc")


def test_cli_non_rope_reindexed_one_error_line_nothing_written(tiny_gpt2_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    r = CliRunner().invoke(app, ["measure", "--model", tiny_gpt2_dir, "--corpus", corpus_dir, "--reference-context", "32",
                                 "--targets-per-doc", "1", "--max-docs", "1", "--policy", "suffix", "--semantics",
                                 "prefill_evict", "--positions", "reindexed", "--budgets", "8", "--out", str(out),
                                 "--no-progress", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "RoPE" in errors[0]
    assert not out.exists()
