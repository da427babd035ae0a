"""Builtin corpora every Python installation has.

- ``code``: the CPython standard library sources of the running interpreter, one document per
  ``.py`` file (tests, site-packages and vendored test data excluded).
- ``nl``: English prose from the same installation: the pydoc topics (one document each) and the
  module / class / function docstrings of each standard-library module, in source order, one
  document per module. Docstrings are read with :mod:`ast`, so nothing is imported.

- ``long`` (manifest ``stdlib-long``): long documents for reference contexts of 8k-32k tokens, made
  of whole standard-library packages: per top-level package (a folder with ``__init__.py``) one
  code document, all its ``.py`` files concatenated in sorted path order, each after a
  ``# file: <path>`` line (id ``long/code/<package>``), and one prose document, the docstrings of
  those files in the same order (id ``long/nl/<package>``); plus every pydoc topic in name order as
  one document (id ``long/nl/pydoc-topics``). Held-out split by the hash of the id, as for the others.

All take an optional ``skipped`` :class:`collections.Counter` and count in it the files they leave
out by reason: ``not_utf8`` (a source file that is not UTF-8), ``unreadable`` and, for ``code``, ``empty`` (a
``.py`` file holding only whitespace, e.g. an empty ``__init__.py``: by definition not a document of
the builtin code corpus).
"""

from __future__ import annotations

import ast
import fnmatch
import os
import sysconfig
from collections import Counter
from pathlib import Path

from truncsens.corpora.document import Document

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
_MIN_DOCSTRING_CHARS = 40


def stdlib_dir() -> Path:
    """The standard-library folder of the running interpreter (``sysconfig`` ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith("test_")


def _stdlib_files(root: Path) -> list[Path]:
    """The ``.py`` paths under ``root`` outside the excluded folders, in ``sorted(Path)`` order. The walk
    never enters an excluded folder: a ``site-packages`` of thousands of files beside the standard
    library (an interpreter with packages installed into it) costs nothing."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _excluded_dir(d)]  # pruned: not listed at all
        found.extend(Path(folder, name) for name in (*dirs, *files) if fnmatch.fnmatchcase(name, "*.py"))
    return [p for p in sorted(found) if not (p.name.startswith("test_") or p.name == "__phello__.foo.py")]


def _read(path: Path, skipped: Counter) -> str | None:
    """The UTF-8 text of a file, or None after counting why not (``not_utf8`` or ``unreadable``)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1
    except OSError:
        skipped["unreadable"] += 1
    return None


def code_documents(root: Path | None = None, skipped: Counter | None = None) -> list[Document]:
    """One document per non-empty standard-library source file, id ``code/<relative path>``."""
    root = root or stdlib_dir()
    skipped = Counter() if skipped is None else skipped
    docs = []
    for path in _stdlib_files(root):
        text = _read(path, skipped)
        if text is None:
            continue
        if not text.strip():
            skipped["empty"] += 1
        else:
            docs.append(Document(id=f"code/{path.relative_to(root).as_posix()}", text=text))
    return docs


def _docstrings_in_order(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
                found.append((getattr(node, "lineno", 0), doc))
    found.sort(key=lambda item: item[0])
    return [doc for _, doc in found]


def nl_documents(root: Path | None = None, skipped: Counter | None = None) -> list[Document]:
    """Pydoc topics (id ``nl/topic/<name>``) and per-module docstrings (id ``nl/module/<path>``)."""
    skipped = Counter() if skipped is None else skipped
    docs = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - every CPython ships pydoc_data
        topics = {}
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            docs.append(Document(id=f"nl/topic/{name}", text=text))
    root = root or stdlib_dir()
    for path in _stdlib_files(root):
        source = _read(path, skipped)
        if source is None:
            continue
        strings = _docstrings_in_order(source)
        if strings:
            docs.append(Document(id=f"nl/module/{path.relative_to(root).as_posix()}", text="\n\n".join(strings)))
    return docs


def _packages(root: Path) -> dict[str, list[Path]]:
    """Top-level packages of the standard library (folders with ``__init__.py``) -> their files, sorted."""
    out: dict[str, list[Path]] = {}
    for path in _stdlib_files(root):
        parts = path.relative_to(root).parts
        if len(parts) > 1 and (root / parts[0] / "__init__.py").is_file():
            out.setdefault(parts[0], []).append(path)
    return dict(sorted(out.items()))


def long_documents(root: Path | None = None, skipped: Counter | None = None) -> list[Document]:
    """Whole packages as documents (module docstring, ``long``): ``long/code/<package>``,
    ``long/nl/<package>`` (packages with docstrings) and ``long/nl/pydoc-topics``."""
    root = root or stdlib_dir()
    skipped = Counter() if skipped is None else skipped
    docs = []
    for name, files in _packages(root).items():
        code, prose = [], []
        for path in files:
            text = _read(path, skipped)
            if text is None or not text.strip():
                continue
            code.append(f"# file: {path.relative_to(root).as_posix()}\n{text}")
            prose += _docstrings_in_order(text)
        if code:
            docs.append(Document(id=f"long/code/{name}", text="\n".join(code)))
        if prose:
            docs.append(Document(id=f"long/nl/{name}", text="\n\n".join(prose)))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - every CPython ships pydoc_data
        topics = {}
    text = "\n\n".join(topics[k].strip() for k in sorted(topics) if topics[k].strip())
    if text:
        docs.append(Document(id="long/nl/pydoc-topics", text=text))
    return docs


BUILTIN = {"code": code_documents, "nl": nl_documents, "long": long_documents}
