"""A file or folder name that is not valid UTF-8 (POSIX allows any bytes) is measured like any other:
its document id is the name as Python holds it (undecodable bytes as lone surrogates), which names the
file unambiguously (``os.fsencode(id)`` gives its bytes back) and round-trips exactly through the
results file. Before, such a name stopped the whole run with a UnicodeEncodeError."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.targets import doc_seed

CODE = "def f(x):\n    return x + 1\n" * 120


def write(folder: Path, name: bytes, text: str) -> None:
    path = os.path.join(os.fsencode(folder), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def measure(corpus: Path, out: Path):
    return CliRunner().invoke(app, ["measure", "--corpus", str(corpus), "--reference-context", "64", "--windows", "1,8",
                                    "--targets-per-doc", "2", "--no-progress", "--out", str(out)])


@pytest.mark.parametrize("odd", [b"bad\x80name.txt", b"sub\xff\xfe/code.txt"], ids=["file name", "folder name"])
def test_a_name_that_is_not_utf8_is_measured_and_stored_losslessly(tmp_path, odd):
    corpus = tmp_path / "corpus"
    write(corpus, b"good.txt", CODE + "# good\n")
    write(corpus, odd, CODE + "# odd\n")
    result = measure(corpus, tmp_path / "out.nc")
    assert result.exit_code == 0, result.output
    assert "4 targets from 2 documents" in result.stdout
    ds = results.load(tmp_path / "out.nc")
    ids = sorted(set(ds["doc"].values.tolist()))
    assert ids == sorted(["good.txt", os.fsdecode(odd)])
    assert os.fsdecode(odd) != odd.decode("utf-8", errors="replace")  # held as lone surrogates, not replaced
    assert sorted(os.fsencode(i) for i in ids) == sorted([b"good.txt", odd])  # each id names its file's bytes
    assert ds.attrs["files_skipped"] == {}


def test_doc_seed_of_a_valid_id_is_plain_utf8_and_odd_ids_differ():
    expected = int.from_bytes(hashlib.sha256(b"3:good.txt").digest()[:8], "big")  # the seed every run used so far
    assert doc_seed(3, "good.txt") == expected
    a, b = os.fsdecode(b"bad\x80.txt"), os.fsdecode(b"bad\x81.txt")
    assert doc_seed(3, a) != doc_seed(3, b)
