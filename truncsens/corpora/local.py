"""Local corpora: a folder of text files, one ``.txt`` file, or a ``.jsonl`` file, one :class:`PathKind`
record each (:data:`PATH_KINDS`: how it is recognized, its reader, its word in ``--help``); the corpus
given as a path (``--corpus PATH``) and a ``local`` manifest's ``path`` are read through them.

Nothing is dropped silently. Every document is yielded, the empty ones too (the engine counts
them as checked and too short). What is not a document is counted by reason in a ``skipped``
counter that the caller passes in (:class:`collections.Counter`, reason -> count); the reasons are
:data:`SKIP_REASONS`.
"""

from __future__ import annotations

import json
import numbers
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from truncsens.corpora.document import Document

SKIP_REASONS = {
    "hidden": "a file under a hidden path (a name starting with '.', e.g. .git/COMMIT_EDITMSG)",
    "binary": "a file with a NUL byte (binary data, or UTF-16 text)",
    "not_utf8": "a file (or a .jsonl line) that is not valid UTF-8, e.g. Latin-1 text",
    "unreadable": "a file that cannot be read (permissions, a broken link)",
    "blank_line": "an empty line of a .jsonl file",
    "text_not_a_string": "a record whose text field is not a string (null, a number, a list)",
    "invalid_unicode": "a text holding lone surrogates (\\ud800 escapes in JSON), which no tokenizer reads",
}


class CorpusError(ValueError):
    """A corpus could not be read or is empty; the message names the problem and the fix."""


def describe_skipped(skipped: Counter | dict) -> str:
    """``"2 hidden, 1 not_utf8"`` (sorted by reason), or ``"nothing"``."""
    parts = [f"{n} {reason}" for reason, n in sorted(skipped.items()) if n]
    return ", ".join(parts) or "nothing"


def skipped_files_note(skipped: Mapping[str, int] | None) -> str:
    """``"3 corpus files skipped (2 empty, 1 not_utf8)"`` for the files a corpus left out (reasons:
    :data:`SKIP_REASONS` and the builtin corpora's ``empty``), or ``""`` when none was (or
    ``skipped`` is not a count by reason): what ``measure`` says on stderr and ``show`` prints
    under its first line."""
    if not isinstance(skipped, Mapping):  # no attr (a file from before it) or not a count by reason
        return ""
    n = sum(int(v) for v in skipped.values() if isinstance(v, numbers.Integral))
    if not n:
        return ""
    return f"{n} corpus file{'' if n == 1 else 's'} skipped ({describe_skipped(skipped)})"


def not_measured_notes(skipped: Mapping[str, int] | None) -> list[str]:
    """The stderr notes of a command whose results left corpus files out: ``["3 corpus files skipped
    (3 empty), not measured"]``, or ``[]`` (:func:`skipped_files_note`)."""
    note = skipped_files_note(skipped)
    return [f"{note}, not measured"] if note else []


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def decode_file(data: bytes) -> tuple[str | None, str | None]:
    """(text, None) for UTF-8 text, else (None, reason): "binary" (a NUL byte) or "not_utf8"."""
    if b"\0" in data:
        return None, "binary"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "not_utf8"


def folder_documents(folder: Path, pattern: str = "**/*", skipped: Counter | None = None) -> list[Document]:
    """One document per UTF-8 text file under ``folder`` matching ``pattern`` (sorted by path).

    Empty files are documents (text ``""``). Files under a hidden path (any part of the path below
    ``folder`` starting with ``.``), binary files, files that are not UTF-8 and unreadable files are
    skipped and counted in ``skipped`` by reason (:data:`SKIP_REASONS`). The id is the path relative to
    ``folder`` in POSIX form; a file name that is not UTF-8 keeps its bytes as lone surrogates
    (PEP 383, ``os.fsencode(id)`` gives them back).

    Raises:
        CorpusError: no matching file is a readable UTF-8 text file.
    """
    skipped = Counter() if skipped is None else skipped
    docs = []
    for path in sorted(folder.glob(pattern)):
        rel = path.relative_to(folder)
        if path.is_dir():
            continue
        if _is_hidden(rel):
            skipped["hidden"] += 1
            continue
        try:
            data = path.read_bytes()
        except OSError:  # permission denied, a broken link, a vanished file
            skipped["unreadable"] += 1
            continue
        text, reason = decode_file(data)
        if reason:
            skipped[reason] += 1
            continue
        docs.append(Document(id=rel.as_posix(), text=text))
    if not docs:
        raise CorpusError(f"corpus folder {folder} has no non-empty UTF-8 text files matching {pattern!r} "
                          f"(skipped: {describe_skipped(skipped)})")
    return docs


