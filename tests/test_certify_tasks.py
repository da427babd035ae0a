"""The key-value documents of truncsens.certificates.tasks: the linear filler (fill_to_length) makes the
same documents as the old algorithm (one whole-text encoding per filler line, kept here as the naive
reference) for the bundled reference tokenizer, a small byte-level BPE, and character tokenizers
whose line pieces do not add up (both ways)."""

from __future__ import annotations

import string

import numpy as np
import pytest
from conftest import build_tokenizer, requires_reference

from truncsens.certificates.tasks import FILLER, HEADER, TaskError, fill_to_length, kv_document, kv_tasks
from truncsens.targets import doc_seed


def naive_kv_document(encode, reference_context, min_distance, seed, n_keys=6, query_template='assert {key} == "',
                      max_tries=20):
    """kv_document as it was: re-encode the growing text after every filler line (quadratic)."""
    N = reference_context
    for attempt in range(max_tries):
        rng = np.random.default_rng([seed, attempt])
        keys = [f"key_{k}" for k in rng.choice(np.arange(10, 100), size=n_keys, replace=False)]
        alphabet = string.ascii_lowercase + string.digits
        values = ["".join([rng.choice(list(string.ascii_lowercase))] + list(rng.choice(list(alphabet), size=3)))
                  for _ in keys]
        j = int(rng.integers(n_keys))
        before_def = HEADER + "".join(f'{k} = "{v}"\n' for k, v in zip(keys[:j], values[:j])) + f'{keys[j]} = "'
        text = HEADER + "".join(f'{k} = "{v}"\n' for k, v in zip(keys, values))
        query = query_template.format(key=keys[j])
        prefix_ids = encode(text + query)
        while len(prefix_ids) < N:
            a, b, c = (int(x) for x in rng.integers(1, 100, size=3))
            text += str(rng.choice(FILLER)).format(a=a, b=b, c=c)
            prefix_ids = encode(text + query)
        full = encode(text + query + values[j] + '"\n')
        t = len(prefix_ids)
        source = len(encode(before_def))
        if full[:t] != prefix_ids or len(full) <= t or source >= len(full) or full[source] != full[t]:
            continue
        if not (t - N <= source and t - source >= min_distance):
            continue
        return full[t - N : t + 1], source - (t - N)
    raise TaskError("no key-value document")


def chars(text):
    return [ord(c) for c in text]


def merging(text):
    """Over-counting pieces: a newline before "i" (items_, if) is one token with it in the whole text."""
    return chars(text.replace("\ni", "\x01"))


def splitting(text):
    """Under-counting pieces: a newline before "r" or "w" (result_, while) costs one more token in the whole text."""
    return chars(text.replace("\nr", "\n\x02r").replace("\nw", "\n\x02w"))


@pytest.mark.parametrize("encode", [chars, merging, splitting], ids=["chars", "merging", "splitting"])
@pytest.mark.parametrize("N,D", [(300, 40), (512, 128), (1024, 256)])
def test_same_documents_as_the_naive_algorithm_on_character_tokenizers(encode, N, D):
    for seed in range(6):
        assert kv_document(encode, N, D, seed) == naive_kv_document(encode, N, D, seed)


def test_same_documents_on_a_small_byte_level_bpe():
    tok = build_tokenizer()
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for N, D in ((128, 32), (256, 64), (700, 175)):
        for seed in range(4):
            assert kv_document(encode, N, D, seed) == naive_kv_document(encode, N, D, seed)


@requires_reference
def test_same_documents_with_the_reference_tokenizer():
    from truncsens.models import load_model

    tok = load_model("reference").tokenizer
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for N, D in ((128, 32), (512, 128), (1024, 256)):  # 512, N/4: the defaults of certify-attribution
        for seed in range(5):
            assert kv_document(encode, N, D, seed) == naive_kv_document(encode, N, D, seed)
    # the 8 documents of a default run (seed 0, N = 512, D = 128), as kv_tasks draws their seeds
    doc, position, ids, source = kv_tasks(encode, 512, 128, 8, 0)
    for i in range(8):
        want_ids, want_source = naive_kv_document(encode, 512, 128, doc_seed(0, f"kv:{i}"))
        assert (doc[i], position[i], ids[i].tolist(), source[i]) == (f"kv-0-{i}", 512, want_ids, want_source)


def test_fill_to_length_fewest_lines_by_hand():
    lines = iter(["ab\n", "cde\n", "f\n", "gh\n"])
    # characters: "xy" + "q" = 3; + "ab\n" = 6; + "cde\n" = 10 >= 8: two lines
    assert fill_to_length(chars, "xy", "q", 8, lambda: next(lines)) == ("xyab\ncde\n", chars("xyab\ncde\nq"))
    assert fill_to_length(chars, "xy", "q", 3, lambda: "never\n") == ("xy", chars("xyq"))  # no line needed
    # every newline before "c" costs 5 more tokens in the whole text: the pieces say three lines
    # (4 + 3 + 4 + 2 = 13 >= 12), the whole text reaches 12 with two (3 + 3 + 5 + 4 + 1 = 16; one line: 7)
    costly = lambda s: chars(s.replace("\nc", "\n" + "\x02" * 5 + "c"))  # noqa: E731
    lines = iter(["ab\n", "cde\n", "f\n"])
    text, ids = fill_to_length(costly, "xy\n", "q", 12, lambda: next(lines))
    assert text == "xy\nab\ncde\n" and ids == costly("xy\nab\ncde\nq") and len(ids) == 16


def naive_fill(encode, text, query, length, next_line):
    """One line at a time, the whole text re-encoded after each."""
    ids = encode(text + query)
    while len(ids) < length:
        text += next_line()
        ids = encode(text + query)
    return text, ids


@pytest.mark.parametrize("seed", range(8))
def test_fill_to_length_equals_naive_fill_on_random_boundary_costs(seed):
    rng = np.random.default_rng(seed)
    first = "abcdefgh"
    extra = {c: int(rng.integers(-1, 40)) for c in first}  # tokens a newline before c adds (-1: merged with it)

    def encode(s):
        for c, k in extra.items():
            s = s.replace("\n" + c, ("\x01" if k < 0 else "\n" + "\x02" * k) + c)
        return chars(s)

    pool = [str(rng.choice(list(first))) + "x" * int(rng.integers(0, 12)) + "\n" for _ in range(400)]
    for length in (5, 50, 400, 2000, *rng.integers(1, 2500, size=20)):
        mine, ref = iter(pool), iter(pool)
        assert fill_to_length(encode, "head\n", "q", length, lambda: next(mine)) == \
            naive_fill(encode, "head\n", "q", length, lambda: next(ref))


def test_fill_to_length_encodes_the_whole_text_three_times_when_pieces_add_up():
    whole = []

    def encode(s):
        if s.startswith("head"):
            whole.append(len(s))
        return chars(s)

    lines = iter(["abcdefghi\n"] * 1000)
    text, ids = fill_to_length(encode, "head\n", "q", 5000, lambda: next(lines))
    assert len(ids) == 5 + 10 * 500 + 1 and text == "head\n" + "abcdefghi\n" * 500  # 499 lines give 4996
    assert len(whole) == 3  # no lines, 500 lines, 499 lines (the naive way: 501)
