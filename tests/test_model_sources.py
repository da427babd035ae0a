"""The registry of model sources: which spec goes where, own corpora, version compatibility, imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from truncsens.models.huggingface import check_logits_to_keep, dtype_keyword
from truncsens.models import (
    SOURCES, GgufSource, HubSource, LoadedModel, LocalFolderSource, ModelLoadError, ReferenceSource, SyntheticSource, load_model,
    model_source,
)
from truncsens.models.synthetic import synthetic_documents
from truncsens.targets import TokenDoc

from conftest import requires_reference


@pytest.mark.parametrize("spec, kind", [
    ("reference", "reference"),
    ("synthetic:0.5", "synthetic"),
    ("synthetic-geometric:0.02:512", "synthetic"),
    ("synthetic", "synthetic"),  # malformed, but parse_spec names the accepted forms
    ("synthetic-org/model", "hub"),  # a hub id that merely starts with "synthetic"
    ("Qwen/Qwen2.5-0.5B", "hub"),
    ("gpt2", "hub"),
    ("./nope/model", "local"),
    ("/no/such/folder", "local"),
    ("~/models/x", "local"),
    ("a/b/c", "local"),
    ("./models/m.Q4_K_M.gguf", "gguf"),
    ("smollm2-135m", "gguf"),
])
def test_model_source_kind(spec, kind):
    assert model_source(spec).kind == kind


def test_existing_folder_is_local_and_order_of_sources(tmp_path):
    assert model_source(str(tmp_path)).kind == "local"
    assert [type(s) for s in SOURCES] == [ReferenceSource, SyntheticSource, GgufSource, LocalFolderSource, HubSource]
    assert [s.kind for s in SOURCES] == ["reference", "synthetic", "gguf", "local", "hub"]
    assert [s.has_own_corpus for s in SOURCES] == [False, True, False, False, False]


def test_synthetic_documents_through_the_source():
    docs = model_source("synthetic:0.5:64").documents("synthetic:0.5:64", n_docs=3, length=50, seed=4)
    direct = synthetic_documents("synthetic:0.5:64", n_docs=3, length=50, seed=4)
    assert all(isinstance(d, TokenDoc) for d in docs)
    assert [d.id for d in docs] == ["synthetic-00000", "synthetic-00001", "synthetic-00002"]
    for d, (doc_id, ids) in zip(docs, direct):
        assert d.id == doc_id and torch.equal(d.ids, ids) and d.ids.shape == (50,) and d.ids.dtype == torch.long


@pytest.mark.parametrize("spec", ["reference", "Qwen/Qwen2.5-0.5B", "./nope/model"])
def test_sources_without_corpus_refuse_documents(spec):
    source = model_source(spec)
    with pytest.raises(ValueError) as info:
        source.documents(spec, n_docs=2, length=10)
    assert str(info.value) == f"model {spec!r} ({source.kind} source) has no corpus of its own; pass a text corpus"


def test_loaded_model_records_its_source(tiny_llama_dir):
    assert load_model("synthetic:0.5:64").source == "synthetic"
    assert load_model(tiny_llama_dir).source == "local"
    by_hand = LoadedModel(model=None, tokenizer=None, name="x", revision="", tokenizer_name="x", max_context=8,
                          device="cpu", dtype="float32")
    assert by_hand.source == "hub"


@requires_reference
def test_reference_source():
    loaded = load_model("reference")
    assert (loaded.source, loaded.name, loaded.tokenizer_name) == ("reference", "reference", "reference")


def test_load_checks_device_and_dtype_for_every_source():
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        load_model("synthetic:0.5", dtype="half")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        model_source("synthetic:0.5").load("synthetic:0.5", device="gpu0")


def test_dtype_keyword_follows_the_transformers_version():
    assert dtype_keyword("4.53.3") == "torch_dtype"
    assert dtype_keyword("4.55.4") == "torch_dtype"
    assert dtype_keyword("4.56.0") == "dtype"
    assert dtype_keyword("4.56.0.dev0") == "dtype"
    assert dtype_keyword("5.24.0") == "dtype"


class _NoKeep(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, **kwargs):
        return input_ids


class _Keep(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, **kwargs):
        return input_ids


def test_check_logits_to_keep():
    check_logits_to_keep(_Keep(), "ok")  # takes it: no error
    with pytest.raises(ModelLoadError, match=r"model 'old' \(_NoKeep\) takes no logits_to_keep argument in transformers "
                                             r"[0-9.]+.*upgrade transformers"):
        check_logits_to_keep(_NoKeep(), "old")


def test_a_checkpoint_folder_without_tokenizer_files_is_refused_saying_what_is_missing(tmp_path, corpus_dir):
    """transformers 5.x builds, for a GPT-2 folder without tokenizer files, a tokenizer of one special
    token that turns every text into 0 tokens: the run said "no document is long enough ... the longest
    has 0 tokens". Now loading stops with one error naming the missing files and the model's vocabulary;
    the same folder with its tokenizer saved measures."""
    from typer.testing import CliRunner
    from transformers import GPT2Config, GPT2LMHeadModel

    from conftest import build_tokenizer
    from truncsens.cli.main import app

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(folder)
    args = ["measure", "--model", str(folder), "--corpus", corpus_dir, "--reference-context", "32", "--max-docs", "2",
            "--targets-per-doc", "1", "--windows", "4", "--no-progress", "--out", str(tmp_path / "r.nc")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    missing = ("the folder has none of the files a tokenizer's vocabulary is read from (tokenizer.json, vocab.json + "
               "merges.txt, vocab.txt, tokenizer.model); save the model's tokenizer beside the weights "
               "(tokenizer.save_pretrained(folder))")
    assert result.output.strip() in (  # 5.x builds an empty tokenizer there; 4.x cannot build one (protobuf)
        f"error: the tokenizer of model {str(folder)!r} has no tokens besides its 1 special one (<|endoftext|>) and would "
        f"turn every text into 0 tokens, while the model embeds 300 tokens: {missing}",
        f"error: cannot load a tokenizer for model {str(folder)!r}: {missing}")
    build_tokenizer(300).save_pretrained(folder)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


def test_a_tokenizer_whose_ids_pass_the_embedding_is_refused():
    """A model object of 64 embedding rows with a tokenizer of 300 tokens (another model's): refused
    by name before any pass (the run would index past the embedding); the empty tokenizer too."""
    from conftest import build_tokenizer, sharp_tiny_llama
    from truncsens.models import in_memory_model

    with pytest.raises(ModelLoadError, match=r"^the tokenizer of model 'LlamaForCausalLM \(passed in memory\)' has "
                                             r"token ids up to 299, past the 64 rows of the model's input embedding"):
        in_memory_model(sharp_tiny_llama(), build_tokenizer(300))
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(300)
    own = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4))
    assert in_memory_model(own, tok).tokenizer is tok  # its own vocabulary: accepted


@pytest.mark.parametrize("first, second", [("truncsens.models.synthetic", "truncsens.models"),
                                           ("truncsens.models", "truncsens.models.synthetic")])
def test_no_circular_import(first, second):
    code = (f"import sys, importlib; importlib.import_module({first!r}); "
            f"importlib.import_module({second!r}); import truncsens.models.synthetic as s, truncsens.models as m; "
            "print(m.load_model('synthetic:0.5:16').source, s.load_synthetic('synthetic:0.5:16').source)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout.split()
    # either import order works (tests/test_architecture.py checks the whole package for cycles)
    assert out == ["synthetic", "synthetic"]
