"""Which positions are scored: the same targets for every window and policy.

A target is a position ``t`` of a document whose reference context ``x[t-N:t]`` (N =
``reference_context`` tokens) lies inside the document: ``N <= t < len(doc)``. Targets are drawn
per document without replacement with a generator seeded by ``(seed, doc id)``, so they do not
depend on which other documents are in the run, on sharding, or on resuming.

The block protocol (:mod:`truncsens.engine.block.plan`) draws **blocks** of B consecutive targets
instead (:func:`select_block_targets`): the eligible positions of a document are cut into slots of B
positions at a random offset, and ``ceil(targets_per_doc / B)`` slots are drawn without replacement
(the last one cut so that exactly ``targets_per_doc`` targets are taken), with the same per-document
seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TokenDoc:
    """A tokenized document: id and token ids [L] (int64)."""

    id: str
    ids: torch.Tensor


@dataclass
class TargetSet:
    """Targets and their reference contexts.

    Attributes:
        doc: [n] document id of each target.
        position: [n] int64 index t of the target token in its document.
        context: [n, N] int64 reference contexts x[t-N:t].
        token_id: [n] int64 the actual next token x[t].
        block: [n] int64 position of the first target of each target's block (block protocol), or
            None (one target at a time). Targets of one block are consecutive, in order.
    """

    doc: list[str]
    position: np.ndarray
    context: torch.Tensor
    token_id: torch.Tensor
    block: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.doc)

    def subset(self, index: slice) -> "TargetSet":
        """Targets ``index`` (a slice) of this set."""
        block = None if self.block is None else self.block[index]
        return TargetSet(self.doc[index], self.position[index], self.context[index], self.token_id[index], block)


def doc_seed(seed: int, doc_id: str) -> int:
    """A 64-bit seed for one document, from SHA-256 of ``"{seed}:{doc_id}"`` as UTF-8 with
    ``surrogatepass``: equal to UTF-8 for every valid id, and one-to-one on the lone surrogates by which
    Python holds the bytes of a file name that is not valid UTF-8 (such an id is stored as it is)."""
    text = f"{seed}:{doc_id}".encode("utf-8", errors="surrogatepass")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def draw_positions(length: int, reference_context: int, targets_per_doc: int | None, seed: int, doc_id: str) -> np.ndarray:
    """Sorted target positions of one document (int64), empty if ``length < N + 1``.

    ``targets_per_doc=None`` takes every eligible position.
    """
    eligible = np.arange(reference_context, length, dtype=np.int64)
    if targets_per_doc is None or eligible.size <= targets_per_doc:
        return eligible
    rng = np.random.default_rng(doc_seed(seed, doc_id))
    return np.sort(rng.choice(eligible, size=targets_per_doc, replace=False))


def _check_selection(reference_context: int, targets_per_doc: int | None) -> None:
    if reference_context < 1:
        raise ValueError(f"reference_context (--reference-context) must be at least 1 token, got {reference_context}")
    if targets_per_doc is not None and targets_per_doc < 1:
        raise ValueError(f"targets_per_doc (--targets-per-doc) must be at least 1, got {targets_per_doc}")


def _target_set(docs: list[TokenDoc], reference_context: int, doc_ids: list[str], positions: list[int],
                firsts: list[int] | None = None) -> TargetSet:
    """The TargetSet of the given (document, position) pairs: contexts x[t-N : t] [n, N] and tokens
    x[t] [n]; ``firsts`` [n] the first position of each target's block (None: no blocks)."""
    n = reference_context
    block = None if firsts is None else np.asarray(firsts, np.int64)
    if not positions:
        return TargetSet([], np.zeros(0, np.int64), torch.zeros(0, n, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                         None if block is None else np.zeros(0, np.int64))
    by_id = {d.id: d.ids for d in docs}
    contexts = torch.stack([by_id[i][t - n : t] for i, t in zip(doc_ids, positions)])  # [n_targets, N]
    tokens = torch.stack([by_id[i][t] for i, t in zip(doc_ids, positions)])  # [n_targets]
    return TargetSet(list(doc_ids), np.asarray(positions, np.int64), contexts, tokens, block)


def select_targets(docs: list[TokenDoc], reference_context: int, targets_per_doc: int | None, seed: int) -> TargetSet:
    """Targets of every document long enough (``len >= N + 1``), in document order.

    Raises:
        ValueError: ``reference_context < 1`` or ``targets_per_doc < 1``.
    """
    _check_selection(reference_context, targets_per_doc)
    doc_ids, positions = [], []
    for d in docs:
        pos = draw_positions(int(d.ids.numel()), reference_context, targets_per_doc, seed, d.id).tolist()
        doc_ids += [d.id] * len(pos)
        positions += pos
    return _target_set(docs, reference_context, doc_ids, positions)


def draw_blocks(length: int, reference_context: int, targets_per_doc: int | None, block: int, seed: int,
                doc_id: str) -> list[tuple[int, int]]:
    """Blocks ``(first position, number of targets)`` of one document, sorted; empty if ``length < N + 1``.

    The eligible positions N .. length-1 are cut into slots of ``block`` positions starting at a
    random offset in [0, block) (the first and last slots may be shorter); ``ceil(targets_per_doc /
    block)`` full slots are drawn without replacement (when the document has fewer, all of them and
    then its longest partial slots), and the last one (in position order) keeps only as many targets
    as make ``targets_per_doc``. ``targets_per_doc=None`` takes every slot.

    Raises:
        ValueError: ``block < 1``.
    """
    if block < 1:
        raise ValueError(f"block size must be at least 1, got {block}")
    n_eligible = length - reference_context
    if n_eligible < 1:
        return []
    rng = np.random.default_rng(doc_seed(seed, doc_id))
    offset = int(rng.integers(0, block)) if n_eligible > block else 0
    edges = [0, *range(offset or block, n_eligible, block), n_eligible]
    slots = [(reference_context + a, b - a) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    if targets_per_doc is not None and sum(n for _, n in slots) > targets_per_doc:
        slots.sort(key=lambda s: -s[1])  # full slots first, so that the draw reaches targets_per_doc
        full = [s for s in slots if s[1] == block] or slots
        want = -(-targets_per_doc // block)
        if len(full) >= want:
            pick = sorted(full[i] for i in rng.choice(len(full), size=want, replace=False))
        else:  # too few full slots: all of them, then the longest partial ones until targets_per_doc
            pick, have = list(full), sum(n for _, n in full)
            for slot in (s for s in slots if s not in full):
                if have >= targets_per_doc:
                    break
                pick.append(slot)
                have += slot[1]
            pick.sort()
        taken, out = 0, []
        for start, n in pick:
            n = min(n, targets_per_doc - taken)
            if n > 0:
                out.append((start, n))
                taken += n
        slots = out
    return sorted(slots)


def select_block_targets(docs: list[TokenDoc], reference_context: int, targets_per_doc: int | None, seed: int,
                         block: int) -> TargetSet:
    """Targets in blocks of ``block`` consecutive positions (:func:`draw_blocks`), in document order,
    with ``TargetSet.block`` set.

    Raises:
        ValueError: ``reference_context < 1``, ``targets_per_doc < 1`` or ``block < 1``.
    """
    _check_selection(reference_context, targets_per_doc)
    doc_ids, positions, firsts = [], [], []
    for d in docs:
        for start, n in draw_blocks(int(d.ids.numel()), reference_context, targets_per_doc, block, seed, d.id):
            doc_ids += [d.id] * n
            positions += range(start, start + n)
            firsts += [start] * n
    return _target_set(docs, reference_context, doc_ids, positions, firsts)
