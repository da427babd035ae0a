"""The kvpress adapter (``--policy kvpress:<PressClass>``).

Error handling and the adapter's own logic run always, against a small stand-in ``kvpress`` module
put in ``sys.modules`` (a ScorerPress base and two presses written from kvpress's documented
conventions). Parity with NVIDIA kvpress itself runs only where kvpress is importable (its own
environment: ``pip install 'truncsens[kvpress]'``; see benchmarks/kvpress_parity.py).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch
from typer.testing import CliRunner

from truncsens.cli.main import app
from truncsens.engine.config import MeasureConfig
from truncsens.engine.semantics import semantics_for
from truncsens.policies import PolicyError, make_policy, policy_class
from truncsens.policies.kvpress_adapter import compression_ratio, parse_policy_args
from conftest import sharp_tiny_llama

T = 32
HINT = "pip install 'truncsens[kvpress]'"


def stand_in_kvpress() -> types.ModuleType:
    """A module with kvpress's ScorerPress interface: KnormPress and StreamingLLMPress scores as kvpress defines them."""
    mod = types.ModuleType("kvpress")

    @dataclass
    class ScorerPress:
        compression_ratio: float = 0.0

        def __post_init__(self):
            assert 0 <= self.compression_ratio < 1, "Compression ratio must be between 0 and 1"

        def post_init_from_model(self, model):
            pass

    @dataclass
    class KnormPress(ScorerPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return -keys.norm(dim=-1)  # [B, H, T']

    @dataclass
    class StreamingLLMPress(ScorerPress):
        n_sink: int = 4

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            k_len = keys.shape[2]
            assert k_len > self.n_sink, f"Input should contain more tokens than n_sink={self.n_sink}"
            pruned = k_len - int(k_len * (1 - self.compression_ratio))
            scores = torch.ones_like(keys[..., 0])
            scores[:, :, self.n_sink: self.n_sink + pruned] = 0
            return scores

    @dataclass
    class AdaKVPress:  # not a ScorerPress
        press: object = None

    for cls in (ScorerPress, KnormPress, StreamingLLMPress, AdaKVPress):
        setattr(mod, cls.__name__, cls)
    mod.__version__ = "stand-in"
    return mod


@pytest.fixture
def fake_kvpress(monkeypatch):
    mod = stand_in_kvpress()
    monkeypatch.setitem(sys.modules, "kvpress", mod)
    return mod


def ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, T), generator=torch.Generator().manual_seed(3))


def run(model, x, policy, budget, positions="original"):
    sem = semantics_for("prefill_evict")
    ref = sem.reference(model, x, [policy])
    return sem.policy_logprobs(model, x, policy, budget, [0] * x.shape[0], ref, positions)


# -- errors (always run) --

def test_not_importable_names_the_press_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress -> ImportError
    with pytest.raises(PolicyError) as info:
        policy_class("kvpress:KnormPress")
    assert "kvpress:KnormPress" in str(info.value) and HINT in str(info.value)


def test_unknown_or_unsupported_press(fake_kvpress):
    with pytest.raises(PolicyError, match="kvpress has no press 'NoSuchPress'"):
        policy_class("kvpress:NoSuchPress")
    with pytest.raises(PolicyError, match="AdaKVPress is not a ScorerPress"):
        policy_class("kvpress:AdaKVPress")
    with pytest.raises(PolicyError, match="--positions reindexed"):
        policy_class("kvpress:KeyRerotationPress")
    with pytest.raises(PolicyError, match="needs a press class"):
        policy_class("kvpress:")


def test_registry_and_press_arguments(fake_kvpress):
    cls = policy_class("kvpress:StreamingLLMPress")
    assert cls.name == "kvpress:StreamingLLMPress" and cls.press == "StreamingLLMPress"
    assert make_policy("kvpress:StreamingLLMPress", policy_args={"n_sink": 2}, n_sink=9).policy_args == {"n_sink": 2}
    assert make_policy("kvpress:KnormPress", policy_args={"n_sink": 2}).policy_args is None  # not a Knorm parameter
    with pytest.raises(PolicyError, match="compression_ratio follows from --budgets"):
        make_policy("kvpress:KnormPress", policy_args={"compression_ratio": 0.5})


