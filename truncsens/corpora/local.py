"""Local corpora: a folder of text files, one ``.txt`` file, or a ``.jsonl`` file."""

from __future__ import annotations

import json
from pathlib import Path

from truncsens.corpora.document import Document


class CorpusError(ValueError):
    """A corpus could not be read or is empty; the message names the problem and the fix."""


def folder_documents(folder: Path, pattern: str = "**/*") -> list[Document]:
    """One document per UTF-8 text file under ``folder`` matching ``pattern`` (sorted by path).

    Files that are not valid UTF-8 are skipped.

    Raises:
        CorpusError: no matching file is readable and non-empty.
    """
    docs = []
    for path in sorted(folder.glob(pattern)):
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(id=path.relative_to(folder).as_posix(), text=text))
    if not docs:
        raise CorpusError(f"corpus folder {folder} has no non-empty UTF-8 text files matching {pattern!r}")
    return docs


def text_file_documents(path: Path) -> list[Document]:
    """A ``.txt`` file as one document (id = file name; bytes that are not UTF-8 become U+FFFD).

    Raises:
        CorpusError: the file holds only whitespace.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise CorpusError(f"corpus file {path} is empty")
    return [Document(id=path.name, text=text)]


def jsonl_documents(path: Path, text_field: str = "text", id_field: str | None = None) -> list[Document]:
    """One document per line of a ``.jsonl`` file, text from ``text_field``.

    Raises:
        CorpusError: a line is not JSON, or lacks the text field, or the file has no documents.
    """
    docs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or text_field not in record:
                raise CorpusError(f"{path}:{lineno} has no field {text_field!r}; pass --text-field NAME")
            text = record[text_field]
            if not isinstance(text, str) or not text.strip():
                continue
            doc_id = str(record[id_field]) if id_field and id_field in record else f"{path.name}:{lineno}"
            docs.append(Document(id=doc_id, text=text))
    if not docs:
        raise CorpusError(f"corpus file {path} holds no non-empty {text_field!r} texts")
    return docs
