"""``merge_nearest``: each evicted token merged into the kept slot whose key is most similar.

Source: the KV-merging caches that fold an evicted key into its most similar kept key by cosine
similarity (D2O, Wan et al., arXiv 2406.13035; CaM, Zhang et al., ICML 2024), with proportional
attention (ToMe, Bolya et al., arXiv 2210.09461): a slot standing for n tokens gets ``log n`` on its
logit. [ours] One decision per slot shared by every layer and head: the similarity is the cosine of
the keys (after the rotary embedding, as cached) averaged over layers and key/value heads; no
similarity threshold (every evicted token is merged). The token evicted is the oldest non-sink slot
(as ``sink_recent``); it joins the count-weighted mean key and value of its most similar surviving
non-sink slot (ties: the newer slot). Where one step evicts several slots (chunks longer than one
token, or prefill-evict) each is compared with the survivors' keys as they were before the step.
Memory: k − 1 key/value slots and one count per slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from truncsens.policies.base import PolicyError
from truncsens.policies.merging import MergePolicy, MergeStep, MergeView


@dataclass
class MergeNearestPolicy(MergePolicy):
    """Sinks kept; the oldest other slot merged into its most similar surviving slot.

    Attributes:
        n_sink: first tokens kept unmerged and never merged into (tokens), >= 0.
    """

    name: ClassVar[str] = "merge_nearest"
    n_sink: int = 4

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise PolicyError(f"--sinks must be >= 0, got {self.n_sink}")

    def min_budget(self) -> int:
        """``n_sink + 2``: sinks, one slot to merge into and the query's own token."""
        return self.n_sink + 2

    def merge(self, view: MergeView) -> MergeStep:
        """Evict the oldest non-sink slots down to k − 1, each merged into its most similar survivor.

        Returns:
            :class:`MergeStep`: survivors in cache order keep their anchors.
        """
        B, n = view.anchor.shape
        sink = self.sinks_of(view.anchor)  # [B, n]
        order = torch.arange(n, device=view.anchor.device).expand(B, n)
        rank = torch.where(sink, torch.full_like(order, n), order)  # non-sinks by cache order
        r = n - (view.budget - 1)
        victims = torch.sort(rank, dim=1, stable=True).indices[:, :r]  # [B, r] the oldest non-sink slots
        gone = torch.zeros(B, n, dtype=torch.bool, device=order.device).scatter_(1, victims, True)
        sim = view.similarity(victims).double()  # [B, r, n]
        open_ = (~gone & ~sink).unsqueeze(1)  # [B, 1, n] slots a victim may join
        score = torch.where(open_, sim, torch.full_like(sim, float("-inf")))
        # the most similar survivor; ties to the newer slot (flip, argmax takes the first maximum)
        target = n - 1 - score.flip(-1).argmax(-1)  # [B, r]
        new_index = (~gone).long().cumsum(1) - 1  # [B, n] new slot of each survivor
        dest = new_index.clone()
        dest.scatter_(1, victims, new_index.gather(1, target))
        anchor = view.anchor[~gone].view(B, n - r)
        return MergeStep(dest, anchor)
