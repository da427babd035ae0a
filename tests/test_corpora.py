"""Corpora: deterministic split, builtin code / nl corpora, local readers, manifests, load_corpus."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from truncsens.corpora import CorpusError, Document, corpus_sha256, load_corpus, select_split, split_of
from truncsens.corpora.builtin import code_documents, nl_documents, stdlib_dir
from truncsens.corpora.local import folder_documents, jsonl_documents, text_file_documents
from truncsens.corpora.manifest import builtin_manifest_names, read_manifest

SHIPPED = ["code", "nl", "pg19", "stdlib-long", "the-stack-smol-python", "wikitext-103"]


@pytest.fixture(scope="module")
def stdlib_code_docs():
    return code_documents()


# ---------------------------------------------------------------- split


def test_split_of_fixed_ids_is_stable():
    # u = first 8 bytes of SHA-256(id) / 2**64, computed once by hand:
    # "d" -> 0.09638, "j" -> 0.09618 (< 0.1: heldout); "c" -> 0.18160, "code/os.py" -> 0.28887 (train)
    assert split_of("d") == "heldout"
    assert split_of("j") == "heldout"
    assert split_of("c") == "train"
    assert split_of("code/os.py") == "train"
    assert split_of("nl/topic/assert") == "train"  # u = 0.76785
    # the threshold is the held-out fraction: "c" (u = 0.18) is held out at 0.2 but not at 0.18
    assert split_of("c", heldout_fraction=0.2) == "heldout"
    assert split_of("c", heldout_fraction=0.18) == "train"
    # the same call gives the same answer every time
    assert {split_of("code/json/__init__.py") for _ in range(5)} == {"train"}


def test_select_split_partitions_documents():
    docs = [Document(i, "x") for i in "abcdefghijkl"]
    held = select_split(docs, "heldout")
    train = select_split(docs, "train")
    assert [d.id for d in held] == ["d", "j"]
    assert len(train) == 10
    assert select_split(docs, "all") == docs
    with pytest.raises(ValueError, match="unknown split 'bogus'; choose one of train, heldout, all"):
        select_split(docs, "bogus")


def test_corpus_sha256_is_order_and_content_sensitive():
    docs = [Document("a", "hello"), Document("b", "world")]
    h = hashlib.sha256(b"a\0hello\0b\0world\0").hexdigest()
    assert corpus_sha256(docs) == h
    assert corpus_sha256(list(reversed(docs))) != h
    assert corpus_sha256([Document("a", "hello"), Document("b", "world!")]) != h
    # the separator keeps ("ab", "c") and ("a", "bc") apart
    assert corpus_sha256([Document("ab", "c")]) != corpus_sha256([Document("a", "bc")])


# ---------------------------------------------------------------- builtin corpora


def test_builtin_code_corpus_excludes_tests(stdlib_code_docs):
    ids = [d.id for d in stdlib_code_docs]
    assert len(ids) > 300
    assert all(i.startswith("code/") and i.endswith(".py") for i in ids)
    assert not [i for i in ids if "/test/" in i or "/tests/" in i or "/idle_test/" in i]
    assert not [i for i in ids if i.rsplit("/", 1)[-1].startswith("test_")]
    assert "code/os.py" in ids and "code/json/__init__.py" in ids
    os_doc = next(d for d in stdlib_code_docs if d.id == "code/os.py")
    assert os_doc.text == (stdlib_dir() / "os.py").read_text(encoding="utf-8")


def test_builtin_code_corpus_holds_out_about_ten_percent(stdlib_code_docs):
    held = select_split(stdlib_code_docs, "heldout")
    frac = len(held) / len(stdlib_code_docs)
    assert 0.07 < frac < 0.13, frac
    assert len(held) + len(select_split(stdlib_code_docs, "train")) == len(stdlib_code_docs)


def test_code_documents_exclusions_on_a_fake_stdlib(tmp_path):
    files = {
        "os.py": "import sys\n",
        "pkg/__init__.py": "x = 1\n",
        "pkg/tests/test_x.py": "assert True\n",
        "test/support.py": "y = 2\n",
        "idlelib/idle_test/foo.py": "z = 3\n",
        "site-packages/thirdparty.py": "w = 4\n",
        "test_toplevel.py": "v = 5\n",
        "empty.py": "   \n",
        "latin1.py": None,  # not UTF-8: skipped
    }
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            p.write_bytes(b"s = '\xe9\xff'\n")
        else:
            p.write_text(text)
    skipped = Counter()
    docs = code_documents(tmp_path, skipped)
    assert [d.id for d in docs] == ["code/os.py", "code/pkg/__init__.py"]
    assert skipped == {"empty": 1, "not_utf8": 1}
    assert docs[0].text == "import sys\n"


def test_code_documents_never_list_an_excluded_folder(tmp_path, monkeypatch):
    """A site-packages of many files beside the standard library is not walked (it cost 0.35 s of
    CPU a run for a pyenv interpreter with packages), and the documents are those of a full walk."""
    import os

    for rel in ("os.py", "pkg/__init__.py", "pkg/a-b.py", "pkg/a/b.py", "site-packages/lib/big.py",
                "test/support.py", "pkg/test_data/x.py", "pkg/sub/test_y.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    listed = []
    scandir = os.scandir

    def recording(path="."):
        listed.append(os.path.relpath(os.fspath(path), tmp_path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", recording)
    docs = code_documents(tmp_path)
    assert [d.id for d in docs] == ["code/os.py", "code/pkg/__init__.py", "code/pkg/a/b.py", "code/pkg/a-b.py"]
    assert sorted(listed) == [".", "pkg", "pkg/a", "pkg/sub"]


def test_nl_documents_topics_and_module_docstrings(tmp_path):
    long_mod = "Module docstring that is long enough to be kept in the corpus."
    long_fn = "Function docstring, also longer than forty characters in total."
    (tmp_path / "mod.py").write_text(
        f'"""{long_mod}"""\n\n'
        f'def f():\n    """{long_fn}"""\n\n'
        'def g():\n    """short."""\n')
    (tmp_path / "nodoc.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    docs = nl_documents(tmp_path)
    topics = [d for d in docs if d.id.startswith("nl/topic/")]
    modules = [d for d in docs if d.id.startswith("nl/module/")]
    from pydoc_data.topics import topics as pydoc_topics

    assert len(topics) == sum(1 for t in pydoc_topics.values() if t.strip())
    assert "nl/topic/assert" in {d.id for d in topics}
    assert next(d for d in topics if d.id == "nl/topic/assert").text == pydoc_topics["assert"].strip()
    assert [d.id for d in modules] == ["nl/module/mod.py"]
    assert modules[0].text == f"{long_mod}\n\n{long_fn}"  # source order, short docstring dropped


def test_nl_documents_of_a_real_stdlib_package():
    docs = nl_documents(stdlib_dir() / "json")
    modules = {d.id: d.text for d in docs if d.id.startswith("nl/module/")}
    assert "nl/module/__init__.py" in modules
    import json as json_mod

    # the module docstring comes first, as ast.get_docstring cleans it
    import inspect

    assert modules["nl/module/__init__.py"].startswith(inspect.cleandoc(json_mod.__doc__)[:40])
    assert any(d.id.startswith("nl/topic/") for d in docs)


# ---------------------------------------------------------------- local readers


def test_folder_documents(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("third")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00\x81")
    skipped = Counter()
    docs = folder_documents(tmp_path, skipped=skipped)
    assert [(d.id, d.text) for d in docs] == [("a.txt", "first"), ("b.txt", "second"), ("empty.txt", "  \n"),
                                               ("sub/c.md", "third")]
    assert skipped == {"binary": 1}
    assert [d.id for d in folder_documents(tmp_path, "*.txt")] == ["a.txt", "b.txt", "empty.txt"]


def test_folder_documents_empty_folder(tmp_path):
    with pytest.raises(CorpusError, match="has no non-empty UTF-8 text files matching '\\*\\*/\\*'"):
        folder_documents(tmp_path)


def test_text_file_documents(tmp_path):
    p = tmp_path / "book.txt"
    p.write_text("Once upon a time.")
    assert text_file_documents(p) == [Document("book.txt", "Once upon a time.")]
    e = tmp_path / "empty.txt"
    e.write_text("\n\n")
    with pytest.raises(CorpusError, match="is empty"):
        text_file_documents(e)


def test_jsonl_documents(tmp_path):
    p = tmp_path / "data.jsonl"
    lines = [{"text": "one", "id": 7}, {"text": ""}, {"text": "three"}]
    p.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    skipped = Counter()
    docs = jsonl_documents(p, skipped=skipped)
    assert docs == [Document("data.jsonl:1", "one"), Document("data.jsonl:2", ""), Document("data.jsonl:3", "three")]
    assert skipped == {"blank_line": 1}  # the file ends in "\n\n"
    assert [d.id for d in jsonl_documents(p, id_field="id")] == ["7", "data.jsonl:2", "data.jsonl:3"]


def test_jsonl_documents_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"content": "a"}\n')
    with pytest.raises(CorpusError, match=r"x.jsonl:1 has no field 'text'; pass --text-field NAME"):
        jsonl_documents(p)
    assert jsonl_documents(p, text_field="content") == [Document("x.jsonl:1", "a")]
    p.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(CorpusError, match=r"x.jsonl:2 is not valid JSON"):
        jsonl_documents(p)
    p.write_text('{"text": null}\n\n')
    with pytest.raises(CorpusError, match=r"holds no 'text' texts \(skipped: 1 blank_line, 1 text_not_a_string\)"):
        jsonl_documents(p)
    p.write_text('{"text": "  "}\n')  # one document, empty: the corpus as a whole is refused
    assert jsonl_documents(p) == [Document("x.jsonl:1", "  ")]
    with pytest.raises(CorpusError, match="all 1 documents of split 'all' are empty"):
        load_corpus(str(p))


# ---------------------------------------------------------------- manifests


def test_shipped_manifest_names():
    assert builtin_manifest_names() == SHIPPED


def test_read_manifest_by_name():
    m = read_manifest("pg19")
    assert (m.name, m.domain, m.source) == ("pg19", "nl", "hf")
    assert m.options["dataset"] == "emozilla/pg19"
    assert m.options["text_field"] == "text"
    assert m.options["max_docs"] == 100
    m = read_manifest("code")
    assert (m.name, m.domain, m.source, m.options["builtin"]) == ("code", "code", "builtin", "code")


def test_read_manifest_unknown_lists_shipped():
    with pytest.raises(CorpusError) as info:
        read_manifest("no-such-corpus")
    assert str(info.value) == ("no corpus manifest 'no-such-corpus'; shipped manifests: "
                               "code, nl, pg19, stdlib-long, the-stack-smol-python, wikitext-103")


@pytest.mark.parametrize("text,message", [
    ("name: x\ndomain: nl\n", "lacks the key 'source'"),
    ("name: x\ndomain: nl\nsource: ftp\n", "source must be one of"),
    ("- a\n- b\n", "must be a YAML mapping"),
    ("name: [unclosed\n", "is not valid YAML"),
    ("name: x\ndomain: nl\nsource: local\n", "has source 'local' but lacks the key 'path'"),
    ("name: x\ndomain: nl\nsource: hf\n", "has source 'hf' but lacks the key 'dataset'"),
    ("name: x\ndomain: nl\nsource: builtin\nbuiltin: poetry\n", "builtin must be 'code', 'nl' or 'long', got 'poetry'"),
])
def test_read_manifest_bad_files(tmp_path, text, message):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    with pytest.raises(CorpusError, match=message):
        read_manifest(p)


def test_local_manifest_with_missing_path(tmp_path):
    (tmp_path / "m.yaml").write_text("name: x\ndomain: nl\nsource: local\npath: gone.txt\n")
    with pytest.raises(CorpusError, match=f"local corpus path {tmp_path / 'gone.txt'} does not exist"):
        load_corpus(str(tmp_path / "m.yaml"))


def test_load_corpus_manifest_by_path_local_folder(tmp_path):
    data = tmp_path / "texts"
    data.mkdir()
    (data / "a.txt").write_text("alpha text")
    (data / "b.log").write_text("not matched")
    (tmp_path / "mine.yaml").write_text("name: mine\ndomain: nl\nsource: local\npath: texts\nglob: '*.txt'\n")
    c = load_corpus(str(tmp_path / "mine.yaml"))
    assert (c.name, c.domain, c.split) == ("mine", "nl", "all")
    assert [d.id for d in c.documents] == ["a.txt"]
    assert c.sha256 == corpus_sha256(c.documents)


def test_load_corpus_manifest_by_path_local_jsonl(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "first doc"}\n{"body": "second doc"}\n')
    (tmp_path / "j.yml").write_text("name: j\ndomain: code\nsource: local\npath: d.jsonl\ntext_field: body\n")
    c = load_corpus(str(tmp_path / "j.yml"), domain="nl")
    assert c.domain == "code"  # the manifest's domain wins over --domain
    assert [d.text for d in c.documents] == ["first doc", "second doc"]


def test_load_corpus_default_code_is_heldout_builtin():
    c = load_corpus(None, "code")
    assert (c.name, c.domain, c.split) == ("code", "code", "heldout")
    assert 40 < len(c.documents) < 110
    assert all(split_of(d.id) == "heldout" for d in c.documents)
    assert [d.id for d in c.documents] == sorted(d.id for d in c.documents)


def test_load_corpus_domain_default_ignores_same_named_folder(tmp_path, monkeypatch):
    """`--domain code` means the builtin code corpus even where the cwd has a folder named `code`."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "x.txt").write_text("not the stdlib")
    monkeypatch.chdir(tmp_path)
    c = load_corpus(None, "code")
    assert c.name == "code" and c.split == "heldout"
    assert all(d.id.startswith("code/") for d in c.documents)


