"""``merge_mean``: sinks, recent tokens and m summary slots, each the running mean of evicted tokens.

[ours], after the merging caches of the KV-merging literature (docs/method.md, §4): the cache holds
the first ``n_sink`` tokens, ``n_summary`` summary slots and the most recent tokens, k − 1 slots in
all between queries (k: the budget, the query's own token included). A token leaving the recent
window is folded into the summaries: its key (after the rotary embedding, as cached) and value join
the count-weighted mean of a summary slot, whose attention logit gets ``log n`` for the n tokens it
holds (proportional attention). With one summary (the default) it is the mean of every evicted token;
with m > 1, while the old region (slots between the sinks and the protected recent ones) holds more
than m slots, its two adjacent slots of smallest total count merge (ties: the oldest pair), so
summaries cover contiguous spans of balanced counts. Memory: k − 1 key/value slots and one count per slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from truncsens.policies.base import PolicyError
from truncsens.policies.merging import MergePolicy, MergeStep, MergeView, groups_to_step


@dataclass
class MergeMeanPolicy(MergePolicy):
    """Sinks, ``n_summary`` running-mean summary slots and the most recent tokens.

    Attributes:
        n_sink: first tokens kept unmerged (tokens), >= 0.
        n_summary: summary slots m >= 1.
    """

    name: ClassVar[str] = "merge_mean"
    n_sink: int = 4
    n_summary: int = 1

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise PolicyError(f"--sinks must be >= 0, got {self.n_sink}")
        if self.n_summary < 1:
            raise PolicyError(f"merge_mean n_summary must be >= 1, got {self.n_summary}")

    def min_budget(self) -> int:
        """``n_sink + n_summary + 1``: sinks, summaries and the query's own token."""
        return self.n_sink + self.n_summary + 1

    def merge(self, view: MergeView) -> MergeStep:
        """Fold the oldest non-sink slots into at most ``n_summary`` summaries, leaving k − 1 slots.

        Returns:
            :class:`MergeStep`: sinks and the k − 1 − n_sink − n_summary newest slots unchanged, the
            old region merged by adjacent pairs of smallest total count; merged slots get anchor -1.
        """
        target = view.budget - 1
        groups, anchors = [], []
        done: dict[tuple, tuple[list, list]] = {}  # rows of equal anchors and counts merge alike (decided once)
        for anchor, count in zip(view.anchor.tolist(), view.count.tolist()):
            if (tuple(anchor), tuple(count)) in done:
                slots, heads = done[tuple(anchor), tuple(count)]
                groups.append(slots)
                anchors.append(heads)
                continue
            n = len(anchor)
            slots = [[i] for i in range(n)]
            counts = list(count)
            heads = list(anchor)
            sinks = sum(1 for a in anchor if 0 <= a < self.n_sink)
            recent = max(0, target - sinks - self.n_summary)
            old_end = n - recent  # old region: slots sinks .. old_end - 1 of ``slots``
            while len(slots) > target:
                pairs = range(sinks, old_end - 1)
                i = min(pairs, key=lambda p: (counts[p] + counts[p + 1], p))
                slots[i:i + 2] = [slots[i] + slots[i + 1]]
                counts[i:i + 2] = [counts[i] + counts[i + 1]]
                heads[i:i + 2] = [-1]
                old_end -= 1
            groups.append(slots)
            anchors.append(heads)
            done[tuple(anchor), tuple(count)] = slots, heads
        return groups_to_step(groups, anchors, view.anchor.shape[1], view.anchor.device)
