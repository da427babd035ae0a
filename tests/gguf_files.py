"""Tiny GGUF files written by the tests themselves (needs the ``gguf`` package, the ``gguf`` extra).

:func:`write_tiny_gguf` writes a random 2-layer Llama (hidden 32, 4 / 2 heads) with the byte-level
BPE tokenizer of :func:`conftest.build_tokenizer` into one ``.gguf`` file, its matrices in Q8_0
(``general.file_type`` = MOSTLY_Q8_0) and its norms in F32, as llama.cpp lays a Llama out. The
architecture name and the tokenizer's ``add_bos_token`` flag can be changed, so the errors and the
BOS rules can be tested on such a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from conftest import build_tokenizer

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 32, 64, 2, 4, 2, 256


def _tokenizer_lists():
    """(tokens in id order, merges as "a b" strings, id of ``<|endoftext|>``) of the tests' tokenizer."""
    tok = build_tokenizer()
    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges, vocab["<|endoftext|>"]


def write_tiny_gguf(path, architecture: str = "llama", add_bos: bool = False, seed: int = 0) -> Path:
    """Write a tiny random Llama and its tokenizer as one GGUF file at ``path``; return the path.

    Args:
        architecture: the ``general.architecture`` written (the tensors stay a Llama's, so any other
            name is a file transformers cannot read).
        add_bos: the ``tokenizer.ggml.add_bos_token`` flag (the BOS is ``<|endoftext|>``).
        seed: numpy seed of the weights.
    """
    import gguf

    path = Path(path)
    tokens, merges, bos = _tokenizer_lists()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i == bos else gguf.TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(bos)
    writer.add_add_bos_token(add_bos)

    def matrix(name, rows, cols):
        weights = rng.normal(0.0, 0.3, size=(rows, cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name):
        writer.add_tensor(name, (1.0 + 0.1 * rng.normal(size=HIDDEN)).astype(np.float32))

    head = HIDDEN // HEADS
    matrix("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    matrix("output.weight", len(tokens), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