def test_load_corpus_local_sources(tmp_path, corpus_dir):
    c = load_corpus(corpus_dir)
    assert c.name == corpus_dir and c.domain == Path(corpus_dir).name and c.split == "all"  # labelled by its name
    assert c.skipped == {}
    assert [d.id for d in c.documents] == [f"doc{i}.txt" for i in range(6)]
    t = tmp_path / "one.txt"
    t.write_text("hello world")
    c = load_corpus(str(t), domain="nl")
    assert (c.name, c.domain, [d.id for d in c.documents]) == (str(t), "one", ["one.txt"])
    j = tmp_path / "r.jsonl"
    j.write_text('{"body": "x y z"}\n')
    c = load_corpus(str(j), text_field="body")
    assert [d.text for d in c.documents] == ["x y z"]
    held = load_corpus(corpus_dir, split="heldout")  # only "doc1.txt" hashes below 0.1
    assert [d.id for d in held.documents] == ["doc1.txt"]


def test_load_corpus_errors(tmp_path):
    with pytest.raises(CorpusError, match="unknown domain 'math'; choose one of code, nl"):
        load_corpus(None, "math")
    with pytest.raises(CorpusError, match="corpus path .*missing.txt does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(CorpusError, match="corpus path .*nowhere does not exist"):
        load_corpus(str(tmp_path / "nowhere"))
    with pytest.raises(CorpusError, match="no corpus manifest 'bogus'; shipped manifests: code, nl"):
        load_corpus("bogus")
    (tmp_path / "data.xyz").write_text("a,b\n")  # a suffix no path kind reads
    with pytest.raises(CorpusError, match=r"data.xyz is neither \.txt, \.jsonl(, \S+)* nor a \.yaml manifest"):
        load_corpus(str(tmp_path / "data.xyz"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="has no non-empty UTF-8 text files"):
        load_corpus(str(tmp_path / "empty"))
    (tmp_path / "d.txt").write_text("text")
    with pytest.raises(ValueError, match="unknown split 'test'"):
        load_corpus(str(tmp_path / "d.txt"), split="test")


def test_load_corpus_empty_split(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a").write_text("text")  # split_of("a") is "train"
    with pytest.raises(CorpusError, match="has no documents in split 'heldout'"):
        load_corpus(str(tmp_path / "c"), split="heldout")


def test_hf_manifest_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(CorpusError) as info:
        load_corpus("pg19")
    assert str(info.value) == "corpus 'pg19' needs the `datasets` package: pip install 'truncsens[hf]'"
    with pytest.raises(CorpusError, match=r"pip install 'truncsens\[hf\]'"):
        load_corpus("wikitext-103", domain="nl")


def test_hf_manifest_hub_unreachable_or_dataset_unknown(monkeypatch):
    """With `datasets` installed, a load that fails for want of the hub (or of the dataset) is one
    CorpusError that says so and keeps the library's own reason."""
    import types

    def failing(reason):
        def load_dataset(*args, **kwargs):
            raise reason
        return types.SimpleNamespace(load_dataset=load_dataset)

    monkeypatch.setitem(sys.modules, "datasets", failing(ConnectionError("Couldn't reach 'emozilla/pg19' on the Hub")))
    with pytest.raises(CorpusError, match="the Hugging Face hub is unreachable.*Couldn't reach 'emozilla/pg19'"):
        load_corpus("pg19")
    # datasets' DatasetNotFoundError subclasses FileNotFoundError
    monkeypatch.setitem(sys.modules, "datasets", failing(FileNotFoundError("Dataset 'bigcode/the-stack-smol' is a gated dataset")))
    with pytest.raises(CorpusError, match="unknown or gated.*is a gated dataset"):
        load_corpus("the-stack-smol-python")


def test_join_articles_wikitext_style():
    from truncsens.corpora.manifest import _join_articles

    lines = [" = A = \n", " text a \n", " = = Sub = = \n", " more a \n", " = B = \n", " text b \n"]
    docs = _join_articles(lines, "w")
    assert [d.id for d in docs] == ["w/0", "w/1"]
    assert docs[0].text == " = A = \n text a \n = = Sub = = \n more a \n"
    assert docs[1].text == " = B = \n text b \n"


# ---------------------------------------------------------------- sources as records


def test_a_path_kind_added_to_the_records_is_read_and_named(tmp_path, monkeypatch):
    from truncsens.corpora import corpus_help, local

    kinds = [k.name for k in local.PATH_KINDS]
    assert kinds[:3] == ["folder", ".txt", ".jsonl"]
    assert corpus_help() == "manifest name, .yaml manifest, " + ", ".join(kinds[:-1]) + " or " + kinds[-1]
    tab = local.PathKind(".tab", ".tab", lambda path, o, skipped: [Document(id=path.name, text=path.read_text().replace(",", " "))])
    monkeypatch.setattr(local, "PATH_KINDS", local.PATH_KINDS + (tab,))
    (tmp_path / "data.tab").write_text("a,b\n")
    c = load_corpus(str(tmp_path / "data.tab"))
    assert (c.domain, [d.text for d in c.documents]) == ("data", ["a b\n"])
    (tmp_path / "m.yaml").write_text("name: m\ndomain: nl\nsource: local\npath: data.tab\n")  # a local manifest reads it too
    assert [d.text for d in load_corpus(str(tmp_path / "m.yaml")).documents] == ["a b\n"]
    assert corpus_help("'synthetic'") == "manifest name, .yaml manifest, " + ", ".join(kinds) + ", .tab or 'synthetic'"
    (tmp_path / "x.tsv").write_text("a\tb\n")
    suffixes = ", ".join(k for k in kinds if k.startswith("."))
    with pytest.raises(CorpusError, match=f"x.tsv is neither {suffixes}, .tab nor a .yaml manifest; "
                                          f"pass {', '.join('a ' + k for k in kinds)}, a .tab or a manifest"):
        load_corpus(str(tmp_path / "x.tsv"))


def test_a_manifest_source_added_to_the_records_is_read(tmp_path, monkeypatch):
    from truncsens.corpora import manifest

    echo = manifest.Source("echo", ("text",), lambda m, defaults, skipped: [Document(id="echo/0", text=m.options["text"])],
                           "all", "the text at key text")
    monkeypatch.setattr(manifest, "SOURCE_RECORDS", manifest.SOURCE_RECORDS + (echo,))
    (tmp_path / "e.yaml").write_text("name: e\ndomain: nl\nsource: echo\ntext: hello there\n")
    c = load_corpus(str(tmp_path / "e.yaml"))
    assert (c.name, c.domain, c.split, [d.text for d in c.documents]) == ("e", "nl", "all", ["hello there"])
    (tmp_path / "bad.yaml").write_text("name: e\ndomain: nl\nsource: echo\n")
    with pytest.raises(CorpusError, match="has source 'echo' but lacks the key 'text'"):
        read_manifest(tmp_path / "bad.yaml")
    (tmp_path / "ftp.yaml").write_text("name: e\ndomain: nl\nsource: ftp\n")
    names = tuple(s.name for s in manifest.SOURCE_RECORDS)
    assert names[:3] + names[-1:] == ("builtin", "local", "hf", "echo")
    with pytest.raises(CorpusError, match=re.escape(f"source must be one of {names}, got 'ftp' (") + ".*echo: the text at key text\\)"):
        read_manifest(tmp_path / "ftp.yaml")


@pytest.mark.parametrize("command", ["measure", "plan", "certify", "certify-attribution"])
def test_corpus_help_names_every_path_kind(command):
    from typer.testing import CliRunner

    from truncsens.cli.main import app
    from truncsens.corpora import corpus_help

    out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "300"}).output
    assert corpus_help() in out or corpus_help("'synthetic'") in out
