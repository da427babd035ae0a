"""Own corpora read strictly: hidden paths, binary / Latin-1 files and odd records are skipped and
counted by reason, every document (empty ones too) is yielded, user corpora carry their own label,
and ids of any text (a non-UTF-8 file name) survive the split, the hash and a results file."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from truncsens import results
from truncsens.corpora import CorpusError, corpus_sha256, load_corpus, split_of
from truncsens.corpora.local import SKIP_REASONS, folder_documents

LATIN1 = "café crème, déjà vu\n".encode("latin-1")  # b'caf\xe9 cr\xe8me, ...': not UTF-8


def _write(root, files: dict) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))


def test_the_issue_folder(tmp_path):
    """.git/COMMIT_EDITMSG was a document, Latin-1 and binary files vanished uncounted, random bytes
    were measured as U+FFFD text, the domain was 'code', and "" vanished from the counts."""
    rng = random.Random(0)
    noise = bytes(rng.randrange(1, 256) for _ in range(512))  # random bytes without NUL
    folder = tmp_path / "my_notes"
    _write(folder, {
        ".git/COMMIT_EDITMSG": "Fix the parser\n",
        "empty.txt": "",
        "a.txt": "a",
        "real.txt": "A real document with several words in it.\n",
        "latin1.txt": LATIN1,
        "image.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
        "noise.bin": noise,
    })
    c = load_corpus(str(folder))
    assert [(d.id, d.text) for d in c.documents] == [
        ("a.txt", "a"), ("empty.txt", ""), ("real.txt", "A real document with several words in it.\n")]
    assert len(c.documents) == 3  # "", "a" and the real one: 3 documents to check, not 2
    assert c.skipped == {"binary": 1, "hidden": 1, "not_utf8": 2}  # the PNG; .git; Latin-1 and the noise
    assert c.domain == "my_notes"
    assert not any("\ufffd" in d.text for d in c.documents)


def test_hidden_paths_at_any_depth_and_odd_file_names(tmp_path):
    folder = tmp_path / "corpus"
    _write(folder, {
        "src/.cache/blob.txt": "cached",
        "src/.env": "SECRET=1",
        ".hidden_dir/deep/x.txt": "x",
        "src/main.py": "print('hi')\n",
        "src/utf16.txt": "hi".encode("utf-16"),  # b'\xff\xfeh\x00i\x00': NUL bytes
    })
    (folder / "src" / "link").symlink_to(folder / "gone.txt")  # a broken link
    name = os.fsencode(folder / "src") + b"/caf\xe9.txt"  # a Latin-1 file name, not UTF-8
    with open(name, "wb") as fh:
        fh.write("contenu\n".encode("utf-8"))
    c = load_corpus(str(folder))
    ids = [d.id for d in c.documents]
    assert ids == ["src/caf\udce9.txt", "src/main.py"]
    assert os.fsencode(ids[0]) == b"src/caf\xe9.txt"
    assert c.skipped == {"binary": 1, "hidden": 3, "unreadable": 1}
    assert c.domain == "corpus"
    # the id hashes and splits like any other, and survives a results file
    assert split_of(ids[0]) in ("train", "heldout")
    assert len(corpus_sha256(c.documents)) == 64
    assert set(SKIP_REASONS) >= set(c.skipped)


def test_results_keep_a_non_utf8_file_name(tmp_path):
    from tests.test_results import make  # the results-file helper of the schema tests

    doc_id = os.fsdecode(b"notes/r\xe9sum\xe9.txt")
    ds = make(n=2, docs=[doc_id, "notes/plain.txt"])
    back = results.load(results.save(ds, tmp_path / "r.nc"))
    assert back["doc"].values.tolist() == [doc_id, "notes/plain.txt"]
    assert os.fsencode(back["doc"].values[0]) == b"notes/r\xe9sum\xe9.txt"


def test_single_text_files_are_read_strictly(tmp_path):
    latin = tmp_path / "old.txt"
    latin.write_bytes(LATIN1)
    with pytest.raises(CorpusError, match=r"old.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        load_corpus(str(latin))
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"abc\x00def")
    with pytest.raises(CorpusError, match="data.txt holds a NUL byte at offset 3: it is binary"):
        load_corpus(str(binary))
    good = tmp_path / "book.txt"
    good.write_text("déjà vu", encoding="utf-8")
    c = load_corpus(str(good))
    assert c.documents[0].text == "déjà vu" and c.domain == "book" and c.skipped == {}


def test_jsonl_records_counted_and_ids_unique(tmp_path):
    p = tmp_path / "recs.jsonl"
    lines = [b'{"text": "first", "id": "a"}', b"", b'{"text": null, "id": "b"}', b'{"text": "", "id": "c"}',
             b'{"text": "caf\xe9", "id": "d"}', b'{"text": "lone \\ud800", "id": "e"}', b'{"text": 3}',
             b'{"text": "last", "id": "f"}']
    p.write_bytes(b"\n".join(lines) + b"\n")
    c = load_corpus(str(p))
    assert [(d.id, d.text) for d in c.documents] == [("recs.jsonl:1", "first"), ("recs.jsonl:4", ""),
                                                     ("recs.jsonl:8", "last")]
    assert c.skipped == {"blank_line": 1, "invalid_unicode": 1, "not_utf8": 1, "text_not_a_string": 2}
    assert c.domain == "recs"
    # an id field that repeats would merge two documents: refused
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"text": "x", "id": 1}\n{"text": "y", "id": 1}\n')
    (tmp_path / "dup.yaml").write_text("name: dup\ndomain: legal\nsource: local\npath: dup.jsonl\nid_field: id\n")
    with pytest.raises(CorpusError, match="two documents with the id '1'"):
        load_corpus(str(tmp_path / "dup.yaml"))


def test_local_manifest_carries_its_label_and_skips(tmp_path):
    data = tmp_path / "texts"
    _write(data, {"a.txt": "alpha", ".DS_Store": b"\x00\x01", "b.txt": LATIN1, "c.txt": ""})
    (tmp_path / "law.yaml").write_text("name: statutes\ndomain: legal\nsource: local\npath: texts\n")
    c = load_corpus(str(tmp_path / "law.yaml"))
    assert (c.name, c.domain) == ("statutes", "legal")  # a manifest's own domain, not 'code'
    assert [d.id for d in c.documents] == ["a.txt", "c.txt"]
    assert c.skipped == {"hidden": 1, "not_utf8": 1}
    (tmp_path / "bad.yaml").write_text("name: x\ndomain: ''\nsource: local\npath: texts\n")
    with pytest.raises(CorpusError, match="domain must be a non-empty string"):
        load_corpus(str(tmp_path / "bad.yaml"))


def test_folder_of_only_skipped_or_empty_files(tmp_path):
    only_hidden = tmp_path / "h"
    _write(only_hidden, {".a": "x", ".b/c": "y", "d.bin": b"\x00"})
    with pytest.raises(CorpusError, match=r"has no non-empty UTF-8 text files .*\(skipped: 1 binary, 2 hidden\)"):
        folder_documents(only_hidden)
    only_empty = tmp_path / "e"
    _write(only_empty, {"a.txt": "", "b.txt": " \n"})
    assert [d.text for d in folder_documents(only_empty)] == ["", " \n"]
    with pytest.raises(CorpusError, match="all 2 documents of split 'all' are empty"):
        load_corpus(str(only_empty))


def test_builtin_corpus_reports_its_skips():
    c = load_corpus(None, "code")
    assert (c.domain, c.name) == ("code", "code")
    assert set(c.skipped) <= {"empty", "not_utf8", "unreadable"}
    assert c.skipped.get("empty", 0) > 0  # empty __init__.py files of the standard library are counted
    assert np.all([d.text.strip() for d in c.documents])
