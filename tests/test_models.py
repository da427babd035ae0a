"""Model loading: local checkpoints, errors with fixes, devices, dtypes, context limits."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from truncsens.models import (
    ModelLoadError, _explain_hub_error, load_model, max_context_of, resolve_device, resolve_dtype,
)


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def test_load_tiny_llama(tiny_llama, tiny_llama_dir):
    lm = tiny_llama
    assert lm.max_context == 256
    assert lm.name == tiny_llama_dir
    assert lm.device == "cpu" and lm.dtype == "float32"
    assert lm.revision == ""
    assert not lm.model.training
    assert next(lm.model.parameters()).dtype == torch.float32
    assert lm.model.config.model_type == "llama"
    ids = lm.tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2 and max(ids) < lm.model.config.vocab_size
    with torch.no_grad():
        x = torch.tensor([ids])
        out = lm.model(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=1)
    assert out.logits.shape == (1, 1, lm.model.config.vocab_size)


def test_load_tiny_gpt2_context_from_n_positions(tiny_gpt2_dir):
    lm = load_model(tiny_gpt2_dir, dtype="bfloat16")
    assert lm.max_context == 256
    assert lm.dtype == "bfloat16"
    assert next(lm.model.parameters()).dtype == torch.bfloat16


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path))
    assert str(info.value) == f"{tmp_path} exists but holds no config.json: it is not a Hugging Face checkpoint folder"


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ModelLoadError, match=f"model path {missing} does not exist; pass an existing checkpoint folder"):
        load_model(missing)
    with pytest.raises(ModelLoadError, match="model path ./nope/model does not exist"):
        load_model("./nope/model")


def test_config_without_weights(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"cannot load model '{tmp_path}': .*model.safetensors"):
        load_model(str(tmp_path))


def test_unknown_architecture_and_broken_config(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    with pytest.raises(ModelLoadError, match=f"cannot read the config of {a}: .*no_such_arch"):
        load_model(str(a))
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a valid JSON file"):
        load_model(str(b))


def test_hub_id_offline_without_cache(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no local folder 'nobody-xyz/not-a-model', and cannot reach the Hugging Face hub"):
        load_model("nobody-xyz/not-a-model")


def test_explain_hub_error():
    assert _explain_hub_error("m", OSError("We couldn't connect to 'https://huggingface.co'")).startswith(
        "cannot reach the Hugging Face hub to fetch 'm'")
    assert _explain_hub_error("a/b", OSError("a/b is not a valid model identifier listed on hub")) == (
        "unknown model 'a/b': no such local folder and no such hub repository; check the spelling or pass a local path")
    assert _explain_hub_error("m", OSError("weird\nsecond line")) == "cannot load model 'm': weird"
    assert _explain_hub_error("m", OSError()) == "cannot load model 'm': OSError"


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_resolve_device_cuda_without_gpu(tiny_llama_dir):
    with pytest.raises(ValueError) as info:
        resolve_device("cuda")
    assert str(info.value) == "device 'cuda' asked for, but torch sees no CUDA GPU here; use --device cpu"
    with pytest.raises(ValueError, match="device 'cuda:1' asked for, but torch sees no CUDA GPU"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        load_model(tiny_llama_dir, device="cuda")


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype("float64") is torch.float64
    with pytest.raises(ValueError) as info:
        resolve_dtype("fp8")
    assert str(info.value) == "unknown dtype 'fp8'; choose one of float32, bfloat16, float16, float64"


def test_load_model_bad_dtype(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        load_model(tiny_llama_dir, dtype="half")


def test_max_context_of():
    assert max_context_of(SimpleNamespace(max_position_embeddings=4096)) == 4096
    assert max_context_of(SimpleNamespace(n_positions=1024)) == 1024
    assert max_context_of(SimpleNamespace(max_position_embeddings=None, n_ctx=2048)) == 2048
    assert max_context_of(SimpleNamespace(max_position_embeddings=0, seq_length=512)) == 512
    assert max_context_of(SimpleNamespace(hidden_size=8)) == 0  # no stated limit (ALiBi): N must be given


def test_a_model_without_a_context_limit_runs_with_an_explicit_n():
    """A BLOOM config states no position limit (ALiBi). Loading it said "pass --reference-context
    explicitly", and passing it did not help: the limit was demanded at load. Now the model loads, a run
    without N is refused with that advice, and a run with N measures."""
    import numpy as np
    from transformers import BloomConfig, BloomForCausalLM

    import truncsens
    from conftest import build_tokenizer
    from truncsens.engine.config import MeasureError

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = tiny_bloom(BloomConfig, BloomForCausalLM, len(tok))
    texts = [" ".join(["alpha beta gamma delta"] * 40)] * 2
    with pytest.raises(MeasureError, match=r"states no context limit.*pass reference_context=N \(--reference-context N\)"):
        truncsens.measure(model, tok, texts=texts, windows=[4], progress=False)
    ds = truncsens.measure(model, tok, texts=texts, reference_context=32, windows=[4, 31], progress=False)
    assert ds.attrs["max_context"] == 0 and np.all(ds["kl"].sel(window=4).values > 0)


def test_alibi_models_are_refused_by_the_masked_semantics_by_name():
    """BLOOM builds its ALiBi biases from a 2D padding mask: under streaming and prefill-evict it failed
    with "too many values to unpack"; now one error names the feature and the semantics that runs it,
    and re-encoding measures."""
    import numpy as np
    from transformers import BloomConfig, BloomForCausalLM

    import truncsens
    from conftest import build_tokenizer
    from truncsens.engine.semantics import SemanticsError

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = tiny_bloom(BloomConfig, BloomForCausalLM, len(tok))
    texts = [" ".join(["alpha beta gamma delta"] * 40)] * 2
    for semantics in ("streaming", "prefill_evict"):
        with pytest.raises(SemanticsError, match=f"ALiBi position biases, which semantics {semantics} cannot combine.*"
                                                 "--semantics reencode"):
            truncsens.measure(model, tok, texts=texts, reference_context=16, policies="sink_recent", budgets=[6],
                              semantics=semantics, progress=False)
    ds = truncsens.measure(model, tok, texts=texts, reference_context=16, policies="sink_recent", budgets=[6, 15],
                           semantics="reencode", progress=False)
    assert np.all(np.isfinite(ds["kl"].values))


def tiny_bloom(config_cls, model_cls, vocab: int):
    """A random 2-layer BLOOM; skips where the installed transformers' BLOOM takes no logits_to_keep
    (before transformers 5: truncsens refuses such a model at load, tested elsewhere)."""
    import inspect

    if "logits_to_keep" not in inspect.signature(model_cls.forward).parameters:
        pytest.skip("this transformers' BLOOM takes no logits_to_keep")
    return model_cls(config_cls(vocab_size=vocab, hidden_size=32, n_layer=2, n_head=4)).eval()
