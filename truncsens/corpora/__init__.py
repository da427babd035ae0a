"""Corpora: documents of text from builtin sources, local files, manifests, HF datasets and Python strings.

May import: the math modules only; no model, engine or results module.
"""

from truncsens.corpora.document import Document, corpus_sha256, select_split, split_of
from truncsens.corpora.local import CorpusError
from truncsens.corpora.resolve import Corpus, corpus_help, load_corpus, texts_corpus

__all__ = ["Corpus", "CorpusError", "Document", "corpus_help", "corpus_sha256", "load_corpus", "select_split", "split_of",
           "texts_corpus"]
