"""The reference model's training data: batches are a pure function of (seed, step); the
synthetic retrieval sequences do what they claim; no evaluation document occurs in training."""

from __future__ import annotations

import re

import numpy as np
import pytest

from truncsens.certificates.tasks import kv_document
from truncsens.corpora.builtin import code_documents, nl_documents
from truncsens.corpora.document import select_split
from truncsens.models.reference.data import (
    EVAL_KEY, DataMix, TrainingData, add_repeats, kv_dense_text, kv_text, name_vocabulary, step_generator,
)
from truncsens.targets import doc_seed

GOLDEN_BATCH = "b1a42d0755d34f36"  # sha256[:16] of small_data().batch_at(5, 4, 257) before the induction kind


def char_encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per byte."""
    return list(text.encode("utf-8", "surrogatepass"))


def small_data(mix=DataMix(0.3, 0.3), seed=0) -> TrainingData:
    texts = ["def parse_buffer(data):\n    return data.strip()\n" * 40, "class TokenReader:\n    pass\n" * 30]
    return TrainingData([char_encode(t) for t in texts], texts, 0, char_encode, mix, seed)


def test_batches_depend_on_seed_and_step_only():
    data = small_data()
    a, b = data.batch_at(7, 3, 65), small_data().batch_at(7, 3, 65)
    assert a.shape == (3, 65) and bool((a == b).all())
    data.batch_at(3, 3, 65)  # other draws in between change nothing
    assert bool((data.batch_at(7, 3, 65) == a).all())
    assert not bool((data.batch_at(8, 3, 65) == a).all())
    assert not bool((small_data(seed=1).batch_at(7, 3, 65) == a).all())


def test_repeats_copy_spans_forward_at_a_distance():
    ids = np.arange(1000, dtype=np.int64)  # every token distinct: copies are visible
    out = add_repeats(ids, np.random.default_rng(0), n_spans=1, min_span=10, max_span=10, min_distance=64)
    changed = np.flatnonzero(out != ids)
    assert changed.size == 10 and np.all(np.diff(changed) == 1)  # one span of 10 tokens overwritten
    d = int(out[changed[0]] - ids[changed[0]])  # a copy of the tokens d positions back
    assert d <= -64 and np.array_equal(out[changed], ids[changed + d])
    assert np.array_equal(ids, np.arange(1000))  # the input is left alone


def test_a_mix_with_dense_far_repeats_draws_them():
    """DataMix(repeat_spans, repeat_min_distance) reaches add_repeats: with stream positions as tokens
    (every token distinct), each copied token's source lies at least that far back."""
    text = bytes(range(32, 127)).decode() * 60  # 5,700 distinct-enough bytes, one document
    data = TrainingData([list(range(len(text)))], [text], -1, char_encode, DataMix(1.0, 0.0, repeat_spans=12,
                                                                                    repeat_min_distance=300), 0)
    ids, kind = data.sequence(np.random.default_rng(1), 1025)
    assert kind == "repeat"
    shift = ids - np.arange(ids.size)  # 0 where untouched (a crop of consecutive positions), -d where copied
    base = int(np.bincount(shift - shift.min()).argmax() + shift.min())  # the crop's own offset
    copied = np.flatnonzero(shift != base)
    assert copied.size >= 12 * 8 // 2  # many spans (each 8-48 tokens; later ones may overwrite earlier)
    assert np.all(base - shift[copied] >= 300)  # every copy from 300 tokens back or more
    with pytest.raises(ValueError, match="repeats need at least 1 span"):
        DataMix(0.5, 0.0, repeat_spans=0)


def test_induction_sequences_copy_drawn_spans_into_natural_text():
    """An induction sequence is a natural crop whose repeats copy spans first overwritten by tokens drawn
    from the stream's frequencies. With stream positions as tokens (every token distinct) the crop is
    a run of consecutive positions, a drawn token mostly lies outside that run, and a copied pair (two
    tokens also side by side 300 or more tokens earlier) is a copy."""
    text = bytes(range(32, 127)).decode() * 60
    data = TrainingData([list(range(len(text)))], [text], -1, char_encode,
                        DataMix(0.0, 0.0, repeat_spans=12, repeat_min_distance=300, induction=1.0), 0)
    ids, kind = data.sequence(np.random.default_rng(1), 1025)
    assert kind == "induction" and ids.shape == (1025,)
    shift = ids - np.arange(ids.size)
    base = int(np.bincount(shift - shift.min()).argmax() + shift.min())  # the crop's own offset
    assert np.mean(shift == base) > 0.5  # mostly natural text (the crop)
    outside = (ids < base) | (ids >= base + ids.size)  # drawn tokens (a plain repeat copies only crop tokens)
    assert outside.sum() >= 12 * 8  # source and copy of many drawn spans
    first = {}
    for j in range(1, ids.size):
        first.setdefault((int(ids[j - 1]), int(ids[j])), j)
    copied = [j for j in range(1, ids.size) if outside[j] and first[(int(ids[j - 1]), int(ids[j]))] <= j - 300]
    assert len(copied) >= 12 * 7 // 2  # drawn tokens whose pair occurred 300 or more tokens before: copies
    mixed = small_data(DataMix(0.3, 0.3, induction=0.4))
    kinds = [mixed.sequence(np.random.default_rng(s), 65)[1] for s in range(300)]
    assert "natural" not in kinds and 0.3 < kinds.count("induction") / 300 < 0.5
    with pytest.raises(ValueError, match="sum to at most 1, got repeat=0.5, kv=0.3, induction=0.3"):
        DataMix(0.5, 0.3, induction=0.3)


def test_a_mix_without_induction_draws_as_before():
    """Adding the induction kind changed no earlier batch: the digest of a default-mix batch is the one
    it had before the kind existed (computed then, commit ac2619e)."""
    import hashlib

    batch = small_data().batch_at(5, 4, 257)
    assert hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16] == GOLDEN_BATCH


