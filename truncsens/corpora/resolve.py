"""Resolve ``--domain`` / ``--corpus`` into documents and provenance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from truncsens.corpora.builtin import BUILTIN
from truncsens.corpora.document import Document, corpus_sha256, select_split
from truncsens.corpora.local import CorpusError, folder_documents, jsonl_documents, text_file_documents
from truncsens.corpora.manifest import hf_documents, read_manifest

DOMAINS = ("code", "nl")


@dataclass
class Corpus:
    """Documents of one corpus split, with what the results attrs record.

    Attributes:
        name: manifest name or path (attr ``corpus``).
        domain: "code", "nl" or "" when unknown (attr ``domain``).
        split: the split that was read ("heldout", "train" or "all").
        documents: the documents, sorted by id.
        sha256: :func:`corpus_sha256` of the documents.
    """

    name: str
    domain: str
    split: str
    documents: list[Document]
    sha256: str


def load_corpus(corpus: str | None = None, domain: str = "code", split: str = "auto",
                text_field: str = "text", glob: str = "**/*") -> Corpus:
    """Load a corpus.

    Args:
        corpus: None (the default manifest of ``domain``), a shipped manifest name, a ``.yaml``
            manifest path, a folder of text files, a ``.txt`` file, or a ``.jsonl`` file.
        domain: "code" or "nl"; picks the default manifest and is recorded.
        split: "heldout", "train", "all", or "auto" (held-out for builtin corpora, whose train
            split trained the reference model; all documents otherwise).
        text_field: field of a ``.jsonl`` record holding the text.
        glob: file pattern inside a folder corpus.

    Raises:
        CorpusError: unknown domain or corpus, unreadable or empty corpus.
    """
    if domain not in DOMAINS:
        raise CorpusError(f"unknown domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    spec = corpus or domain
    path = Path(spec).expanduser()
    builtin = False
    # corpus=None means the domain's default manifest, even where the cwd holds a file or folder of that name
    given = corpus is not None
    if given and path.is_dir():
        docs, name = folder_documents(path, glob), str(path)
    elif given and path.suffix == ".jsonl" and path.is_file():
        docs, name = jsonl_documents(path, text_field), str(path)
    elif given and path.suffix == ".txt" and path.is_file():
        docs, name = text_file_documents(path), str(path)
    elif given and path.is_file() and path.suffix not in (".yaml", ".yml"):
        raise CorpusError(
            f"corpus file {spec} is neither .txt, .jsonl nor a .yaml manifest; pass a folder, a .txt, a .jsonl or a manifest")
    elif given and (path.suffix in (".txt", ".jsonl") or (("/" in spec or path.suffix) and not path.suffix in (".yaml", ".yml"))):
        raise CorpusError(f"corpus path {spec} does not exist")
    else:
        m = read_manifest(spec)
        name = m.name
        if corpus is not None and m.domain in DOMAINS:
            domain = m.domain
        if m.source == "builtin":
            docs, builtin = BUILTIN[m.options["builtin"]](), True
        elif m.source == "local":
            base = m.path.parent if m.path else Path(".")
            local = (base / m.options["path"]).resolve()
            if not local.exists():
                raise CorpusError(f"manifest {m.path}: local corpus path {local} does not exist")
            if local.is_dir():
                docs = folder_documents(local, m.options.get("glob", glob))
            elif local.suffix == ".jsonl":
                docs = jsonl_documents(local, m.options.get("text_field", text_field))
            else:
                docs = text_file_documents(local)
        else:
            docs = hf_documents(m)
    if split == "auto":
        split = "heldout" if builtin else "all"
    docs = sorted(select_split(docs, split), key=lambda d: d.id)
    if not docs:
        raise CorpusError(f"corpus {name!r} has no documents in split {split!r}")
    return Corpus(name=name, domain=domain, split=split, documents=docs, sha256=corpus_sha256(docs))
