"""How documents become model inputs: the BOS rule, the tokenizer/model vocabulary check, every
document counted."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from conftest import build_tokenizer, save_tiny_llama
from truncsens import results
from truncsens.cli.main import app
from truncsens.engine.config import MeasureConfig
from truncsens.engine.documents import default_special_tokens, tokenize_documents
from truncsens.engine.measure import run_measure
from truncsens.corpora.document import Document

LITERAL = "x = 1 <|endoftext|> y = 2 " * 40


def bos_tokenizer():
    """The tiny tokenizer, set to add its BOS in front of every text (as Llama's does)."""
    from tokenizers.processors import TemplateProcessing

    tok = build_tokenizer()
    bos = tok.bos_token
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])
    return tok


def test_bos_rule_one_bos_at_the_start_never_inside():
    tok = bos_tokenizer()
    assert default_special_tokens(tok) == ("bos", tok.bos_token_id)
    docs = tokenize_documents([Document("d", LITERAL)], tok, tok.bos_token_id)
    ids = docs[0].ids.tolist()
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the literal text is not a BOS


def test_no_bos_when_the_tokenizer_adds_none():
    tok = build_tokenizer()
    assert default_special_tokens(tok) == ("none", None)
    ids = tokenize_documents([Document("d", LITERAL)], tok)[0].ids.tolist()
    assert tok.bos_token_id not in ids  # before: the literal "<|endoftext|>" became the special id mid-document


def test_bos_recorded_per_target_and_in_attrs(tmp_path):
    folder = save_tiny_llama(tmp_path / "m")
    bos_tokenizer().save_pretrained(folder)
    corpus = tmp_path / "c.txt"
    corpus.write_text(LITERAL)
    run_measure(MeasureConfig(model=folder, corpus=str(corpus), reference_context=32, windows=[1, 8], bos="document",
                              targets_per_doc=None, out=str(tmp_path / "r.nc"), progress=False))
    ds = results.load(tmp_path / "r.nc")
    assert ds.attrs["tokenizer_adds"] == "bos" and "one BOS at the start of each document" in ds.attrs["bos_rule"]
    assert (ds.attrs["bos"], ds.attrs["bos_prepended"], ds.attrs["n_sink"]) == ("document", 0, 0)
    want = (ds["position"].values == 32).astype(np.int8)  # only the context starting at the document's first token
    np.testing.assert_array_equal(ds["bos_first"].values, want)
    assert want.sum() == 1
    # the default (auto) for a tokenizer that adds a BOS: every context begins with it, kept as the first sink
    run_measure(MeasureConfig(model=folder, corpus=str(corpus), reference_context=32, windows=[1, 8],
                              targets_per_doc=None, out=str(tmp_path / "auto.nc"), progress=False))
    auto = results.load(tmp_path / "auto.nc")
    assert (auto.attrs["bos"], auto.attrs["bos_prepended"], auto.attrs["n_sink"]) == ("auto", 1, 1)
    assert auto.attrs["bos_rule"].startswith("a BOS at position 0 of every context")
    np.testing.assert_array_equal(auto["bos_first"].values, np.ones(len(want), np.int8))


def test_tokenizer_ids_beyond_the_model_vocabulary(tmp_path, corpus_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(vocab_size=300)  # 257 base ids + merges
    folder = tmp_path / "small"
    LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=128)).save_pretrained(folder)
    tok.save_pretrained(folder)
    r = CliRunner().invoke(app, ["measure", "--model", str(folder), "--corpus", corpus_dir, "--reference-context", "32",
                                 "--windows", "1", "--out", str(tmp_path / "x.nc"), "--no-progress"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    # refused when the model loads (its tokenizer's ids pass the embedding), before any document is read
    assert "past the 200 rows of the model's input embedding: it is not this model's tokenizer" in r.stderr
    assert not (tmp_path / "x.nc").exists()


def test_padded_model_vocabulary_is_recorded(tmp_path, corpus_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    folder = tmp_path / "padded"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=128)).save_pretrained(folder)
    tok.save_pretrained(folder)
    run_measure(MeasureConfig(model=str(folder), corpus=corpus_dir, reference_context=32, windows=[1],
                              targets_per_doc=1, out=str(tmp_path / "r.nc"), progress=False))
    vocab = results.load(tmp_path / "r.nc").attrs["vocabulary"]
    assert vocab == {"model_output_ids": 512, "tokenizer_ids": len(tok), "divergences_over": "all model output ids"}


def test_every_document_is_counted(tiny_llama_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in ["", "a", "alpha beta gamma delta " * 60]) + "\n")
    run_measure(MeasureConfig(model=tiny_llama_dir, corpus=str(corpus), reference_context=32, windows=[1],
                              targets_per_doc=2, out=str(tmp_path / "r.nc"), progress=False))
    attrs = results.load(tmp_path / "r.nc").attrs
    assert attrs["n_docs_checked"] == 3 and attrs["n_docs_skipped_short"] == 2 and attrs["n_docs"] == 1