def test_kv_sequences_define_then_query_their_keys():
    rng = np.random.default_rng(3)
    words = ["parse", "buffer", "reader", "token", "value", "state"]
    data = small_data()
    ids = kv_text(rng, words, data.filler(np.random.default_rng(4)), char_encode, 2000)
    text = bytes(ids).decode()
    assert len(ids) == 2000
    defs = dict(re.findall(r'^(\w+) = "(\w+)"$', text, flags=re.M))
    queries = re.findall(r'assert (\w+) == "(\w+)"', text)
    assert len(defs) >= 4 and queries and all(defs[k] == v for k, v in queries)
    assert not any(EVAL_KEY.fullmatch(k) for k in defs)


def test_dense_kv_sequences_query_every_key_once_after_the_first_gap():
    words = ["parse", "buffer", "reader", "token", "value", "state", "field", "block"]
    filler = lambda n: ("pass\n" * (n // 5 + 1))[: max(n, 1) - 1] + "\n"  # noqa: E731  exactly n tokens (bytes)
    for seed in range(5):
        ids = kv_dense_text(np.random.default_rng(seed), words, filler, char_encode, 6000)
        text = bytes(ids).decode()
        assert len(ids) == 6000
        defs = dict(re.findall(r'^(\w+) = "(\w+)"$', text, flags=re.M))
        assert 8 <= len(defs) <= 16 and not any(EVAL_KEY.fullmatch(k) for k in defs)
        queries = re.findall(r'assert (\w+) == "(\w+)"', text)
        names = [k for k, _ in queries]
        assert len(names) == len(set(names)) and set(names) <= set(defs)  # each key once at most
        assert len(names) == len(defs)  # with a filler of the length asked for, every query fits
        assert all(defs[k] == v for k, v in queries)
        end_defs, first_query = text.index(f'{list(defs)[-1]} = "'), text.index("assert ")
        assert first_query - end_defs >= 0.1 * 6000 * 0.9  # the first gap: a tenth of L at least


def test_dense_kv_names_come_from_the_first_name_words():
    """name_words = 3: every name part is one of the first 3 words (or a number); the mix passes it on
    and refuses fewer than 2."""
    words = ["parse", "buffer", "reader", "token", "value", "state", "field", "block"]
    filler = lambda n: ("pass\n" * (n // 5 + 1))[: max(n, 1) - 1] + "\n"  # noqa: E731
    for seed in range(5):
        text = bytes(kv_dense_text(np.random.default_rng(seed), words, filler, char_encode, 3000, name_words=3)).decode()
        for name in re.findall(r'^(\w+) = "\w+"$', text, flags=re.M):
            assert all(part in words[:3] or part.isdigit() for part in name.split("_")), name
    data = small_data(DataMix(0.0, 1.0, dense_kv=True, name_words=2))
    text = bytes(data.sequence(step_generator(0, 0), 3000)[0].tolist()).decode()
    parts = {p for n in re.findall(r'^(\w+) = "\w+"$', text, flags=re.M) for p in n.split("_") if not p.isdigit()}
    assert parts and parts <= set(data.words[:2])
    with pytest.raises(ValueError, match="at least 2 name words"):
        DataMix(0.0, 1.0, dense_kv=True, name_words=1)


def test_the_dense_mix_draws_dense_kv_sequences():
    data = small_data(DataMix(0.0, 1.0, dense_kv=True))
    ids, kind = data.sequence(step_generator(0, 0), 3000)
    text = bytes(ids.tolist()).decode()
    assert kind == "kv" and len(re.findall(r'^\w+ = "\w+"$', text, flags=re.M)) >= 8


def test_mix_shares_are_checked_and_drawn():
    with pytest.raises(ValueError, match="sum to at most 1"):
        DataMix(0.7, 0.5)
    data = small_data(DataMix(0.25, 0.25))
    rng = step_generator(0, 0)
    kinds = [data.sequence(rng, 65)[1] for _ in range(400)]
    assert 0.18 < kinds.count("kv") / 400 < 0.32 and 0.18 < kinds.count("repeat") / 400 < 0.32


def test_no_evaluation_document_occurs_in_the_training_data():
    """Held-out documents are not in the training split (by id and by text); the key names of
    training key-value text never take the held-out documents' form key_<digits>, even from a
    vocabulary that contains "key"; the held-out key-value documents' key lines never occur in
    training key-value text."""
    for docs in (code_documents(), nl_documents()):
        train, held = select_split(docs, "train"), select_split(docs, "heldout")
        assert held and not {d.id for d in train} & {d.id for d in held}
        train_texts = {d.text for d in train}
        assert not [d.id for d in held if d.text in train_texts and len(d.text) > 200]
    words = name_vocabulary(["key key key value " * 5])
    assert "key" not in words
    data = small_data()
    train_kv = "".join(bytes(kv_text(np.random.default_rng(s), ["key", "value"] + words, data.filler(np.random.default_rng(s)),
                                     char_encode, 600)).decode() for s in range(50))
    train_kv += "".join(bytes(kv_dense_text(np.random.default_rng(s), ["key", "value"] + words,
                                            data.filler(np.random.default_rng(s)), char_encode, 900)).decode()
                        for s in range(50))
    assert not EVAL_KEY.search(train_kv)
    for i in range(4):  # the held-out key-value documents of certify-attribution (seed 0)
        ids, _ = kv_document(char_encode, 256, 64, doc_seed(0, f"kv:{i}"))
        held_lines = re.findall(r'^key_\d+ = "\w+"$', bytes(ids).decode(), flags=re.M)
        assert held_lines and not any(line in train_kv for line in held_lines)
