"""Resolve ``--domain`` / ``--corpus`` into documents and provenance."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from truncsens.corpora.builtin import BUILTIN
from truncsens.corpora.document import Document, corpus_sha256, select_split
from truncsens.corpora import local as _local
from truncsens.corpora.local import CorpusError, PathKind, _has_surrogate, describe_skipped, file_suffixes, path_kind
from truncsens.corpora.manifest import Manifest, read_manifest, source_record

DOMAINS = ("code", "nl")
TEXTS_NAME = "texts"  # name and domain label of a corpus given as Python strings (texts_corpus)
MANIFEST_SUFFIXES = (".yaml", ".yml")


def corpus_help(*more: str) -> str:
    """What ``--corpus`` takes, for ``--help``: "manifest name, .yaml manifest, folder, .txt or .jsonl"
    (the path kinds from :data:`truncsens.corpora.local.PATH_KINDS`), then ``more``."""
    words = ["manifest name", ".yaml manifest", *(k.name for k in _local.PATH_KINDS), *more]
    return ", ".join(words[:-1]) + " or " + words[-1]


@dataclass
class Corpus:
    """Documents of one corpus split, with what the results attrs record.

    Attributes:
        name: manifest name or path (attr ``corpus``).
        domain: the label recorded in results (attr ``domain``): the manifest's ``domain`` for a
            manifest ("code" / "nl" for the builtin ones), the corpus's own name (folder name or
            file stem) for a folder, ``.txt`` or ``.jsonl`` given as a path.
        split: the split that was read ("heldout", "train" or "all").
        documents: the documents of the split, sorted by id; every one, empty ones included.
        sha256: :func:`corpus_sha256` of the documents.
        skipped: files / records that are not documents, by reason (see
            :data:`truncsens.corpora.local.SKIP_REASONS`; builtin corpora also ``empty``), counted
            over the whole corpus before the split; ``{}`` when nothing was skipped.
    """

    name: str
    domain: str
    split: str
    documents: list[Document]
    sha256: str
    skipped: dict[str, int] = field(default_factory=dict)


def texts_corpus(texts: Sequence[str], name: str = TEXTS_NAME) -> Corpus:
    """A corpus of documents given as Python strings (``truncsens.measure(texts=[...])``), in their order.

    Document ``i`` has the id ``text-<i>``, zero-padded to at least 5 digits so that ids sort in the
    order given (``text-00000``, ``text-00001``, ...): a folder of files named by these ids, read with
    ``--corpus FOLDER``, is the same corpus. Name and domain label (attrs ``corpus`` and ``domain``)
    are ``name``; the split is "all" until :func:`load_corpus` selects one.

    Raises:
        CorpusError: no text, a text that is not a ``str``, or one holding lone surrogates (which no
            tokenizer reads).
    """
    if isinstance(texts, str):
        raise CorpusError("texts must be a list of strings (documents), not one string; wrap it: texts=[text]")
    texts = list(texts)
    if not texts:
        raise CorpusError("texts is empty: give at least one document")
    width = max(5, len(str(len(texts) - 1)))
    docs = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise CorpusError(f"texts[{i}] is a {type(text).__name__}, not a string")
        if _has_surrogate(text):
            raise CorpusError(f"texts[{i}] holds lone surrogates (\\ud800 escapes), which no tokenizer reads")
        docs.append(Document(id=f"text-{i:0{width}d}", text=text))
    return Corpus(name=name, domain=name, split="all", documents=docs, sha256=corpus_sha256(docs))


def check_corpus(corpus: str | None, domain: str) -> tuple[PathKind | None, Path, Manifest | None]:
    """Where ``corpus`` (or ``domain``'s default manifest) is, checked without reading a document: what
    :func:`load_corpus` refuses by name alone, so a command can say it before it loads a model.

    Returns:
        (the path kind of a local corpus, or None; its path; the manifest read, or None for a path).

    Raises:
        CorpusError: an unknown domain, a corpus path that does not exist, a file of no known kind, or
            an unknown or unreadable manifest.
    """
    if domain not in DOMAINS:
        raise CorpusError(f"unknown domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    spec = corpus or domain
    path = Path(spec).expanduser()
    # corpus=None means the domain's default manifest, even where the cwd holds a file or folder of that name
    given = corpus is not None
    kind = path_kind(path) if given else None
    if kind is not None:
        return kind, path, None
    if given and path.is_file() and path.suffix not in MANIFEST_SUFFIXES:
        raise CorpusError(f"corpus file {spec} is neither {', '.join(file_suffixes())} nor a .yaml manifest; pass "
                          + ", ".join(f"a {k.name}" for k in _local.PATH_KINDS) + " or a manifest")
    if given and (path.suffix in file_suffixes() or (("/" in spec or path.suffix) and not path.suffix in MANIFEST_SUFFIXES)):
        raise CorpusError(f"corpus path {spec} does not exist")
    return None, path, read_manifest(spec)


def load_corpus(corpus: str | Corpus | None = None, domain: str = "code", split: str = "auto",
                text_field: str = "text", glob: str = "**/*") -> Corpus:
    """Load a corpus.

    Args:
        corpus: None (the default manifest of ``domain``), a shipped manifest name, a ``.yaml``
            manifest path, a folder of text files, a ``.txt`` file, a ``.jsonl`` file, or a
            :class:`Corpus` already in memory (:func:`texts_corpus`; ``domain`` and ``text_field``
            are then unused, and the split is taken from its documents).
        domain: "code" or "nl"; picks the default manifest. The recorded label is the manifest's
            ``domain``, or for a corpus given as a path its own name (see :class:`Corpus`).
        split: "heldout", "train", "all", or "auto" (held-out for builtin corpora, whose train
            split trained the reference model; all documents otherwise).
        text_field: field of a ``.jsonl`` record holding the text.
        glob: file pattern inside a folder corpus.

    Raises:
        CorpusError: unknown domain or corpus, unreadable or empty corpus, every document of the
            split empty, or two documents with the same id.
    """
    if isinstance(corpus, Corpus):  # documents given in memory
        return _split_corpus(corpus.name, corpus.domain, corpus.documents, "all" if split == "auto" else split,
                             Counter(corpus.skipped))
    kind, path, m = check_corpus(corpus, domain)
    spec = corpus or domain
    auto_split = "all"
    skipped: Counter = Counter()
    if kind is not None:
        label = path.resolve().name if path.is_dir() else path.stem
        docs, name, domain = kind.read(path, {"glob": glob, "text_field": text_field}, skipped), str(path), label
    else:
        source = source_record(m.source)
        name, domain, auto_split = m.name, m.domain, source.auto_split
        docs = source.read(m, {"glob": glob, "text_field": text_field}, skipped)
    return _split_corpus(name, domain, docs, auto_split if split == "auto" else split, skipped)


def _split_corpus(name: str, domain: str, docs: list[Document], split: str, skipped: Counter) -> Corpus:
    """The :class:`Corpus` of one split of ``docs`` (sorted by id).

    Raises:
        CorpusError: two documents with one id, no document in the split, or every one empty.
    """
    _check_unique_ids(docs, name)
    docs = sorted(select_split(docs, split), key=lambda d: d.id)
    if not docs:
        raise CorpusError(f"corpus {name!r} has no documents in split {split!r}")
    if not any(d.text.strip() for d in docs):
        raise CorpusError(f"corpus {name!r}: all {len(docs)} documents of split {split!r} are empty "
                          f"(skipped: {describe_skipped(skipped)})")
    return Corpus(name=name, domain=domain, split=split, documents=docs, sha256=corpus_sha256(docs),
                  skipped=dict(sorted((k, v) for k, v in skipped.items() if v)))


def _check_unique_ids(docs: list[Document], name: str) -> None:
    """Raise CorpusError when two documents share an id (document-level statistics group by it)."""
    seen: set[str] = set()
    for d in docs:
        if d.id in seen:
            raise CorpusError(f"corpus {name!r} has two documents with the id {d.id!r}; ids must be unique "
                              "(for a .jsonl corpus, pick another id field or none)")
        seen.add(d.id)
