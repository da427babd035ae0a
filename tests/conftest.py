"""Shared fixtures: tiny random models saved as real Hugging Face checkpoints, with a tokenizer.

They are built once per test session in a temporary folder (seconds on a CPU), so tests exercise
the same loading code as hub models (``truncsens.models.load_model`` on a local path).
"""

from __future__ import annotations

import os

import pytest
import torch

# No token-id cache in the user's cache folder while testing (every test tokenizes, as before the
# cache); the cache's own tests point TRUNCSENS_CACHE_DIR at their tmp_path.
os.environ["TRUNCSENS_CACHE_DIR"] = ""

from truncsens.models import REFERENCE_DIR

TINY_TEXTS = [
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. Python is a programming language. " * 3,
    "import os\nimport sys\n\nfor i in range(10):\n    print(i, os.path.join('a', str(i)))\n",
]


def peaked(model, std: float = 0.3):
    """``model`` with every matrix redrawn at ``std`` (larger than the default init), so attention is
    peaked and evicting a key visibly moves the output; returns the model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model


def build_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on a few strings, wrapped for transformers."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(TINY_TEXTS * 4, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", model_max_length=1_000_000)


def save_tiny_llama(path, max_positions: int = 256, seed: int = 0) -> str:
    """Save a random 2-layer Llama (RoPE) and tokenizer to ``path``; return the path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    peaked(model)  # larger weights than the default init, so distributions differ visibly
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def hybrid_qwen2():
    """A random 3-layer Qwen2 (full, sliding, sliding; window 5), GQA 4 / 2 heads, vocab 300, weights at
    std 0.3 (peaked attention): the hybrid sliding-window model of the windowed-layer tests."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=3, use_sliding_window=True,
                                         sliding_window=5, max_window_layers=1, max_position_embeddings=256))
    peaked(model)
    return model.eval()


def sharp_tiny_llama(layers: int = 2, seed: int = 0):
    """An in-memory random Llama (vocab 64, hidden 32, 4 query / 2 key-value heads, RoPE) with weights
    drawn at std 0.3, so that attention is peaked and evicting a key visibly moves the output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    peaked(model)
    return model


def save_tiny_gpt2(path, max_positions: int = 256, seed: int = 0) -> str:
    """Save a random 2-layer GPT-2 (learned absolute positions) and tokenizer to ``path``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=max_positions,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """Folder of a tiny random Llama checkpoint + tokenizer (max 256 positions)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> str:
    """Folder of a tiny random GPT-2 checkpoint + tokenizer (max 256 positions)."""
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> str:
    """A folder corpus of 6 text files, each long enough for a 64-token reference context."""
    root = tmp_path_factory.mktemp("corpus")
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta def return class import self print value index".split()
    for i in range(6):
        text = " ".join(rng.choice(words) for _ in range(400))
        (root / f"doc{i}.txt").write_text(text)
    return str(root)


requires_reference = pytest.mark.skipif(
    not (REFERENCE_DIR / "config.json").is_file(),
    reason="reference model weights not present in truncsens/models/reference/weights",
)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow (model training or long runs); use --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
