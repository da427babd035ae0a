"""Which positions are scored: the same targets for every window and policy.

A target is a position ``t`` of a document whose reference context ``x[t-N:t]`` (N =
``reference_context`` tokens) lies inside the document: ``N <= t < len(doc)``. Targets are drawn
per document without replacement with a generator seeded by ``(seed, doc id)``, so they do not
depend on which other documents are in the run, on sharding, or on resuming.
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
    """

    doc: list[str]
    position: np.ndarray
    context: torch.Tensor
    token_id: torch.Tensor

    def __len__(self) -> int:
        return len(self.doc)

    def subset(self, index: slice) -> "TargetSet":
        """Targets ``index`` (a slice) of this set."""
        return TargetSet(self.doc[index], self.position[index], self.context[index], self.token_id[index])


def doc_seed(seed: int, doc_id: str) -> int:
    """A 64-bit seed for one document, from SHA-256 of ``"{seed}:{doc_id}"``."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big")


def draw_positions(length: int, reference_context: int, targets_per_doc: int | None, seed: int, doc_id: str) -> np.ndarray:
    """Sorted target positions of one document (int64), empty if ``length < N + 1``.

    ``targets_per_doc=None`` takes every eligible position.
    """
    eligible = np.arange(reference_context, length, dtype=np.int64)
    if targets_per_doc is None or eligible.size <= targets_per_doc:
        return eligible
    rng = np.random.default_rng(doc_seed(seed, doc_id))
    return np.sort(rng.choice(eligible, size=targets_per_doc, replace=False))


def select_targets(docs: list[TokenDoc], reference_context: int, targets_per_doc: int | None, seed: int) -> TargetSet:
    """Targets of every document long enough (``len >= N + 1``), in document order.

    Raises:
        ValueError: ``reference_context < 1`` or ``targets_per_doc < 1``.
    """
    if reference_context < 1:
        raise ValueError(f"reference context must be at least 1 token, got {reference_context}")
    if targets_per_doc is not None and targets_per_doc < 1:
        raise ValueError(f"--targets-per-doc must be at least 1, got {targets_per_doc}")
    doc_ids, positions, contexts, tokens = [], [], [], []
    n = reference_context
    for d in docs:
        pos = draw_positions(int(d.ids.numel()), n, targets_per_doc, seed, d.id)
        for t in pos.tolist():
            doc_ids.append(d.id)
            positions.append(t)
            contexts.append(d.ids[t - n : t])
            tokens.append(d.ids[t])
    if not contexts:
        return TargetSet([], np.zeros(0, np.int64), torch.zeros(0, n, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    return TargetSet(doc_ids, np.asarray(positions, np.int64), torch.stack(contexts), torch.stack(tokens))
