"""YAML corpus manifests (``truncsens/corpora/manifests/*.yaml``): one corpus each.

Keys: ``name``, ``domain`` (the label recorded in results, e.g. code | nl | legal), ``source``
(builtin | local | hf), ``license``, ``description``; for ``builtin``: ``builtin`` (code | nl); for
``local``: ``path`` (relative to the manifest), optional ``glob``, ``text_field``, ``id_field``; for
``hf``: ``dataset``, optional ``config``, ``data_dir``, ``split``, ``text_field``, ``id_field``,
``max_docs``, ``join_lines``. The format is documented in ``truncsens/corpora/manifests/README.md``.

Each ``source`` is one :class:`Source` record of :data:`SOURCE_RECORDS` (the key it requires, its
reader, the split ``auto`` reads, its help line); :func:`read_manifest` and
:func:`truncsens.corpora.load_corpus` read them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from truncsens.corpora.builtin import BUILTIN
from truncsens.corpora.document import Document
from truncsens.corpora import local as _local
from truncsens.corpora.local import CorpusError, path_kind, text_file_documents


@dataclass
class Manifest:
    """A parsed manifest. ``path`` is the file it came from (for relative local paths)."""

    name: str
    domain: str
    source: str
    options: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def builtin_manifest_names() -> list[str]:
    """Names of the manifests shipped in ``truncsens/corpora/manifests/``."""
    return sorted(p.name[:-5] for p in resources.files("truncsens.corpora.manifests").iterdir() if p.name.endswith(".yaml"))


def read_manifest(path_or_name: str | Path) -> Manifest:
    """Read a manifest from a YAML path or by the name of a shipped one.

    Raises:
        CorpusError: no such manifest, invalid YAML, or missing keys.
    """
    path = Path(path_or_name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text = path.read_text(encoding="utf-8")
    else:
        shipped = resources.files("truncsens.corpora.manifests") / f"{path_or_name}.yaml"
        if not shipped.is_file():
            raise CorpusError(
                f"no corpus manifest {path_or_name!r}; shipped manifests: {', '.join(builtin_manifest_names())}")
        text, path = shipped.read_text(encoding="utf-8"), Path(str(shipped))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CorpusError(f"manifest {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CorpusError(f"manifest {path} must be a YAML mapping")
    for key in ("name", "domain", "source"):
        if key not in data:
            raise CorpusError(f"manifest {path} lacks the key {key!r}")
    if not isinstance(data["domain"], str) or not data["domain"].strip():
        raise CorpusError(f"manifest {path}: domain must be a non-empty string (the label recorded in results), "
                          f"got {data['domain']!r}")
    names = tuple(s.name for s in SOURCE_RECORDS)
    if data["source"] not in names:
        kinds = "; ".join(f"{s.name}: {s.help}" for s in SOURCE_RECORDS)
        raise CorpusError(f"manifest {path}: source must be one of {names}, got {data['source']!r} ({kinds})")
    source = source_record(data["source"])
    for required in source.required:
        if required not in data:
            raise CorpusError(f"manifest {path} has source {data['source']!r} but lacks the key {required!r}")
    if source.check is not None:
        source.check(path, data)
    options = {k: v for k, v in data.items() if k not in ("name", "domain", "source")}
    return Manifest(name=data["name"], domain=data["domain"], source=data["source"], options=options, path=path)


def hf_documents(m: Manifest, skipped: Counter | None = None) -> list[Document]:
    """Documents of a Hugging Face dataset manifest, through ``datasets``.

    Every row whose text is a string is a document, the empty ones too; rows whose text is not a
    string are counted in ``skipped["text_not_a_string"]``. ``max_docs`` caps the documents kept.

    Raises:
        CorpusError: ``datasets`` is not installed, the hub is unreachable, or the text field is absent.
    """
    try:
        import datasets
    except ImportError as exc:
        raise CorpusError(f"corpus {m.name!r} needs the `datasets` package: pip install 'truncsens[hf]'") from exc
    o = m.options
    kwargs = {"split": o.get("split", "train")}
    if o.get("data_dir"):
        kwargs["data_dir"] = o["data_dir"]
    try:
        ds = datasets.load_dataset(o["dataset"], o.get("config"), **kwargs)
    except (ConnectionError, OSError) as exc:
        # datasets' DatasetNotFoundError (unknown or gated dataset) is a FileNotFoundError too: say what it said
        detail = (str(exc).strip().splitlines() or [""])[0]
        raise CorpusError(
            f"cannot load dataset {o['dataset']!r} for corpus {m.name!r}: the Hugging Face hub is unreachable, the "
            f"dataset is not cached, or it is unknown or gated ({type(exc).__name__}: {detail}); run where the hub is "
            "reachable (accepting the dataset's terms if it has any), or use a local corpus") from exc
    except Exception as exc:  # datasets raises many kinds (DatasetNotFoundError, ...)
        raise CorpusError(f"cannot load dataset {o['dataset']!r} for corpus {m.name!r}: {exc}") from exc
    field_name = o.get("text_field", "text")
    if field_name not in ds.column_names:
        raise CorpusError(f"dataset {o['dataset']!r} has no column {field_name!r}; columns: {ds.column_names}")
    max_docs = o.get("max_docs")
    if o.get("join_lines"):
        return _join_articles(ds[field_name], m.name)
    skipped = Counter() if skipped is None else skipped
    docs = []
    for i, row in enumerate(ds):
        if max_docs and len(docs) >= max_docs:
            break
        text = row[field_name]
        if not isinstance(text, str):
            skipped["text_not_a_string"] += 1
            continue
        doc_id = str(row[o["id_field"]]) if o.get("id_field") else f"{m.name}/{i}"
        docs.append(Document(id=doc_id, text=text))
    return docs


def _join_articles(lines: list[str], name: str) -> list[Document]:
    """WikiText-style rows (one line each, articles start at `` = Title = ``) joined into articles."""
    docs, current = [], []
    for line in lines:
        if line.startswith(" = ") and not line.startswith(" = = ") and current:
            docs.append(Document(id=f"{name}/{len(docs)}", text="".join(current)))
            current = []
        current.append(line)
    if current:
        docs.append(Document(id=f"{name}/{len(docs)}", text="".join(current)))
    return docs


def _check_builtin(path: Path, data: Mapping) -> None:
    if data["builtin"] not in BUILTIN:
        names = [repr(n) for n in BUILTIN]
        raise CorpusError(f"manifest {path}: builtin must be {', '.join(names[:-1])} or {names[-1]}, got {data['builtin']!r}")


def _local_documents(m: Manifest, defaults: Mapping, skipped: Counter) -> list[Document]:
    """The documents at a ``local`` manifest's ``path`` (relative to the manifest), read as its
    :data:`~truncsens.corpora.local.PATH_KINDS` kind; any other file is one text document, as a ``.txt``."""
    base = m.path.parent if m.path else Path(".")
    local = (base / m.options["path"]).resolve()
    if not local.exists():
        raise CorpusError(f"manifest {m.path}: local corpus path {local} does not exist")
    options = {"glob": m.options.get("glob", defaults.get("glob", "**/*")),
               "text_field": m.options.get("text_field", defaults.get("text_field", "text")),
               "id_field": m.options.get("id_field")}
    kind = path_kind(local)
    return kind.read(local, options, skipped) if kind is not None else text_file_documents(local)


@dataclass(frozen=True)
class Source:
    """One ``source`` of a manifest.

    Attributes:
        name: the value of the manifest's ``source`` key.
        required: the keys it needs besides ``name``, ``domain`` and ``source``.
        read: ``(manifest, defaults, skipped) -> documents``; ``defaults``: ``glob`` and ``text_field``
            as given to :func:`truncsens.corpora.load_corpus` (a manifest's own keys win); ``skipped``
            counts what is not a document by reason.
        auto_split: the split ``--split auto`` reads ("heldout" where the train split trained the
            reference model, else "all").
        help: one line saying what it reads, for messages.
        check: ``(manifest path, data) -> None``, raising :class:`CorpusError` for a bad value of its keys.
    """

    name: str
    required: tuple[str, ...]
    read: Callable[[Manifest, Mapping, Counter], list[Document]]
    auto_split: str
    help: str
    check: Callable[[Path, Mapping], None] | None = None


SOURCE_RECORDS: tuple[Source, ...] = (
    Source("builtin", ("builtin",), lambda m, defaults, skipped: BUILTIN[m.options["builtin"]](skipped=skipped),
           "heldout", f"a corpus of the running Python installation (key builtin: {', '.join(BUILTIN)})", _check_builtin),
    Source("local", ("path",), _local_documents, "all",
           f"a {', '.join(k.name for k in _local.PATH_KINDS)} at key path, relative to the manifest"),
    Source("hf", ("dataset",), lambda m, defaults, skipped: hf_documents(m, skipped), "all",
           "a Hugging Face dataset at key dataset (pip install 'truncsens[hf]')"),
)


def source_record(name: str) -> Source:
    """The record of manifest source ``name``.

    Raises:
        CorpusError: unknown source.
    """
    for s in SOURCE_RECORDS:
        if s.name == name:
            return s
    raise CorpusError(f"unknown manifest source {name!r}; choose one of {', '.join(s.name for s in SOURCE_RECORDS)}")
