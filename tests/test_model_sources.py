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
