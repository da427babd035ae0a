"""``snapkv`` (SnapKV as published: kept sets per layer and key/value head from an observation window
of 64 prefill queries, average pooling of kernel 5) and ``snapkv_shared`` (the earlier ``snapkv``).

The per-layer, per-head kept sets equal a naive loop over the model's own queries and keys (plain
torch, one layer, head, window query and key at a time); the window and kernel options reach the
policies; ``snapkv`` is refused where its kept sets cannot run; ``snapkv_shared`` gives the values
``snapkv`` gave before (the golden run's numbers). Parity with kvpress's ``SnapKVPress`` is in
tests/test_kvpress_adapter.py (where kvpress is installed).
"""

from __future__ import annotations

import os

import pytest
import torch
from typer.testing import CliRunner

from conftest import sharp_tiny_llama
from truncsens.engine import kvcache
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.semantics import SEMANTICS
from truncsens.policies import PolicyError, make_policy
from truncsens.policies.kept import HeadKept

T = 40


def ids_for(batch: int = 2, length: int = T) -> torch.Tensor:
    return torch.randint(0, 60, (batch, length), generator=torch.Generator().manual_seed(3))  # [B, T]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def prefill_queries_and_keys(model, x: torch.Tensor):
    """Each layer's queries [B, H, T', d] (the module's q_proj of its input, rotated by the model's
    rotary embedding) and keys [B, Hkv, T', d] (the prefill cache) of the prefill of T' = T - 1 tokens."""
    seen = {}

    def hook(index):
        def record(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen[index] = (hidden, kwargs["position_embeddings"])
        return record

    layers = [layer.self_attn for layer in model.model.layers]
    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)]
    from transformers import DynamicCache

    cache = DynamicCache()
    try:
        with torch.no_grad():
            model(input_ids=x[:, :-1], use_cache=True, **{kvcache.cache_keyword(model): cache})
    finally:
        for h in handles:
            h.remove()
    out = []
    B, P = x.shape[0], x.shape[1] - 1
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    for i, module in enumerate(layers):
        hidden, (cos, sin) = seen[i]
        with torch.no_grad():
            q = module.q_proj(hidden).view(B, P, cfg.num_attention_heads, d).transpose(1, 2)  # [B, H, T', d]
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        out.append((q, kvcache.layer_kv(cache, i)[0]))
    return out


def naive_heads(model, x: torch.Tensor, budget: int, window: int, kernel: int) -> torch.Tensor:
    """[L, B, Hkv, k - 1] SnapKV's kept prefix keys, by the published recipe, one number at a time."""
    B, P, n = x.shape[0], x.shape[1] - 1, budget - 1
    out = []
    for q, k in prefill_queries_and_keys(model, x):
        H, Hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        G = H // Hkv
        layer = []
        for b in range(B):
            heads = []
            for h in range(Hkv):
                if n <= window:
                    heads.append(list(range(P - n, P)))
                    continue
                votes = [0.0] * (P - window)
                for i in range(P - window, P):  # the window's queries
                    for g in range(G):
                        logits = torch.stack([q[b, h * G + g, i] @ k[b, h, j] for j in range(i + 1)]) / d ** 0.5
                        probs = torch.softmax(logits, 0)
                        for j in range(P - window):
                            votes[j] += float(probs[j]) / (window * G)
                pooled = [sum(votes[t] for t in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= t < P - window) / kernel
                          for j in range(P - window)]
                best = sorted(range(P - window), key=lambda j: (-pooled[j], -j))[: n - window]
                heads.append(sorted(best + list(range(P - window, P))))
            layer.append(heads)
        out.append(layer)
    return torch.tensor(out)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("window,kernel", [(6, 3), (8, 5)])
