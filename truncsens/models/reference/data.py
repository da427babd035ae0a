"""Training sequences of the reference model: natural text of the builtin corpora's training split
plus a share of synthetic sequences that reward retrieval from far back.

Every batch is a pure function of ``(seed, step)`` (:func:`batch_at`), so a run stopped at any step
and resumed from its checkpoint draws exactly the batches an uninterrupted run draws.

Four kinds of sequence of L + 1 tokens (shares in :class:`DataMix`):

- ``natural``: a crop of the token stream of the training documents (documents joined by the
  end-of-text token); crops start at a document's first token when the document is long enough
  (so long-range context belongs to the same document), else anywhere in the stream.
- ``repeat``: a natural crop in which a few spans of 8–48 tokens are copied forward over the text at
  distances drawn log-uniformly between 64 and L tokens. A model predicts the copied tokens only by
  finding the earlier occurrence: the pattern an induction head completes (Olsson et al. 2022,
  "In-context learning and induction heads", arXiv 2209.11895), which forms earlier in small models
  when such repeats are frequent.
- ``induction``: a natural crop in which spans are copied forward as in ``repeat``, but each source
  span is first overwritten by tokens drawn independently from the training stream (its token
  frequencies, no other structure). A drawn span cannot be guessed from its words, so its copy can
  be predicted only by finding the earlier occurrence of the tokens before it: the repeated random
  tokens on which Olsson et al. 2022 (above) first see induction heads. The text around the spans
  stays natural, so the model need not hedge between natural and random text at the start of a
  sequence. Share 0 by default (a mix without it draws every batch as before it).
- ``kv``: key–value recall text: ``name = "value"`` definitions at the top, training code as filler,
  then ``assert name == "value"`` queries for a random subset of the keys, scattered through the
  rest of the sequence. Names join two identifiers of the training code (``parse_buffer``); they
  never have the form ``key_<digits>`` of the held-out key–value documents of
  ``truncsens certify-attribution`` (:mod:`truncsens.certificates.tasks`), and the filler comes only
  from the training split, so no evaluation document occurs in training (tests/test_reference_data.py).
  With ``DataMix(dense_kv=True)`` (the recall stage, :func:`kv_dense_text`) every key is queried,
  after a long first gap, one query after another: many recall targets per sequence, all far from
  their definitions.
"""

from __future__ import annotations

import hashlib
import math
import re
import string
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

IDENT = re.compile(r"\b[a-z][a-z]{2,9}\b")
EVAL_KEY = re.compile(r"\bkey_\d+\b")  # the held-out key-value documents' key names
DENSE_NAME_WORDS = 200  # name parts of the dense recall format: the most frequent words
KV_HEADERS = (
    "# settings read by the worker at start-up\n",
    "# values checked by the test below\n",
    '"""Constants of the module."""\n',
    "# generated table of names\n",
)


@dataclass(frozen=True)
class DataMix:
    """Shares of the three sequence kinds in every batch (each sequence drawn independently)."""

    repeat: float = 0.2
    kv: float = 0.2
    dense_kv: bool = False  # kv sequences in the dense recall format (kv_dense_text) instead of kv_text
    name_words: int = DENSE_NAME_WORDS  # name parts of the dense format: the first name_words words
    repeat_spans: int = 4  # spans copied forward in each repeat sequence (add_repeats)
    repeat_min_distance: int = 64  # tokens: the shortest copy distance (log-uniform up to the crop length)
    induction: float = 0.0  # share of induction sequences (repeats of frequency-drawn spans; same spans and distances)

    def __post_init__(self) -> None:
        if not (0 <= self.repeat and 0 <= self.kv and 0 <= self.induction and self.repeat + self.kv + self.induction <= 1):
            raise ValueError(f"shares must be >= 0 and sum to at most 1, got repeat={self.repeat}, kv={self.kv}, "
                             f"induction={self.induction}")
        if self.name_words < 2:
            raise ValueError(f"the dense recall format needs at least 2 name words, got name_words={self.name_words}")
        if self.repeat_spans < 1 or self.repeat_min_distance < 1:
            raise ValueError(f"repeats need at least 1 span and a distance of at least 1 token, got "
                             f"repeat_spans={self.repeat_spans}, repeat_min_distance={self.repeat_min_distance}")


