"""The documents of a run: read the corpus (or sample a model source's own), tokenize, keep those
long enough for a reference context of N tokens.

Documents: a document is encoded as the model's tokenizer encodes a text with its default special
tokens at the start only. If the tokenizer adds a BOS token by default (Llama, Gemma, ...: the model
expects one), each document's token stream begins with exactly one BOS (also under ``--bos always``,
with the tokenizer's BOS; none under ``--bos never``); otherwise with none. No other special token is
ever inserted, and text that spells a special token literally (``<|endoftext|>`` in a source file)
is encoded as ordinary text, so a BOS never appears inside a document. Whether every context then
begins with the BOS too is the ``--bos`` rule (:mod:`truncsens.engine.bos`). Recorded per target
(``bos_first``) and in the attrs ``tokenizer_adds``, ``bos_rule`` (and ``bos``, ``bos_prepended``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from truncsens.corpora import Corpus, load_corpus
from truncsens.corpora.resolve import check_corpus
from truncsens.corpora.document import id_bytes
from truncsens.engine.bos import default_special_tokens, resolve_bos
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.token_cache import cached_token_docs
from truncsens.models import LoadedModel, model_source
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
    bos_id: int | None = None
    tokenizer_adds: str = "none"


def tokenize_documents(docs, tokenizer, bos_id: int | None = None) -> list[TokenDoc]:
    """Token ids of each document under the BOS rule of this module: list of :class:`TokenDoc`.

    Args:
        docs: documents with ``id`` and ``text``.
        tokenizer: a Hugging Face tokenizer.
        bos_id: the BOS id to put in front of every document (None: none).
    """
    out = []
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if bos_id is not None:
            ids = [bos_id, *ids]
        out.append(TokenDoc(d.id, torch.tensor(ids, dtype=torch.long)))
    return out


def check_vocabulary(docs: list[TokenDoc], model, model_name: str) -> None:
    """The largest token id must index the model's input embedding (checked before the first forward).

    Raises:
        MeasureError: an id at or beyond the embedding's rows, naming both sizes.
    """
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    rows = getattr(embeddings, "num_embeddings", None)
    largest = max((int(d.ids.max()) for d in docs if d.ids.numel()), default=-1)
    if rows is not None and largest >= rows:
        raise MeasureError(
            f"the tokenizer produces token id {largest} but the input embedding of model {model_name!r} has {rows} "
            f"rows (ids 0..{rows - 1}): tokenizer and model do not match; use the model's own tokenizer")


def token_docs_sha256(docs: list[TokenDoc]) -> str:
    """SHA-256 over every document's id and int64 token ids, in order."""
    h = hashlib.sha256()
    for d in docs:
        h.update(id_bytes(d.id))
        h.update(d.ids.numpy().astype(np.int64).tobytes())
    return h.hexdigest()


def check_documents_before_loading(cfg: MeasureConfig) -> None:
    """What :func:`load_documents` refuses by the options alone, said before a model loads (a real model
    takes minutes): ``--corpus synthetic`` with a model that samples none, an unknown ``--domain``, a
    corpus path that does not exist or a manifest that cannot be read
    (:func:`truncsens.corpora.resolve.check_corpus`). A corpus in memory is not looked at.

    Raises:
        MeasureError, truncsens.corpora.CorpusError: as :func:`load_documents` would, later.
    """
    if isinstance(cfg.corpus, Corpus):
        return
    source = model_source(cfg.model)
    if cfg.corpus == "synthetic" or (cfg.corpus is None and source.has_own_corpus):
        if not source.has_own_corpus:
            raise MeasureError(f"corpus='synthetic' (--corpus synthetic) is sampled from a synthetic source: it needs "
                               f"model='synthetic:ALPHA' (--model synthetic:ALPHA) (or synthetic-geometric:RATE), not {cfg.model!r}")
        return
    check_corpus(cfg.corpus, cfg.domain)


def load_documents(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int,
                   on_stage: Callable[[str], None] | None = None):
    """Token documents and provenance (corpus name, domain, sha256, files skipped by reason) for a run;
    ``on_stage`` is told what is done before it takes long (tokenizing N documents; progress). The
    token ids of a corpus tokenized before by the same tokenizer are read from the cache instead
    (:mod:`truncsens.engine.token_cache`): the same ids, the same documents checked.

    ``--corpus synthetic`` (the default with a ``synthetic:...`` model) samples ``max_docs`` (64)
    sequences of 2N tokens from the synthetic process of the model spec.

    Raises:
        MeasureError: ``--corpus synthetic`` with a model that is not synthetic, or a text corpus
            with a model that has no tokenizer.
        truncsens.corpora.CorpusError: the corpus cannot be read.
    """
    source = model_source(cfg.model)
    if cfg.corpus == "synthetic" or (cfg.corpus is None and source.has_own_corpus):
        if not source.has_own_corpus:
            raise MeasureError(f"corpus='synthetic' (--corpus synthetic) is sampled from a synthetic source: it needs "
                               f"model='synthetic:ALPHA' (--model synthetic:ALPHA) (or synthetic-geometric:RATE), not {cfg.model!r}")
        if on_stage is not None:
            on_stage(f"sampling {cfg.max_docs or 64} sequences of {2 * reference_context} tokens from {cfg.model}")
        token_docs = source.documents(cfg.model, cfg.max_docs or 64, 2 * reference_context, cfg.seed)
        return token_docs, "synthetic", "synthetic", token_docs_sha256(token_docs), {}, None, "none"
    if loaded.tokenizer is None:
        raise MeasureError(f"model {loaded.name!r} has no tokenizer: it only reads --corpus synthetic")
    corpus = load_corpus(cfg.corpus, cfg.domain, cfg.split, cfg.text_field)
    if on_stage is not None:
        on_stage(f"tokenizing {len(corpus.documents)} documents of corpus {corpus.name}")
    adds = default_special_tokens(loaded.tokenizer)[0]
    bos_id = resolve_bos(cfg.bos, loaded.tokenizer, loaded.name).document_bos
    token_docs, _ = cached_token_docs(corpus.documents, corpus.sha256, loaded.tokenizer, bos_id, tokenize_documents)
    return token_docs, corpus.name, corpus.domain, corpus.sha256, dict(corpus.skipped), bos_id, adds


def prepare_documents(cfg: MeasureConfig, loaded: LoadedModel, reference_context: int,
                      on_stage: Callable[[str], None] | None = None) -> RunDocuments:
    """Tokenized documents long enough for ``N + 1`` tokens, capped at ``cfg.max_docs``
    (``on_stage``: progress, as :func:`load_documents`).

    Raises:
        MeasureError: no document is long enough (says how many were checked and the longest), or a
            token id the model's embedding cannot take.
    """
    N = reference_context
    token_docs, corpus_name, domain, corpus_sha, skipped, bos_id, adds = load_documents(cfg, loaded, N, on_stage)
    check_vocabulary(token_docs, loaded.model, loaded.name)
    long_enough = [d for d in token_docs if d.ids.numel() >= N + 1]
    if not long_enough:
        longest = max((d.ids.numel() for d in token_docs), default=0)
        raise MeasureError(
            f"no document is long enough: checked {len(token_docs)} documents, the longest has {longest} tokens, "
            f"and a target needs {N + 1}; lower reference_context (--reference-context) or use a corpus with longer documents")
    used = long_enough[: cfg.max_docs] if cfg.max_docs else long_enough
    return RunDocuments(token_docs, used, len(token_docs) - len(long_enough), corpus_name, domain, corpus_sha, skipped,
                        bos_id, adds)