def test_kept_sets_per_layer_and_head_equal_a_naive_loop(impl, window, kernel):
    model, x = sharp_tiny_llama(), ids_for()
    model.set_attn_implementation(impl)
    semantics = SEMANTICS["prefill_evict"]
    policy = make_policy("snapkv", window=window, kernel=kernel)
    ref = semantics.reference(model, x, [policy])
    assert ref.attention is None and ref.rows.layer_windows.shape == (2, 2, 2, 1, T)  # [L, B, Hkv, 1 window, T]
    queries = semantics.queries(T, "cpu")
    scores = semantics.scores(policy, ref, queries)  # [L, B, Hkv, 1, T]
    for budget in (3, window + 1, window + 4, 20, T - 1, T):
        kept = policy.keep(T, budget, queries, [0, 0], scores)
        assert isinstance(kept, HeadKept) and kept.heads.shape == (2, 2, 2, budget - 1)
        assert torch.equal(kept.heads, naive_heads(model, x, budget, window, kernel)), budget
        assert kept.keep.shape == (2, 1, T) and kept.keep.sum(-1).eq(budget).all()
    heads = policy.keep(T, 20, queries, [0, 0], scores).heads
    assert len({tuple(heads[layer, 0, h].tolist()) for layer in range(2) for h in range(2)}) > 1  # sets differ


def test_window_means_are_the_models_attention_rows():
    """The per-layer window means are those of the eager matrix of each layer (mean over the window's
    queries and each group's query heads), read in blocks of one query row too."""
    from truncsens.engine.attention_rows import AttentionNeeds
    from truncsens.engine.reference_pass import reference_pass

    model, x = sharp_tiny_llama(), ids_for()
    window = 7
    needs = AttentionNeeds.of(windows=[(T - 1, window)])
    got = reference_pass(model, x, needs=needs).rows.layer_window(T - 1, window)  # [L, B, Hkv, T]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(input_ids=x[:, :-1], output_attentions=True).attentions  # L x [B, H, T', T']
    model.set_attn_implementation("sdpa")
    want = torch.stack([a[:, :, T - 1 - window :].view(2, 2, 2, window, T - 1).mean((2, 3)) for a in att])  # [L, B, Hkv, T']
    torch.testing.assert_close(got[..., : T - 1], want, atol=1e-6, rtol=1e-6)
    assert not got[..., T - 1 :].any()  # the query's own key is after the window


def test_window_and_kernel_options_reach_the_policies():
    assert (make_policy("snapkv").window, make_policy("snapkv").kernel) == (64, 5)  # kvpress's SnapKVPress
    assert (make_policy("snapkv_shared").window, make_policy("snapkv_shared").kernel) == (8, 5)  # as before
    cfg = MeasureConfig(policies=["snapkv", "snapkv_shared"], semantics="prefill_evict")
    assert [(p.window, p.kernel) for p in cfg.build_policies()] == [(64, 5), (8, 5)]
    cfg = MeasureConfig(policies=["snapkv", "snapkv_shared"], semantics="prefill_evict", observation_window=16,
                        pooling_kernel=3)
    assert [(p.window, p.kernel) for p in cfg.build_policies()] == [(16, 3), (16, 3)]
    with pytest.raises(PolicyError, match="odd pooling kernel"):
        MeasureConfig(policies=["snapkv"], semantics="prefill_evict", pooling_kernel=4)
    with pytest.raises(PolicyError, match="observation window >= 1"):
        MeasureConfig(policies=["snapkv"], semantics="prefill_evict", observation_window=0)
    with pytest.raises(MeasureError, match=r"observation_window \(--observation-window\) sets SnapKV\'s observation window; give --policy snapkv"):
        MeasureConfig(policies=["h2o"], semantics="prefill_evict", observation_window=16)


def test_the_window_changes_what_is_kept():
    model, x = sharp_tiny_llama(), ids_for()
    semantics = SEMANTICS["prefill_evict"]
    small, large = make_policy("snapkv", window=4), make_policy("snapkv", window=12)
    ref = semantics.reference(model, x, [small, large])
    queries = semantics.queries(T, "cpu")
    a = small.keep(T, 20, queries, [0, 0], semantics.scores(small, ref, queries)).heads
    b = large.keep(T, 20, queries, [0, 0], semantics.scores(large, ref, queries)).heads
    assert not torch.equal(a, b)
    assert (b >= T - 1 - 12).sum(-1).eq(12).all()  # the large window's 12 keys are kept on every layer and head
    c = make_policy("snapkv", window=4, kernel=1).keep(T, 20, queries, [0, 0], semantics.scores(small, ref, queries)).heads
    assert not torch.equal(a, c)  # the kernel too


