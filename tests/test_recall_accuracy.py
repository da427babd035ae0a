"""benchmarks/recall_accuracy.py: its documents extend certify-attribution's, and bad options are refused
before any model is loaded."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SPEC = importlib.util.spec_from_file_location("recall_accuracy",
                                              Path(__file__).parents[1] / "benchmarks" / "recall_accuracy.py")
recall_accuracy = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(recall_accuracy)


def test_more_documents_start_with_certify_attributions_eight():
    from truncsens.certificates.tasks import kv_tasks

    encode = lambda text: [ord(c) % 97 for c in text]  # noqa: E731  a character-level stand-in tokenizer
    eight = kv_tasks(encode, 256, 64, 8, seed=0)
    twelve = kv_tasks(encode, 256, 64, 12, seed=0)
    assert twelve[0][:8] == eight[0] and twelve[3][:8] == eight[3]
    assert all(torch.equal(a, b) for a, b in zip(twelve[2][:8], eight[2]))
    assert not torch.equal(kv_tasks(encode, 256, 64, 1, seed=1)[2][0], eight[2][0])  # another seed, other documents


def test_bad_options_are_refused_before_loading(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--kv-docs must be at least 1, got 0"):
        recall_accuracy.main(["--kv-docs", "0", "--model", "no/such-model"])
    out = tmp_path / "r.json"
    out.write_text("keep")
    with pytest.raises(SystemExit, match="already exists"):
        recall_accuracy.main(["--model", "no/such-model", "--out", str(out)])
    assert out.read_text() == "keep"
