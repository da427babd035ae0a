"""YAML corpus manifests (``truncsens/corpora/manifests/*.yaml``): one corpus each.

Keys: ``name``, ``domain`` (the label recorded in results, e.g. code | nl | legal), ``source``
(builtin | local | hf), ``license``, ``description``; for ``builtin``: ``builtin`` (code | nl); for
``local``: ``path`` (relative to the manifest), optional ``glob``, ``text_field``, ``id_field``; for
``hf``: ``dataset``, optional ``config``, ``data_dir``, ``split``, ``text_field``, ``id_field``,
``max_docs``, ``join_lines``. The format is documented in ``truncsens/corpora/manifests/README.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from truncsens.corpora.document import Document
from truncsens.corpora.local import CorpusError

SOURCES = ("builtin", "local", "hf")


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
    if data["source"] not in SOURCES:
        raise CorpusError(f"manifest {path}: source must be one of {SOURCES}, got {data['source']!r}")
    required = {"builtin": "builtin", "local": "path", "hf": "dataset"}[data["source"]]
    if required not in data:
        raise CorpusError(f"manifest {path} has source {data['source']!r} but lacks the key {required!r}")
    from truncsens.corpora.builtin import BUILTIN

    if data["source"] == "builtin" and data["builtin"] not in BUILTIN:
        names = [repr(n) for n in BUILTIN]
        raise CorpusError(f"manifest {path}: builtin must be {', '.join(names[:-1])} or {names[-1]}, got {data['builtin']!r}")
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
