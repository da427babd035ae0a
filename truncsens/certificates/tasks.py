"""The attribution task set of ``truncsens certify-attribution``: long-range copy targets whose
answer lies far back in the reference context, so that eviction can lose it.

Two kinds of target (a document id and a position t; the reference context is ``x[t-N:t]``):

- ``copy``: positions t of a held-out code document whose token ``x[t]`` is an identifier or number
  token (:func:`copy_vocabulary`) that occurred earlier inside the N-token reference context at
  distance at least D and nowhere in the last D − 1 tokens:

      D <= t − s <= N   for the most recent earlier occurrence s of x[t]   (:func:`copy_positions`).

  The copy rule (:data:`COPY_RULES`) adds a condition on the tokens before the target. By default
  (rule ``induction``) the token before the target must also equal the token before that earlier
  occurrence, ``x[t−1] = x[s−1]``: the pattern an induction head completes (Olsson et al., arXiv
  2209.11895), so the full-cache model can find the answer. Rule ``span`` asks for the last
  :data:`SPAN_MATCH` tokens, ``x[t−4:t] = x[s−4:s]``, and for the source to be the nearest earlier
  occurrence of those four tokens: the text is repeating a span from at least D back, and a
  four-token induction head copies the right token (in code the same short context often recurs
  nearer with another continuation, which makes many ``induction`` targets ambiguous;
  ``benchmarks/copy_oracle.py``). Rule ``token`` adds no condition. (This rule was added after a
  first look at full-cache accuracy only: the bundled reference model gets 15 % of the plain
  ``token``-rule targets of its held-out code right and 22 % of the induction-rule ones, at N = 512;
  no attribution statistic had been computed.) The default D = N/4 lies beyond the surely kept
  recent keys of poisson and topk at every budget
  up to 100 % of N (their recent slice is 25 % of the budget), so a window or an eviction can lose
  the answer while the full cache holds it.
- ``kv``: synthetic key–value recall documents (:func:`kv_document`): lines ``key_17 = "ab3x"``
  early, filler code, then ``assert key_17 == "``; the target is the first token of the value, which
  occurs in the definition (at distance at least D). Generated deterministically from a seed and
  tokenized by the model's tokenizer.

Long-range copying as the attribution task follows P. Xie, arXiv 2607.21475 (failures attributed to
eviction); the exact selection rules here are [ours], fixed before any result was looked at.
"""

from __future__ import annotations

import keyword
import re
import string
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from truncsens.targets import TargetSet, TokenDoc, doc_seed

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]+")  # two characters at least
NUMBER = re.compile(r"[0-9]+")


class TaskError(ValueError):
    """The task set cannot be built as asked; the message names the fix."""


@dataclass
class TaskSet:
    """Attribution targets (n of them) with their reference contexts.

    Attributes:
        targets: :class:`~truncsens.targets.TargetSet` (doc, position t, context [n, N], token_id).
        kind: [n] "copy" or "kv".
        source: [n] int64 position (in the document) of the most recent earlier occurrence of the
            target token; the distance ``t − source`` lies in [D, N].
    """

    targets: TargetSet
    kind: list[str]
    source: np.ndarray


SPAN_MATCH = 4  # tokens before the target that rule "span" asks to repeat


@dataclass(frozen=True)
class CopyRule:
    """How much of the text before a copy target must repeat the text before its source.

    Attributes:
        name: the ``--copy-rule`` value.
        match: m, tokens before the target that must equal the m tokens before the source
            (``x[t−m:t] = x[s−m:s]``).
        nearest: the source must also be the nearest earlier occurrence of those m tokens (no nearer
            copy of the same context with another continuation).
        description: one line for ``--help`` and the results' ``copy_rule_definition`` attribute.
    """

    name: str
    match: int
    nearest: bool
    description: str