def test_wrong_semantics_and_stray_policy_args(fake_kvpress):
    for semantics in ("streaming", "reencode"):
        with pytest.raises(PolicyError, match="use --semantics prefill_evict"):
            MeasureConfig(policies=["kvpress:KnormPress"], semantics=semantics, out="x.nc")
    with pytest.raises(PolicyError, match=r"policy_args \(--policy-arg\) sets parameters of kvpress"):
        MeasureConfig(policies=["suffix"], semantics="prefill_evict", policy_args={"n_sink": 2}, out="x.nc")
    both = ["kvpress:KnormPress", "kvpress:StreamingLLMPress"]
    cfg = MeasureConfig(policies=both, semantics="prefill_evict", policy_args={"n_sink": 2}, out="x.nc")
    assert [p.policy_args for p in cfg.build_policies()] == [None, {"n_sink": 2}]
    with pytest.raises(PolicyError, match="n_sinks: no parameter of press KnormPress, StreamingLLMPress; their parameters: n_sink"):
        MeasureConfig(policies=both, semantics="prefill_evict", policy_args={"n_sinks": 2}, out="x.nc")
    cfg = MeasureConfig(policies=["kvpress:KnormPress"], semantics="prefill_evict", out="x.nc")
    assert "policy_args" not in cfg.fingerprint()  # runs without --policy-arg keep their fingerprint


def test_parse_policy_args():
    assert parse_policy_args(["a=3", "b=0.5", "c=true", "d=False", "e=text", "f=-2"]) == \
        {"a": 3, "b": 0.5, "c": True, "d": False, "e": "text", "f": -2}
    assert parse_policy_args(None) is None
    for bad in (["novalue"], ["=3"], ["a=1", "a=2"]):
        with pytest.raises(PolicyError):
            parse_policy_args(bad)


def test_compression_ratio_keeps_k_minus_1_as_kvpress_counts():
    """kvpress keeps max(1, int(T' (1 - r))) of T' = T - 1 prefix keys: exactly k - 1 for every k and T."""
    for context in range(3, 400):
        for budget in range(2, context + 1):
            r = compression_ratio(budget, context)
            assert 0 <= r < 1
            assert max(1, int((context - 1) * (1 - r))) == budget - 1, (budget, context)


@pytest.mark.parametrize("extra,message", [
    (["--policy", "kvpress:NoSuchPress", "--semantics", "prefill_evict"], "kvpress has no press 'NoSuchPress'"),
    (["--policy", "kvpress:KnormPress", "--semantics", "streaming"], "use --semantics prefill_evict"),
    (["--policy", "kvpress:KnormPress", "--semantics", "prefill_evict", "--policy-arg", "bogus"], "key=value"),
    (["--policy", "kvpress:StreamingLLMPress", "--semantics", "prefill_evict", "--policy-arg", "n_sinks=2"],
     "n_sinks: no parameter of press StreamingLLMPress"),
])
def test_cli_one_error_line_exit_2_nothing_written(fake_kvpress, tmp_path, extra, message):
    out = tmp_path / "r.nc"
    r = CliRunner().invoke(app, ["measure", "--out", str(out), "--no-progress", *extra])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.output
    assert not out.exists()


# -- the adapter's logic, with the stand-in presses (always run) --

def test_streaming_llm_press_equals_sink_recent(fake_kvpress):
    """Every head keeps the same keys (4 sinks and the most recent): the per-head gathered decode equals
    truncsens's own sink_recent policy decoded with a mask of the full prefill cache."""
    model, x = sharp_tiny_llama(), ids()
    for k in (8, 20):
        lp, keep = run(model, x, make_policy("kvpress:StreamingLLMPress"), k)
        lp_ref, keep_ref = run(model, x, make_policy("sink_recent", n_sink=4), k)
        assert torch.equal(keep, keep_ref)
        assert (lp - lp_ref).abs().max() < 1e-5
    with pytest.raises(PolicyError, match="cannot score layer 0"):  # the press's own check, as one clear error
        run(model, x[:, :5], make_policy("kvpress:StreamingLLMPress", policy_args={"n_sink": 4}), 3)


def test_knorm_press_keeps_lowest_norm_keys_per_head(fake_kvpress):
    """Kept sets equal a naive per-(layer, head) sort of key norms; the token view keeps k keys."""
    model, x = sharp_tiny_llama(), ids()
    policy, k = make_policy("kvpress:KnormPress"), 9
    sem = semantics_for("prefill_evict")
    ref = sem.reference(model, x, [policy])
    kept = policy.keep(T, k, sem.queries(T, x.device), [0, 0], sem.scores(policy, ref, sem.queries(T, x.device)))
    for layer in range(2):
        keys = ref.cache.layers[layer].keys  # [B, H, T-1, d]
        for b in range(2):
            for h in range(2):
                naive = sorted(torch.argsort(keys[b, h].norm(dim=-1))[: k - 1].tolist())
                assert kept.heads[layer, b, h].tolist() == naive
    assert kept.keep.sum(-1).flatten().tolist() == [k, k] and bool(kept.keep[:, 0, -1].all())
    # heads disagree here, so the per-head decode is not any one token-level set's decode
    assert len({tuple(kept.heads[0, 0, h].tolist()) for h in range(2)}) == 2