@pytest.mark.parametrize("kwargs,message", [
    (dict(semantics="streaming"), "snapkv cannot be run with semantics streaming: it needs the attention of an "
                                  "observation window .*use --semantics prefill_evict"),
    (dict(semantics="reencode"), "snapkv cannot be run with semantics reencode"),
    (dict(semantics="prefill_evict", granularity="head"), "snapkv keeps its own per-layer, per-head kept sets; leave "
                                                           "--granularity at token"),
    (dict(semantics="prefill_evict", protocol="block"), r"snapkv keeps one per layer and key/value head; use "
                                                         r"protocol='exact' \(--protocol exact\)"),
])
def test_refused_where_per_layer_head_sets_cannot_run(kwargs, message):
    with pytest.raises((PolicyError, MeasureError), match=message):
        MeasureConfig(policies=["snapkv"], **kwargs)
    MeasureConfig(policies=["snapkv_shared"], semantics="prefill_evict", protocol="block")  # one shared set: runs


def test_snapkv_shared_gives_the_earlier_snapkv_values(tmp_path):
    """The golden run's numbers of ``snapkv`` before it became SnapKV as published (tests/golden,
    measure_prefill.txt at that commit): mean TV and KL at budgets 8 and 16."""
    runner = CliRunner()
    from truncsens.cli.main import app

    here, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(tmp_path)
    torch.set_num_threads(2)
    try:
        result = runner.invoke(app, ["measure", "--reference-context", "64", "--max-docs", "3", "--targets-per-doc", "2",
                                     "--no-progress", "--policy", "snapkv_shared", "--semantics", "prefill_evict",
                                     "--budgets", "8,16", "--out", "p.nc"])
    finally:
        torch.set_num_threads(threads)
        os.chdir(here)
    assert result.exit_code == 0, result.output
    means = [float(line.split()[2]) for line in result.stdout.splitlines() if line.strip().startswith(("8 ", "16 "))]
    assert means == pytest.approx([0.40819, 0.17529, 0.933, 0.14633], rel=2e-3)


def test_refused_on_sliding_window_layers_naming_snapkv_shared(tmp_path, corpus_dir):
    """A model with sliding-window layers: ``snapkv`` (a kept set per layer and key/value head) is refused
    before any document is read, in one ``error:`` line that names the windows and ``snapkv_shared``;
    ``snapkv_shared`` runs on the same model."""
    from conftest import build_tokenizer, hybrid_qwen2
    from truncsens.cli.main import app

    folder = tmp_path / "qwen2"
    hybrid_qwen2().save_pretrained(folder)
    build_tokenizer(300).save_pretrained(folder)
    common = ["measure", "--model", str(folder), "--corpus", corpus_dir, "--reference-context", "32", "--max-docs", "2",
              "--targets-per-doc", "1", "--budgets", "8", "--semantics", "prefill_evict", "--no-progress"]
    result = CliRunner().invoke(app, common + ["--policy", "snapkv", "--out", str(tmp_path / "a.nc")])
    assert result.exit_code != 0
    assert result.output.strip() == (
        "error: policy snapkv keeps a kept set per layer and key/value head, which prefill_evict cannot combine "
        "with sliding-window layers; this model has sliding-window layers of 5 tokens (2 of 3 layers): use --policy "
        "snapkv_shared (the same rule, one kept set for every layer and head), which runs there")
    assert not (tmp_path / "a.nc").exists()
    result = CliRunner().invoke(app, common + ["--policy", "snapkv_shared", "--out", str(tmp_path / "b.nc")])
    assert result.exit_code == 0, result.output