COPY_RULES = {r.name: r for r in (
    CopyRule("induction", 1, False, "the token before the target also precedes its earlier occurrence"),
    CopyRule("span", SPAN_MATCH, True, f"the {SPAN_MATCH} tokens before the target also precede its earlier "
                                       "occurrence, and nowhere nearer"),
    CopyRule("token", 0, False, "the target token alone"),
)}


def copy_rule(name: str) -> CopyRule:
    """The :class:`CopyRule` called ``name``.

    Raises:
        TaskError: no such rule (the message lists them).
    """
    if name not in COPY_RULES:
        raise TaskError(f"copy_rule (--copy-rule) must be one of {', '.join(COPY_RULES)}, got {name!r}")
    return COPY_RULES[name]


def default_min_distance(reference_context: int) -> int:
    """D = N // 4 (tokens)."""
    return max(1, reference_context // 4)


def copy_vocabulary(tokens: Sequence[str]) -> np.ndarray:
    """[V] bool: which token strings are identifier or number tokens.

    A token counts when its text, stripped of surrounding whitespace and of the byte-level BPE space
    marker ``Ġ``, is an identifier of at least two characters that is not a Python keyword, or a run
    of digits.

    Args:
        tokens: the V token strings of a vocabulary, index = token id (``tokenizer.convert_ids_to_tokens``).
    """
    out = np.zeros(len(tokens), dtype=bool)
    for i, tok in enumerate(tokens):
        text = (tok or "").replace("Ġ", " ").replace("▁", " ").strip()
        out[i] = bool(NUMBER.fullmatch(text)) or (bool(IDENTIFIER.fullmatch(text)) and not keyword.iskeyword(text))
    return out


def copy_positions(ids: Sequence[int], eligible: np.ndarray, reference_context: int, min_distance: int,
                   rule: CopyRule = COPY_RULES["induction"]) -> tuple[np.ndarray, np.ndarray]:
    """Every position t >= N of a document that is a copy target (module docstring), with its source.

    Args:
        ids: [L] token ids of the document.
        eligible: [V] bool, token ids that may be targets (:func:`copy_vocabulary`).
        reference_context: N in tokens; min_distance: D in tokens, 1 <= D <= N.
        rule: :class:`CopyRule` (default ``induction``).

    Returns:
        ([m] int64 positions t, increasing, with ``D <= t − s <= N`` for the most recent s < t with
        ``ids[s] == ids[t]``, the rule's ``match`` tokens before t equal to those before s (and, with
        ``nearest``, no later occurrence of them before t); [m] int64 those sources s).

    Raises:
        TaskError: D outside [1, N].
    """
    N, D, m = reference_context, min_distance, rule.match
    if not 1 <= D <= N:
        raise TaskError(f"min_distance (--min-distance) must lie in [1, N = {N}], got {D}")
    ids = [int(i) for i in ids]
    last: dict[int, int] = {}  # token -> its latest position so far
    after: dict[tuple[int, ...], int] = {}  # m tokens -> the position right after their latest occurrence
    out, sources = [], []
    for t, tok in enumerate(ids):
        s = last.get(tok)
        context = tuple(ids[t - m : t]) if m and t >= m else None
        nearest_before = after.get(context) if context is not None else None
        preceded = (m == 0 or (s is not None and s >= m and context is not None and tuple(ids[s - m : s]) == context)) \
            and (not rule.nearest or nearest_before == s)
        if t >= N and s is not None and eligible[tok] and D <= t - s <= N and preceded:
            out.append(t)
            sources.append(s)
        last[tok] = t
        if context is not None:
            after[context] = t
    return np.asarray(out, dtype=np.int64), np.asarray(sources, dtype=np.int64)


def copy_tasks(docs: Sequence[TokenDoc], eligible: np.ndarray, reference_context: int, min_distance: int,
               per_doc: int, seed: int,
               rule: CopyRule = COPY_RULES["induction"]) -> tuple[list[str], list[int], list[torch.Tensor], list[int]]:
    """Up to ``per_doc`` copy targets per document, drawn without replacement by a generator seeded by
    ``(seed, "copy:" + doc id)`` (independent of the other documents).

    Returns:
        (doc ids, positions, token-id tensors of the documents, source positions), one entry per target.
    """
    doc_ids, positions, sources, ids_of = [], [], [], []
    for d in docs:
        pos, src = copy_positions(d.ids.tolist(), eligible, reference_context, min_distance, rule)
        if pos.size > per_doc:
            rng = np.random.default_rng(doc_seed(seed, "copy:" + d.id))
            pick = np.sort(rng.choice(pos.size, size=per_doc, replace=False))  # the same draw as of positions
            pos, src = pos[pick], src[pick]
        doc_ids += [d.id] * pos.size
        positions += pos.tolist()
        ids_of += [d.ids] * pos.size
        sources += src.tolist()
    return doc_ids, positions, ids_of, sources


FILLER = (
    "def helper_{a}(x):\n    return x * {b} + {c}\n\n",
    "for i in range({a}):\n    total_{b} += i * {c}\n",
    "items_{a} = [{b}, {c}, {a}]\n",
    "if count_{a} > {b}:\n    count_{a} -= {c}\n",
    "result_{a} = compute(data_{b}, {c})\n",
    "while n_{a} < {b}:\n    n_{a} += {c}\n",
)
HEADER = '"""Configuration values of the service, loaded once at start-up and read by every worker."""\n'


def filler_line(rng: np.random.Generator) -> str:
    """One line of :data:`FILLER` with three numbers in [1, 100) (draws: the numbers, then the line)."""
    a, b, c = (int(x) for x in rng.integers(1, 100, size=3))
    return str(rng.choice(FILLER)).format(a=a, b=b, c=c)


def fill_to_length(encode: Callable[[str], list[int]], text: str, query: str, length: int,
                   next_line: Callable[[], str]) -> tuple[str, list[int]]:
    """``text`` plus the fewest lines of ``next_line()`` (in order) for which ``encode(text + lines +
    query)`` has at least ``length`` tokens: (that text, its ids with ``query``).

    The same result as appending one line at a time and re-encoding the whole text after each
    (quadratic in the number of lines), assuming the token count never falls when a line is added.
    Here each line is encoded once and counted, lines are added until their counts cover what the
    whole text lacks, and the whole text is re-encoded; where the counts did not add up (a tokenizer
    that merges or splits across a line boundary, such as byte-level BPE's ``"\n\n"`` at the end of
    a piece) the fewest lines are then found by galloping down and bisecting. Whole-text encodings:
    three when the counts add up, O(log lines) more otherwise. ``next_line`` may be called for lines
    that are not used (after the last used one).

    Args:
        encode: text -> token ids; text: what comes before the lines; query: what comes after them;
        length: the least number of tokens (N); next_line: the next line of the text (with its newline).
    """
    lines: list[str] = []
    cache: dict[int, list[int]] = {}

    def ids_with(k: int) -> list[int]:  # the ids of the text with the first k lines
        if k not in cache:
            cache[k] = encode(text + "".join(lines[:k]) + query)
        return cache[k]

    lo = 0  # lo lines fall short of the length (once a line is needed)
    while len(ids_with(len(lines))) < length:
        lo, deficit, counted = len(lines), length - len(ids_with(len(lines))), 0
        while counted < deficit:  # the tokens of the pieces
            lines.append(next_line())
            counted += len(encode(lines[-1]))
    hi, step = len(lines), 1  # hi lines reach the length
    while hi - step > lo:  # gallop down ...
        if len(ids_with(hi - step)) < length:
            lo = hi - step
            break
        hi, step = hi - step, 2 * step
    while hi - lo > 1:  # ... then bisect: the fewest lines in (lo, hi]
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(ids_with(mid)) >= length else (mid, hi)
    return text + "".join(lines[:hi]), ids_with(hi)


def kv_document(encode: Callable[[str], list[int]], reference_context: int, min_distance: int, seed: int,
                n_keys: int = 6, query_template: str = 'assert {key} == "',
                max_tries: int = 20) -> tuple[list[int], int]:
    """One synthetic key–value recall document: (token ids of length N + 1, source position).

    Text: :data:`HEADER`, ``n_keys`` lines ``key_<i> = "<value>"`` (distinct two-digit keys, values of
    four lower-case letters and digits starting with a letter), filler lines of :data:`FILLER` until
    the prefix reaches N tokens (the fewest that do, :func:`fill_to_length`), then
    ``assert key_<j> == "`` for one of the keys. The last N tokens before the value are the
    reference context; token N (the target) is the value's first token,
    equal to the token at the source position inside the definition of ``key_<j>``.

    Args:
        encode: the model tokenizer's text -> ids (no special tokens).
        reference_context: N; min_distance: D (the source lies at distance >= D from the target).
        seed: the document's seed (``numpy.random.default_rng``).

    Raises:
        TaskError: no draw of ``max_tries`` met the rules (N too small for the definitions, or a
            tokenizer that merges the value with the quote).
    """
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
        text, prefix_ids = fill_to_length(encode, text, query, N, lambda: filler_line(rng))
        full = encode(text + query + values[j] + '"\n')
        t = len(prefix_ids)
        source = len(encode(before_def))
        if full[:t] != prefix_ids or len(full) <= t or source >= len(full) or full[source] != full[t]:
            continue  # the tokenizer merged across a boundary: draw again
        if not (t - N <= source and t - source >= min_distance):
            continue
        return full[t - N : t + 1], source - (t - N)
    raise TaskError(f"no key-value document met the rules in {max_tries} draws at N = {N}, D = {min_distance}; "
                    "use a larger --reference-context or a smaller --min-distance")


def kv_tasks(encode: Callable[[str], list[int]], reference_context: int, min_distance: int, n_docs: int,
             seed: int) -> tuple[list[str], list[int], list[torch.Tensor], list[int]]:
    """``n_docs`` key–value documents ``kv-<seed>-<i>`` (seed of document i: ``doc_seed(seed, "kv:i")``),
    each with its one target at position N. Same return shape as :func:`copy_tasks`."""
    out: tuple[list, list, list, list] = ([], [], [], [])
    for i in range(n_docs):
        ids, source = kv_document(encode, reference_context, min_distance, doc_seed(seed, f"kv:{i}"))
        for part, value in zip(out, (f"kv-{seed}-{i}", reference_context, torch.tensor(ids, dtype=torch.long), source)):
            part.append(value)
    return out


def build_task_set(docs: Sequence[TokenDoc], eligible: np.ndarray, encode: Callable[[str], list[int]],
                   reference_context: int, min_distance: int, copy_per_doc: int, n_kv_docs: int,
                   seed: int, rule: CopyRule = COPY_RULES["induction"]) -> TaskSet:
    """Copy targets of ``docs`` then ``n_kv_docs`` key–value targets, as one :class:`TaskSet`.

    Raises:
        TaskError: D outside [1, N], or no target at all (says how to get some).
    """
    parts = [("copy", copy_tasks(docs, eligible, reference_context, min_distance, copy_per_doc, seed, rule))]
    if n_kv_docs:
        parts.append(("kv", kv_tasks(encode, reference_context, min_distance, n_kv_docs, seed)))
    N = reference_context
    doc, position, context, token, kind, source = [], [], [], [], [], []
    for name, (ids_doc, ids_pos, ids, srcs) in parts:
        for d, t, x, s in zip(ids_doc, ids_pos, ids, srcs):
            doc.append(d)
            position.append(t)
            context.append(x[t - N : t])
            token.append(x[t])
            kind.append(name)
            source.append(s)
    if not doc:
        raise TaskError(f"no attribution target: no copy target at N = {N}, D = {min_distance} in {len(docs)} "
                        "documents and no key-value documents; use --kv-docs or a smaller --min-distance")
    targets = TargetSet(doc, np.asarray(position, np.int64), torch.stack(context), torch.stack(token))
    return TaskSet(targets, kind, np.asarray(source, np.int64))