# -- parity with NVIDIA kvpress (only where it is installed) --

def kvpress_logprobs(model, x, press, rerotated: bool) -> torch.Tensor:
    """kvpress's own run: its press hooks during the prefill of T - 1 tokens, then its pipeline's decode
    of the question token (at the original position, or at the cache length after re-rotation)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            model.model(input_ids=x[:, : T - 1], past_key_values=cache)
        position = cache.get_seq_length() if rerotated else T - 1
        out = model(input_ids=x[:, T - 1:], past_key_values=cache, logits_to_keep=1,
                    position_ids=torch.full((x.shape[0], 1), position))
    return torch.log_softmax(out.logits[:, -1].double(), -1)


def test_parity_with_kvpress():
    kvpress = pytest.importorskip("kvpress", reason="NVIDIA kvpress is not installed (pip install 'truncsens[kvpress]')")
    model, x = sharp_tiny_llama(), ids()
    for press_name, args in (("KnormPress", {}), ("StreamingLLMPress", {"n_sink": 4})):
        for k in (6, 17):
            ratio = compression_ratio(k, T)
            policy = make_policy(f"kvpress:{press_name}", policy_args=args)
            press = getattr(kvpress, press_name)(compression_ratio=ratio, **args)
            assert (run(model, x, policy, k)[0] - kvpress_logprobs(model, x, press, False)).abs().max() < 1e-5
            rerotation = kvpress.KeyRerotationPress(getattr(kvpress, press_name)(compression_ratio=ratio, **args))
            ours = run(model, x, policy, k, "reindexed")[0]
            assert (ours - kvpress_logprobs(model, x, rerotation, True)).abs().max() < 1e-5


@pytest.mark.parametrize("window,kernel", [(8, 5), (6, 3)])
def test_snapkv_parity_with_kvpress_snapkv_press(window, kernel):
    """``snapkv`` keeps, per layer and key/value head, what kvpress's ``SnapKVPress`` keeps (its own
    ``score`` and ``topk`` on each layer's prefill inputs, through the adapter), and decodes what
    kvpress's own run decodes, at budgets where the window fits (k - 1 > w: below, kvpress gives the
    window keys equal scores and ``torch.topk`` chooses among them)."""
    kvpress = pytest.importorskip("kvpress", reason="NVIDIA kvpress is not installed (pip install 'truncsens[kvpress]')")
    model, x = sharp_tiny_llama(), ids()
    sem = semantics_for("prefill_evict")
    ours = make_policy("snapkv", window=window, kernel=kernel)
    press_args = {"window_size": window, "kernel_size": kernel}
    adapter = make_policy("kvpress:SnapKVPress", policy_args=press_args)
    ref = sem.reference(model, x, [ours, adapter])
    queries = sem.queries(T, "cpu")
    for k in (window + 2, 17, T - 2):
        heads = ours.keep(T, k, queries, [0, 0], sem.scores(ours, ref, queries)).heads  # [L, B, Hkv, k-1]
        theirs = adapter.head_index(k, *sem.scores(adapter, ref, queries))  # kvpress's score and topk, sorted
        assert torch.equal(heads, theirs), k
        got = sem.policy_logprobs(model, x, ours, k, [0, 0], ref, "original")[0]  # [B, V]
        for b in range(x.shape[0]):
            press = kvpress.SnapKVPress(compression_ratio=compression_ratio(k, T), **press_args)
            want = kvpress_logprobs(model, x[b : b + 1], press, False)[0]
            assert (got[b] - want).abs().max() < 1e-5, k


def test_record_prefill_keeps_each_layers_prefill_inputs():
    """Hidden states of the prefill only (not the decode), and the cache under both keyword conventions."""
    from truncsens.engine.prefill_layers import record_prefill

    model, x = sharp_tiny_llama(), ids()
    sem = semantics_for("prefill_evict")
    with record_prefill(model) as layers:
        ref = sem.reference(model, x, [make_policy("suffix")])
    assert len(layers.modules) == 2 and [h.shape for h in layers.hidden_states] == [(2, T - 1, 32)] * 2
    # layer 0's input is the normalised embedding of the prefill tokens
    layer0 = model.model.layers[0].input_layernorm(model.model.embed_tokens(x[:, : T - 1]))
    assert torch.allclose(layers.hidden_states[0], layer0, atol=1e-6)
    assert layers.kwargs[1]["past_key_values"] is ref.cache
    assert layers.kwargs[0]["cache_position"].tolist()[-1] == T - 2
