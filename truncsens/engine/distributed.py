"""Several processes (``accelerate launch``): each takes a disjoint set of shards; rank 0 merges.

Single-process runs never touch ``torch.distributed``: :func:`current_ranks` only asks accelerate's
``PartialState`` when the launcher has set ``WORLD_SIZE`` > 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass
class Ranks:
    """This process's place in the run: ``index`` of ``count`` processes, ``local_index`` on its node."""

    index: int = 0
    count: int = 1
    local_index: int = 0
    barrier: Callable[[], None] = lambda: None

    @property
    def is_main(self) -> bool:
        return self.index == 0

    def owns(self, shard: int) -> bool:
        """Whether this process computes shard number ``shard`` (round robin)."""
        return shard % self.count == self.index


def current_ranks() -> Ranks:
    """Ranks of this process: a single process unless launched with ``WORLD_SIZE`` > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    from accelerate import PartialState

    state = PartialState()
    return Ranks(state.process_index, state.num_processes, state.local_process_index, state.wait_for_everyone)


def process_device(device: str, ranks: Ranks) -> str:
    """``cuda`` without an index becomes ``cuda:<local rank>`` when several processes run."""
    if ranks.count > 1 and device in ("cuda", "auto"):
        return f"cuda:{ranks.local_index}" if device == "cuda" else device
    return device
