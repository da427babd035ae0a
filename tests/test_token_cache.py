"""Token ids kept between runs (truncsens.engine.token_cache): a second run of one corpus reads them
instead of tokenizing, with the same ids, documents and counts; a corrupt file is ignored and
rewritten; another tokenizer, BOS or corpus never reads them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import build_tokenizer
from truncsens import results
from truncsens.corpora.document import Document, corpus_sha256
from truncsens.engine import documents as documents_module
from truncsens.engine import token_cache
from truncsens.engine.config import MeasureConfig
from truncsens.engine.documents import tokenize_documents
from truncsens.engine.measure import run_measure

DOCS = [Document("a", "def add(a, b):\n    return a + b\n" * 3), Document("b", "The quick brown fox. " * 5),
        Document("c", "")]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRUNCSENS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokens"


def _counting(calls):
    def tokenize(docs, tokenizer, bos_id=None):
        calls.append(len(docs))
        return tokenize_documents(docs, tokenizer, bos_id)
    return tokenize


def _ids(token_docs):
    return [(d.id, d.ids.dtype, d.ids.tolist()) for d in token_docs]


def test_second_read_comes_from_the_cache_with_the_same_ids(cache_dir):
    tok, calls = build_tokenizer(), []
    sha = corpus_sha256(DOCS)
    first, hit1 = token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))
    second, hit2 = token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))
    assert (hit1, hit2, calls) == (False, True, [3])
    assert _ids(second) == _ids(first) == _ids(tokenize_documents(DOCS, tok))
    assert second[2].ids.numel() == 0 and second[0].ids.dtype == torch.long
    assert [p.suffix for p in cache_dir.iterdir()] == [".npz"]  # one file, no temporary left


def test_bos_tokenizer_and_corpus_are_part_of_the_key(cache_dir):
    tok, calls = build_tokenizer(), []
    sha = corpus_sha256(DOCS)
    token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))
    with_bos, hit = token_cache.cached_token_docs(DOCS, sha, tok, tok.bos_token_id, _counting(calls))
    assert not hit and with_bos[0].ids[0].item() == tok.bos_token_id
    other = build_tokenizer(vocab_size=280)  # another vocabulary
    assert token_cache.tokenizer_fingerprint(other) != token_cache.tokenizer_fingerprint(tok)
    _, hit = token_cache.cached_token_docs(DOCS, sha, other, None, _counting(calls))
    assert not hit
    changed = [DOCS[0], Document("b", "The quick brown fox! " * 5), DOCS[2]]
    got, hit = token_cache.cached_token_docs(changed, corpus_sha256(changed), tok, None, _counting(calls))
    assert not hit and _ids(got) == _ids(tokenize_documents(changed, tok))
    assert calls == [3, 3, 3, 3] and len(list(cache_dir.iterdir())) == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_corrupt_file_is_ignored_and_rewritten(cache_dir, damage):
    tok, calls = build_tokenizer(), []
    sha = corpus_sha256(DOCS)
    want, _ = token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))
    (path,) = cache_dir.iterdir()
    good = path.read_bytes()
    if damage == "truncate":
        bad = good[: len(good) // 2]
    elif damage == "flip":  # one token id changed inside the stored array: only the checksum sees it
        ids = np.load(path)["ids"]
        at = good.index(ids.astype("<i8").tobytes()) + 8
        bad = good[:at] + bytes([good[at] ^ 1]) + good[at + 1:]
    elif damage == "garbage":
        bad = b"not a token file"
    else:
        bad = b""
    path.write_bytes(bad)
    got, hit = token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))
    assert not hit and calls == [3, 3] and _ids(got) == _ids(want)
    assert path.read_bytes() == good  # rewritten whole
    assert token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))[1] is True


def test_a_file_of_other_documents_is_not_read(cache_dir):
    tok = build_tokenizer()
    data = token_cache.encode(tokenize_documents(DOCS, tok))
    assert token_cache.decode(data, ["a", "b", "c"]) is not None
    assert token_cache.decode(data, ["a", "b"]) is None
    assert token_cache.decode(data, ["a", "c", "b"]) is None


def test_no_cache_when_the_variable_is_empty_or_the_folder_unwritable(tmp_path, monkeypatch):
    tok, calls = build_tokenizer(), []
    sha = corpus_sha256(DOCS)
    monkeypatch.setenv("TRUNCSENS_CACHE_DIR", "")
    assert token_cache.cache_folder() is None
    assert token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))[1] is False
    assert token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))[1] is False
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("TRUNCSENS_CACHE_DIR", str(blocker))
    got, hit = token_cache.cached_token_docs(DOCS, sha, tok, None, _counting(calls))
    assert not hit and _ids(got) == _ids(tokenize_documents(DOCS, tok)) and calls == [3, 3, 3]


def test_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TRUNCSENS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache.cache_folder() == tmp_path / "xdg" / "truncsens" / "tokens"


def test_a_tokenizer_without_a_serialized_state_is_not_cached(cache_dir):
    class Plain:  # a tokenizer with no backend (slow, Python-only)
        def __call__(self, text, add_special_tokens=False, split_special_tokens=True):
            return {"input_ids": [ord(c) % 50 for c in text]}

    calls = []
    assert token_cache.tokenizer_fingerprint(Plain()) is None
    for _ in range(2):
        assert token_cache.cached_token_docs(DOCS, corpus_sha256(DOCS), Plain(), None, _counting(calls))[1] is False
    assert calls == [3, 3] and not cache_dir.exists()


def test_a_run_reads_the_cache_and_reports_the_same(tiny_llama_dir, corpus_dir, cache_dir, tmp_path, monkeypatch):
    """Two measure runs of one corpus: the second tokenizes nothing and its results file is the same,
    counts of checked and short documents included."""
    calls = []
    monkeypatch.setattr(documents_module, "tokenize_documents", _counting(calls))

    def run(name):
        run_measure(MeasureConfig(model=tiny_llama_dir, corpus=corpus_dir, reference_context=32, windows=[1, 8],
                                  targets_per_doc=2, max_docs=3, out=str(tmp_path / name), progress=False))
        return results.load(tmp_path / name)

    first, second = run("a.nc"), run("b.nc")
    assert calls == [6]  # the corpus's 6 documents, tokenized once
    for key in ("n_docs_checked", "n_docs_skipped_short", "corpus_sha256", "files_skipped"):
        assert first.attrs.get(key) == second.attrs.get(key), key
    assert first.attrs["n_docs_checked"] == 6
    for name in first.data_vars:
        np.testing.assert_array_equal(first[name].values, second[name].values, err_msg=name)


def _corpus(i):
    return [Document(f"doc{i}", f"def f{i}(x):\n    return x * {i}\n" * (i + 1))]


def test_the_cache_keeps_the_most_recently_used_files(cache_dir, monkeypatch):
    """Five corpora with a cap of 3 files: after each write only the 3 most recently used stay, and a
    file read is used (it outlives files written after it)."""
    monkeypatch.setattr(token_cache, "MAX_FILES", 3)
    tok, calls = build_tokenizer(), []
    paths = []
    for i in range(4):
        docs = _corpus(i)
        token_cache.cached_token_docs(docs, corpus_sha256(docs), tok, None, _counting(calls))
        (new,) = set(cache_dir.iterdir()) - set(paths)
        paths.append(new)
        os.utime(new, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # written i seconds apart (no clock read)
    assert sorted(cache_dir.iterdir()) == sorted(paths[1:])  # the 4th write deleted the oldest
    assert token_cache.cached_token_docs(_corpus(1), corpus_sha256(_corpus(1)), tok, None, _counting(calls))[1] is True
    docs = _corpus(4)
    token_cache.cached_token_docs(docs, corpus_sha256(docs), tok, None, _counting(calls))
    kept = set(cache_dir.iterdir())
    assert paths[1] in kept and paths[3] in kept and paths[2] not in kept and len(kept) == 3
    assert calls == [1, 1, 1, 1, 1]
    # a corpus whose file was deleted is tokenized again
    assert token_cache.cached_token_docs(_corpus(2), corpus_sha256(_corpus(2)), tok, None, _counting(calls))[1] is False


def test_prune_keeps_a_size_cap_and_always_the_newest(tmp_path):
    sizes = {"a": 100, "b": 300, "c": 200, "d": 50}
    for i, (name, size) in enumerate(sizes.items()):  # a oldest, d newest
        f = tmp_path / f"{name}.npz"
        f.write_bytes(b"x" * size)
        os.utime(f, ns=(10**18 + i * 10**9,) * 2)
    (tmp_path / ".e.npz.7.tmp").write_bytes(b"x" * 1000)  # a writer's temporary file: not the cache's to delete
    assert token_cache.prune(tmp_path, max_files=10, max_bytes=260) == [tmp_path / "b.npz", tmp_path / "a.npz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".e.npz.7.tmp", "c.npz", "d.npz"]
    assert token_cache.prune(tmp_path, max_files=10, max_bytes=10) == [tmp_path / "c.npz"]  # d alone is over: kept
    assert token_cache.prune(tmp_path, max_files=0, max_bytes=0) == []
    assert token_cache.prune(tmp_path / "missing") == []