def text_file_documents(path: Path) -> list[Document]:
    """A ``.txt`` file as one document (id = file name).

    Raises:
        CorpusError: the file is binary, not UTF-8 (with the offset of the first bad byte), or holds
            only whitespace.
    """
    data = path.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise CorpusError(f"corpus file {path} holds a NUL byte at offset {nul}: it is binary (or UTF-16), not UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "convert it, e.g. `iconv -f latin1 -t utf-8`") from exc
    if not text.strip():
        raise CorpusError(f"corpus file {path} is empty")
    return [Document(id=path.name, text=text)]


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def jsonl_documents(path: Path, text_field: str = "text", id_field: str | None = None,
                    skipped: Counter | None = None) -> list[Document]:
    """One document per record of a ``.jsonl`` file, text from ``text_field`` (empty texts included).

    Blank lines, lines that are not UTF-8, records whose text is not a string and texts with lone
    surrogates are skipped and counted in ``skipped`` (:data:`SKIP_REASONS`). The id is
    ``str(record[id_field])`` where given and present, else ``<file name>:<line number>``.

    Raises:
        CorpusError: a line is not JSON, or lacks the text field, or the file has no documents.
    """
    skipped = Counter() if skipped is None else skipped
    docs = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not_utf8"] += 1
                continue
            if not line.strip():
                skipped["blank_line"] += 1
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or text_field not in record:
                raise CorpusError(f"{path}:{lineno} has no field {text_field!r}; pass --text-field NAME")
            text = record[text_field]
            if not isinstance(text, str):
                skipped["text_not_a_string"] += 1
                continue
            if _has_surrogate(text):
                skipped["invalid_unicode"] += 1
                continue
            doc_id = str(record[id_field]) if id_field and id_field in record else f"{path.name}:{lineno}"
            docs.append(Document(id=doc_id, text=text))
    if not docs:
        raise CorpusError(f"corpus file {path} holds no {text_field!r} texts (skipped: {describe_skipped(skipped)})")
    return docs


@dataclass(frozen=True)
class PathKind:
    """One kind of corpus given as a path: ``--corpus PATH``, or the ``path`` of a ``local`` manifest.

    Attributes:
        name: its word in ``--help`` and in messages ("folder", ".txt", ".jsonl").
        suffix: the suffix of a file of this kind; None: a folder.
        read: ``(path, options, skipped) -> documents``; ``options`` may hold ``glob`` (files of a
            folder), ``text_field`` and ``id_field`` (fields of a record); ``skipped`` counts what is
            not a document by reason (:data:`SKIP_REASONS`).
    """

    name: str
    suffix: str | None
    read: Callable[[Path, Mapping, Counter], list[Document]]

    def matches(self, path: Path) -> bool:
        """Whether ``path`` is an existing corpus of this kind."""
        return path.is_dir() if self.suffix is None else (path.suffix == self.suffix and path.is_file())


PATH_KINDS: tuple[PathKind, ...] = (
    PathKind("folder", None, lambda path, o, skipped: folder_documents(path, o.get("glob", "**/*"), skipped)),
    PathKind(".txt", ".txt", lambda path, o, skipped: text_file_documents(path)),
    PathKind(".jsonl", ".jsonl",
             lambda path, o, skipped: jsonl_documents(path, o.get("text_field", "text"), o.get("id_field"), skipped)),
)


def file_suffixes() -> tuple[str, ...]:
    """The suffixes of the file kinds of :data:`PATH_KINDS`: (".txt", ".jsonl")."""
    return tuple(k.suffix for k in PATH_KINDS if k.suffix)


def path_kind(path: Path) -> PathKind | None:
    """The kind of the existing corpus at ``path`` (:data:`PATH_KINDS`), or None."""
    return next((k for k in PATH_KINDS if k.matches(path)), None)