def step_generator(seed: int, step: int, salt: str = "batch") -> np.random.Generator:
    """The generator of one step: seeded by a hash of (seed, salt, step), independent of every other step."""
    digest = hashlib.sha256(f"{seed}:{salt}:{step}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def name_vocabulary(texts: Sequence[str], size: int = 2000) -> list[str]:
    """The ``size`` most frequent lower-case words (3–10 letters) of ``texts``, sorted by count then
    alphabetically (deterministic): the parts of the synthetic key names."""
    counts: dict[str, int] = {}
    for text in texts:
        for word in IDENT.findall(text):
            counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    return [w for w in ranked if w != "key"][:size]


def kv_text(rng: np.random.Generator, words: Sequence[str], filler: Callable[[int], str],
            encode: Callable[[str], list[int]], length: int) -> list[int]:
    """One key–value recall sequence of exactly ``length`` token ids (module docstring).

    Args:
        rng: the sequence's generator; words: :func:`name_vocabulary`; filler: n -> about n tokens of
            training code text; encode: text -> ids; length: L + 1.
    """
    n_keys = int(rng.integers(4, 13))
    names = kv_names(rng, words, n_keys)
    values = kv_values(rng, n_keys)
    text = str(rng.choice(KV_HEADERS)) + "".join(f'{n} = "{v}"\n' for n, v in zip(names, values))
    first_gap = int(length * rng.uniform(0.1, 0.8))  # tokens of filler before the first query
    text += filler(first_gap)
    order = rng.permutation(n_keys)[: int(rng.integers(2, n_keys + 1))]
    room = max(1, (length - first_gap) // (len(order) + 1))
    for i in order:
        text += f'assert {names[i]} == "{values[i]}"\n' + filler(int(rng.integers(1, room + 1)))
    ids = encode(text)
    while len(ids) < length:  # the filler fell short: pad with more training code
        ids += encode(filler(length - len(ids) + 16))
    return ids[:length]


def kv_names(rng: np.random.Generator, words: Sequence[str], n_keys: int) -> list[str]:
    """``n_keys`` distinct key names: two words (``parse_buffer``, probability 0.7) or a word and a
    number (``buffer_17``); never of the held-out form ``key_<digits>``."""
    names: list[str] = []
    while len(names) < n_keys:
        a, b = (str(w) for w in rng.choice(words, size=2))
        name = f"{a}_{b}" if rng.random() < 0.7 else f"{a}_{int(rng.integers(0, 100))}"
        if name not in names and not EVAL_KEY.fullmatch(name):
            names.append(name)
    return names


def kv_values(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` values: a lower-case letter then 2–5 letters or digits."""
    alphabet = string.ascii_lowercase + string.digits
    return ["".join([str(rng.choice(list(string.ascii_lowercase)))]
                    + [str(c) for c in rng.choice(list(alphabet), size=int(rng.integers(2, 6)))]) for _ in range(n)]


def kv_dense_text(rng: np.random.Generator, words: Sequence[str], filler: Callable[[int], str],
                  encode: Callable[[str], list[int]], length: int, name_words: int = DENSE_NAME_WORDS) -> list[int]:
    """One dense key–value recall sequence of exactly ``length`` token ids (the recall stage).

    8–16 ``name = "value"`` definitions at the top (names from the first ``name_words`` words of
    ``words``, :data:`DENSE_NAME_WORDS` by default, so the same name parts recur and matching them
    is learnt quickly),
    training code for a first gap of 10–75 % of ``length`` tokens, then one
    ``assert name == "value"`` query of every key in a random order, each followed by training code
    of up to an equal share of the room left (so the queries spread over the rest; training code
    pads the end). Every key is queried once, so only its definition
    holds the value, at least the first gap back: each sequence holds 8–16 long-range recall
    targets where :func:`kv_text` holds a few.

    Args:
        rng: the sequence's generator; words: :func:`name_vocabulary`; filler: n -> about n tokens of
            training code text; encode: text -> ids; length: L + 1; name_words: see above (at
            least 2).
    """
    n_keys = int(rng.integers(8, 17))
    names, values = kv_names(rng, words[:name_words], n_keys), kv_values(rng, n_keys)
    text = str(rng.choice(KV_HEADERS)) + "".join(f'{n} = "{v}"\n' for n, v in zip(names, values))
    text += filler(int(length * rng.uniform(0.1, 0.75)))
    ids = encode(text)
    queries = [encode(f'assert {n} == "{v}"\n') for n, v in zip(names, values)]
    room = max(1, (length - len(ids) - sum(map(len, queries))) // n_keys)  # tokens of code after a query, at most
    for i in rng.permutation(n_keys):
        ids += queries[i] + encode(filler(int(rng.integers(1, room + 1))))
    while len(ids) < length:  # pad with more training code
        ids += encode(filler(length - len(ids) + 16))
    return ids[:length]


def add_repeats(ids: np.ndarray, rng: np.random.Generator, n_spans: int = 4, min_span: int = 8,
                max_span: int = 48, min_distance: int = 64,
                draw: Callable[[np.random.Generator, int], np.ndarray] | None = None) -> np.ndarray:
    """Copy ``n_spans`` spans of ``ids`` [L + 1] forward by log-uniform distances in [min_distance, L];
    returns a new array (the input is not changed). A crop too short for a span at ``min_distance``
    gets no more spans. With ``draw`` ((rng, m) -> m token ids), each source span is first
    overwritten by ``draw(rng, m)``, then copied (the ``induction`` kind); without it the draws of
    ``rng`` are those of the kinds before it."""
    out = ids.copy()
    L = out.size
    for _ in range(n_spans):
        m = int(rng.integers(min_span, max_span + 1))
        hi = L - m - 1
        if hi <= min_distance:
            break
        d = int(math.exp(rng.uniform(math.log(min_distance), math.log(hi))))
        s = int(rng.integers(0, L - d - m))
        if draw is not None:
            out[s : s + m] = draw(rng, m)
        out[s + d : s + d + m] = out[s : s + m]
    return out


class TrainingData:
    """The training stream and the draws of every step.

    Args:
        docs: training token ids per document (lists of ints); eos: the end-of-text id.
        texts: the training documents' texts (for key-value filler and names).
        encode: text -> ids (the trained tokenizer, no special tokens).
        mix: :class:`DataMix`; seed: the run's seed.
    """

    def __init__(self, docs: Sequence[Sequence[int]], texts: Sequence[str], eos: int,
                 encode: Callable[[str], list[int]], mix: DataMix, seed: int):
        pieces, starts = [], []
        at = 0
        for ids in docs:
            starts.append(at)
            pieces.append(np.asarray(list(ids) + [eos], dtype=np.int64))
            at += len(ids) + 1
        self.stream = np.concatenate(pieces)  # [T] all training tokens
        self.doc_starts = np.asarray(starts, dtype=np.int64)
        self.doc_lengths = np.asarray([len(ids) for ids in docs], dtype=np.int64)
        self.code_texts = [t for t in texts if t]
        self.words = name_vocabulary(self.code_texts)
        self.encode, self.mix, self.seed = encode, mix, seed

    def natural(self, rng: np.random.Generator, length: int) -> np.ndarray:
        """A crop of ``length`` tokens: from a long-enough document's start or offset inside it when
        there is one (probability 1/2), else anywhere in the stream."""
        long_docs = np.flatnonzero(self.doc_lengths >= length)
        if long_docs.size and rng.random() < 0.5:
            d = int(rng.choice(long_docs))
            start = int(self.doc_starts[d]) + int(rng.integers(0, self.doc_lengths[d] - length + 1))
        else:
            start = int(rng.integers(0, self.stream.size - length))
        return self.stream[start : start + length]

    def unigram(self, rng: np.random.Generator, length: int) -> np.ndarray:
        """[length] tokens drawn independently from the training stream (with replacement): the
        stream's token frequencies and nothing else."""
        return self.stream[rng.integers(0, self.stream.size, size=length)]

    def filler(self, rng: np.random.Generator) -> Callable[[int], str]:
        """n -> about n tokens (4 characters each) of a random training document's text."""
        def take(n: int) -> str:
            text = self.code_texts[int(rng.integers(len(self.code_texts)))]
            chars = 4 * max(n, 1)
            start = int(rng.integers(0, max(1, len(text) - chars)))
            piece = text[start : start + chars]
            return piece if piece.endswith("\n") else piece + "\n"
        return take

    def sequence(self, rng: np.random.Generator, length: int, mix: DataMix | None = None) -> tuple[np.ndarray, str]:
        """One sequence of ``length`` tokens and its kind ("natural", "repeat", "induction" or "kv"),
        drawn with ``mix`` (default: the data's own). One uniform draw picks the kind by the shares in
        the order kv, repeat, induction, natural (so a mix without induction draws as before it)."""
        mix = mix or self.mix
        u = rng.random()
        if u < mix.kv:
            args = (rng, self.words, self.filler(rng), self.encode, length)
            ids = kv_dense_text(*args, name_words=mix.name_words) if mix.dense_kv else kv_text(*args)
            return np.asarray(ids, np.int64), "kv"
        if u < mix.kv + mix.repeat:
            return add_repeats(self.natural(rng, length), rng, n_spans=mix.repeat_spans,
                               min_distance=mix.repeat_min_distance), "repeat"
        if u < mix.kv + mix.repeat + mix.induction:
            return add_repeats(self.natural(rng, length), rng, n_spans=mix.repeat_spans,
                               min_distance=mix.repeat_min_distance, draw=self.unigram), "induction"
        return self.natural(rng, length).copy(), "natural"

    def batch_at(self, step: int, batch_size: int, length: int, mix: DataMix | None = None) -> torch.Tensor:
        """[batch_size, length] token ids of step ``step``: a pure function of (seed, step, mix)."""
        rng = step_generator(self.seed, step)
        rows = [self.sequence(rng, length, mix)[0] for _ in range(batch_size)]
        return torch.from_numpy(np.stack(rows))  # [B, length]
