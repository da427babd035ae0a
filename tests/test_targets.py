"""Target selection: eligible positions, seeded per-document draws, contexts and next tokens."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from truncsens.targets import TargetSet, TokenDoc, doc_seed, draw_positions, select_targets


def test_draw_positions_all_eligible():
    # N = 4, length 7: targets need t >= N and t < len -> 4, 5, 6
    assert draw_positions(7, 4, None, 0, "a").tolist() == [4, 5, 6]
    assert draw_positions(7, 4, 3, 0, "a").tolist() == [4, 5, 6]  # not more than eligible: all of them
    assert draw_positions(7, 4, 10, 0, "a").tolist() == [4, 5, 6]
    assert draw_positions(5, 4, 8, 0, "a").tolist() == [4]  # len == N + 1: exactly one target
    assert draw_positions(4, 4, 8, 0, "a").size == 0  # len == N: none
    assert draw_positions(2, 4, None, 0, "a").size == 0
    assert draw_positions(7, 4, None, 0, "a").dtype == np.int64


def test_draw_positions_sampled():
    pos = draw_positions(1000, 64, 8, 0, "doc")
    assert pos.size == 8
    assert pos.dtype == np.int64
    assert np.all(np.diff(pos) > 0)  # sorted, no repeats
    assert pos.min() >= 64 and pos.max() < 1000
    # deterministic for (seed, doc id); different for another seed or id
    assert draw_positions(1000, 64, 8, 0, "doc").tolist() == pos.tolist()
    assert draw_positions(1000, 64, 8, 1, "doc").tolist() != pos.tolist()
    assert draw_positions(1000, 64, 8, 0, "doc2").tolist() != pos.tolist()
    # the draw is the numpy generator seeded by doc_seed(seed, id): choice without replacement
    rng = np.random.default_rng(doc_seed(0, "doc"))
    assert pos.tolist() == sorted(rng.choice(np.arange(64, 1000), size=8, replace=False).tolist())


def test_doc_seed_value():
    expected = int.from_bytes(hashlib.sha256(b"3:code/os.py").digest()[:8], "big")
    assert doc_seed(3, "code/os.py") == expected
    assert doc_seed(3, "code/os.py") != doc_seed(4, "code/os.py")
    assert 0 <= doc_seed(0, "x") < 2**64


def _doc(doc_id: str, n: int, start: int = 0) -> TokenDoc:
    return TokenDoc(doc_id, torch.arange(start, start + n, dtype=torch.long))


def test_select_targets_contexts_and_tokens():
    docs = [_doc("a", 7, 100), _doc("short", 3), _doc("b", 5, 200)]
    ts = select_targets(docs, 4, None, 0)
    assert len(ts) == 4
    assert ts.doc == ["a", "a", "a", "b"]
    assert ts.position.tolist() == [4, 5, 6, 4]
    assert ts.context.shape == (4, 4)
    assert ts.context.tolist() == [[100, 101, 102, 103], [101, 102, 103, 104], [102, 103, 104, 105],
                                   [200, 201, 202, 203]]
    assert ts.token_id.tolist() == [104, 105, 106, 204]
    sub = ts.subset(slice(1, 3))
    assert sub.doc == ["a", "a"] and sub.position.tolist() == [5, 6] and sub.token_id.tolist() == [105, 106]
    assert isinstance(sub, TargetSet)


def test_select_targets_independent_of_other_documents():
    a, b, c = _doc("a", 300), _doc("b", 400), _doc("c", 50)
    both = select_targets([a, b, c], 32, 5, seed=7)
    alone = select_targets([b], 32, 5, seed=7)
    assert both.doc == ["a"] * 5 + ["b"] * 5 + ["c"] * 5
    assert both.position[5:10].tolist() == alone.position.tolist()
    assert torch.equal(both.context[5:10], alone.context)
    # context of every target is the N tokens right before it, and the token is the one at t
    for i, t in enumerate(both.position.tolist()):
        ids = {"a": a, "b": b, "c": c}[both.doc[i]].ids
        assert both.context[i].tolist() == ids[t - 32 : t].tolist()
        assert int(both.token_id[i]) == int(ids[t])


def test_select_targets_no_long_documents():
    ts = select_targets([_doc("a", 4), _doc("b", 2)], 4, 3, 0)
    assert len(ts) == 0
    assert ts.context.shape == (0, 4)
    assert ts.position.dtype == np.int64 and ts.token_id.dtype == torch.long


def test_select_targets_bad_arguments():
    with pytest.raises(ValueError, match=r"reference_context \(--reference-context\) must be at least 1 token, got 0"):
        select_targets([_doc("a", 10)], 0, 3, 0)
    with pytest.raises(ValueError, match=r"targets_per_doc \(--targets-per-doc\) must be at least 1, got 0"):
        select_targets([_doc("a", 10)], 4, 0, 0)
