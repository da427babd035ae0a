"""The documents of a run: read the corpus (or sample a synthetic source's own), tokenize, keep
those long enough for a reference context of N tokens."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from truncsens.corpora import load_corpus
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.models import LoadedModel
from truncsens.targets import TokenDoc


@dataclass
class RunDocuments:
    """Documents of a run: all that were checked, and those used (long enough, capped by max_docs)."""

    checked: list[TokenDoc]
    used: list[TokenDoc]
    n_short: int
    corpus: str
    domain: str
    sha256: str
    skipped: dict[str, int]


def tokenize_documents(docs, tokenizer) -> list[TokenDoc]:
    """Token ids of each document (no special tokens added): list of :class:`TokenDoc`."""
    out = []
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        out.append(TokenDoc(d.id, torch.tensor(ids, dtype=torch.long)))
    return out


def token_docs_sha256(docs: list[TokenDoc]) -> str:
    """SHA-256 over every document's id and int64 token ids, in order."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.id.encode())
        h.update(d.ids.numpy().astype(np.int64).tobytes())
    return h.hexdigest()


def load_documents(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int):
    """Token documents and provenance (corpus name, domain, sha256, files skipped by reason) for a run.

    ``--corpus synthetic`` (the default with a ``synthetic:...`` model) samples ``max_docs`` (64)
    sequences of 2N tokens from the synthetic process of the model spec.

    Raises:
        MeasureError: ``--corpus synthetic`` with a model that is not synthetic, or a text corpus
            with a model that has no tokenizer.
        truncsens.corpora.CorpusError: the corpus cannot be read.
    """
    if cfg.corpus == "synthetic" or (cfg.corpus is None and cfg.model.startswith("synthetic")):
        from truncsens.synthetic import synthetic_documents

        if not cfg.model.startswith("synthetic"):
            raise MeasureError(f"--corpus synthetic is sampled from a synthetic source: it needs --model synthetic:ALPHA "
                               f"(or synthetic-geometric:RATE), not {cfg.model!r}")
        docs = synthetic_documents(cfg.model, n_docs=cfg.max_docs or 64, length=2 * reference_context, seed=cfg.seed)
        token_docs = [TokenDoc(doc_id, ids) for doc_id, ids in docs]
        return token_docs, "synthetic", "synthetic", token_docs_sha256(token_docs), {}
    if loaded.tokenizer is None:
        raise MeasureError(f"model {loaded.name!r} has no tokenizer: it only reads --corpus synthetic")
    corpus = load_corpus(cfg.corpus, cfg.domain, cfg.split, cfg.text_field)
    return (tokenize_documents(corpus.documents, loaded.tokenizer), corpus.name, corpus.domain, corpus.sha256,
            dict(corpus.skipped))


def prepare_documents(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int) -> RunDocuments:
    """Tokenized documents long enough for ``N + 1`` tokens, capped at ``cfg.max_docs``.

    Raises:
        MeasureError: no document is long enough (says how many were checked and the longest).
    """
    N = reference_context
    token_docs, corpus_name, domain, corpus_sha, skipped = load_documents(cfg, loaded, N)
    long_enough = [d for d in token_docs if d.ids.numel() >= N + 1]
    if not long_enough:
        longest = max((d.ids.numel() for d in token_docs), default=0)
        raise MeasureError(
            f"no document is long enough: checked {len(token_docs)} documents, the longest has {longest} tokens, "
            f"and a target needs {N + 1}; lower --reference-context or use a corpus with longer documents")
    used = long_enough[: cfg.max_docs] if cfg.max_docs else long_enough
    return RunDocuments(token_docs, used, len(token_docs) - len(long_enough), corpus_name, domain, corpus_sha, skipped)
