"""Documents and the deterministic train / held-out split."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

HELDOUT_FRACTION = 0.1
SPLITS = ("train", "heldout", "all")


def id_bytes(doc_id: str) -> bytes:
    """Bytes of an id for hashing: UTF-8 with ``surrogatepass`` (one-to-one on every ``str``)."""
    return doc_id.encode("utf-8", errors="surrogatepass")


@dataclass(frozen=True)
class Document:
    """One document of a corpus: a stable id and its raw text."""

    id: str
    text: str


def split_of(doc_id: str, heldout_fraction: float = HELDOUT_FRACTION) -> str:
    """Split ("train" or "heldout") of a document, from the SHA-256 of its id.

    The split depends only on the id, so it is the same on every machine and in every run. Ids are
    hashed as UTF-8 with ``surrogatepass`` (equal to UTF-8 for every valid id; a non-UTF-8 file
    name, whose bytes Python holds as lone surrogates, hashes too).
    """
    digest = hashlib.sha256(id_bytes(doc_id)).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return "heldout" if u < heldout_fraction else "train"


def select_split(docs: list[Document], split: str) -> list[Document]:
    """Documents of one split ("train", "heldout" or "all").

    Raises:
        ValueError: unknown split name.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if split == "all":
        return list(docs)
    return [d for d in docs if split_of(d.id) == split]


def corpus_sha256(docs: list[Document]) -> str:
    """SHA-256 over the ids and texts of the documents, in order (provenance of a run)."""
    h = hashlib.sha256()
    for d in docs:
        h.update(id_bytes(d.id))
        h.update(b"\0")
        h.update(d.text.encode("utf-8", errors="surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()
