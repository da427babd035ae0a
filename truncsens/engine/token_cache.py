"""Token ids of a corpus kept between runs, so a run does not tokenize the same corpus again.

A run tokenizes every document of its corpus (the counts it reports, e.g. "20 of 67 too short",
are over all of them), which costs more CPU than a small run's forwards. The ids depend only on the
documents, the tokenizer and the BOS rule (:mod:`truncsens.engine.documents`), so they are kept in
one file per (corpus, tokenizer, BOS) under the user's cache folder and read back by the next run:

- the key: SHA-256 of the corpus (``corpus_sha256``: ids and texts of the documents, in order), the
  tokenizer's fingerprint (:func:`tokenizer_fingerprint`: its class, the versions of transformers
  and tokenizers, and its whole serialized state: normalizer, pre-tokenizer, vocabulary, merges,
  added tokens) and the BOS id put in front;
- the folder: ``$TRUNCSENS_CACHE_DIR/tokens`` if that variable is set (empty: no cache), else
  ``$XDG_CACHE_HOME/truncsens/tokens`` (``~/.cache/truncsens/tokens``);
- the file (``<key>.npz``, uncompressed numpy arrays): every document's ids concatenated (int64),
  the offsets where each starts (``[n_docs + 1]``), the document ids (UTF-8 JSON) and a SHA-256 of
  those three, checked on every read. Written atomically (a temporary file renamed over it);
- bounded: a file read is marked used (its modification time set to now), and after each write the
  folder keeps the :data:`MAX_FILES` (32) most recently used files within :data:`MAX_BYTES` (1 GiB)
  together, the newest always, deleting the others (:func:`prune`); a file of an older format or of
  a corpus no longer measured thus goes in time.

A file that cannot be read, fails its checksum or holds other documents is ignored: the corpus is
tokenized and the file rewritten. A tokenizer without a serialized state (a slow, Python-only one)
is not cached: it is tokenized every run. A cache folder that cannot be written is passed over
silently: the cache saves time, it never changes a result.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from truncsens.results.paths import write_atomic
from truncsens.targets import TokenDoc

CACHE_ENV = "TRUNCSENS_CACHE_DIR"
FORMAT = "truncsens-token-ids-1"  # bump when the layout of a file or the BOS rule changes
MAX_FILES = 32  # token-id files kept, the most recently used (a corpus of 64 documents of 8k tokens: ~4 MB)
MAX_BYTES = 1 << 30  # and at most this many bytes together (the most recently used file always stays)


def cache_folder() -> Path | None:
    """The folder of the token-id files (module docstring), or None when ``TRUNCSENS_CACHE_DIR`` is empty."""
    root = os.environ.get(CACHE_ENV)
    if root is None:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "truncsens")
    if not root.strip():
        return None
    return Path(root).expanduser() / "tokens"


def tokenizer_fingerprint(tokenizer) -> str | None:
    """SHA-256 (hex) of what decides a fast tokenizer's ids: its class, the transformers and tokenizers
    versions and its serialized state (``backend_tokenizer.to_str()``); None for a tokenizer without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return None
    try:
        state = to_str()
    except Exception:  # a state the tokenizers library cannot serialize: not cached
        return None
    import tokenizers
    import transformers

    h = hashlib.sha256()
    for part in (type(tokenizer).__module__, type(tokenizer).__qualname__, transformers.__version__,
                 tokenizers.__version__, state):
        h.update(str(part).encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def cache_key(corpus_sha256: str, fingerprint: str, bos_id: int | None) -> str:
    """The file name's key: SHA-256 (hex) of the format, the corpus hash, the tokenizer fingerprint and the BOS id."""
    return hashlib.sha256(f"{FORMAT}\0{corpus_sha256}\0{fingerprint}\0{bos_id}".encode()).hexdigest()


def _digest(ids: np.ndarray, offsets: np.ndarray, names: bytes) -> str:
    h = hashlib.sha256()
    for part in (ids.astype("<i8").tobytes(), offsets.astype("<i8").tobytes(), names):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def encode(docs: list[TokenDoc]) -> bytes:
    """The bytes of a token-id file holding ``docs`` (module docstring)."""
    ids = np.concatenate([d.ids.numpy().astype(np.int64) for d in docs]) if docs else np.zeros(0, np.int64)
    offsets = np.zeros(len(docs) + 1, np.int64)
    offsets[1:] = np.cumsum([d.ids.numel() for d in docs])
    names = json.dumps([d.id for d in docs]).encode("utf-8", "surrogatepass")
    buf = io.BytesIO()
    np.savez(buf, ids=ids, offsets=offsets, names=np.frombuffer(names, np.uint8),
             digest=np.frombuffer(_digest(ids, offsets, names).encode(), np.uint8))
    return buf.getvalue()


def decode(data: bytes, doc_ids: list[str]) -> list[TokenDoc] | None:
    """The documents of a token-id file's bytes, or None when they are not a whole, intact file for
    exactly the documents ``doc_ids`` (in that order)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as f:
            ids, offsets, names, digest = (f[k] for k in ("ids", "offsets", "names", "digest"))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    names_bytes = names.tobytes()
    if (ids.dtype != np.int64 or offsets.dtype != np.int64 or digest.tobytes().decode("ascii", "replace")
            != _digest(ids, offsets, names_bytes)):
        return None
    try:
        stored = json.loads(names_bytes.decode("utf-8", "surrogatepass"))
    except ValueError:
        return None
    if (stored != list(doc_ids) or offsets.shape != (len(doc_ids) + 1,) or offsets[0] != 0
            or offsets[-1] != ids.size or np.any(np.diff(offsets) < 0)):
        return None
    return [TokenDoc(name, torch.from_numpy(ids[a:b].copy())) for name, a, b in zip(stored, offsets[:-1], offsets[1:])]


def cached_token_docs(docs, corpus_sha256: str, tokenizer, bos_id: int | None, tokenize) -> tuple[list[TokenDoc], bool]:
    """The token documents of ``docs`` from the cache, or ``tokenize(docs, tokenizer, bos_id)`` written to it.

    Args:
        docs: the corpus's documents (``id``, ``text``), in order.
        corpus_sha256: the corpus hash of ``docs`` (:func:`truncsens.corpora.document.corpus_sha256`).
        tokenizer: a Hugging Face tokenizer.
        bos_id: the BOS id put in front of every document (None: none).
        tokenize: the tokenizing function (:func:`truncsens.engine.documents.tokenize_documents`).

    Returns:
        (token documents, whether they came from the cache).
    """
    folder = cache_folder()
    fingerprint = tokenizer_fingerprint(tokenizer) if folder is not None else None
    if folder is None or fingerprint is None:
        return tokenize(docs, tokenizer, bos_id), False
    path = folder / f"{cache_key(corpus_sha256, fingerprint, bos_id)}.npz"
    try:
        data = path.read_bytes()
    except OSError:  # not there yet, or unreadable
        data = None
    if data is not None:
        found = decode(data, [d.id for d in docs])
        if found is not None:
            try:
                os.utime(path)  # used now: the last file pruning deletes
            except OSError:
                pass
            return found, True
    token_docs = tokenize(docs, tokenizer, bos_id)
    try:
        write_atomic(path, encode(token_docs))
    except OSError:  # a cache folder that cannot be written (read-only, full): tokenized, not kept
        return token_docs, False
    prune(folder)
    return token_docs, False


def prune(folder: Path, max_files: int | None = None, max_bytes: int | None = None) -> list[Path]:
    """Delete the least recently used token-id files (``*.npz``) of ``folder`` beyond ``max_files``
    files or ``max_bytes`` bytes together (defaults :data:`MAX_FILES`, :data:`MAX_BYTES`), the most
    recently used one always kept. Recency is the modification time (set on every read and write;
    ties: by name). Files that vanish or cannot be deleted meanwhile (another run) are passed over.

    Returns:
        the deleted files, least recently used last.
    """
    max_files = MAX_FILES if max_files is None else max_files
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    found = []
    try:
        for f in folder.glob("*.npz"):
            try:
                st = f.stat()
            except OSError:  # deleted by another run meanwhile
                continue
            found.append((st.st_mtime_ns, f.name, st.st_size, f))
    except OSError:
        return []
    found.sort(reverse=True)  # most recently used first
    deleted, total = [], 0
    for i, (_, _, size, f) in enumerate(found):
        total += size
        if i == 0 or (i < max_files and total <= max_bytes):
            continue
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError:  # cannot be deleted (a read-only folder): it stays
            continue
        deleted.append(f)
    return deleted
