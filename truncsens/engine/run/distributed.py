"""Several processes (``torchrun``, ``accelerate launch``, or any launcher that sets the standard
``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` environment): each takes a disjoint set of shards; rank 0
merges.

The launch is read from the environment whatever the launcher and device; the process group is
joined with ``torch.distributed`` (gloo on the CPU, nccl on CUDA) unless the launcher already did,
and what the group reports must agree with the environment, or the run is refused: a process that
believed it was rank 0 of 1 would write the same shard files as its peers.
Single-process runs never touch ``torch.distributed``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


class LaunchError(RuntimeError):
    """The launch environment and the process group disagree; the message says how."""


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


def launch_environment(env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) the launcher announced; (0, 1, 0) without a launcher.

    Raises:
        LaunchError: values that are not whole numbers, or a rank outside ``0..WORLD_SIZE-1``.
    """
    env = os.environ if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError as exc:
        raise LaunchError(f"the launch environment is not numeric (WORLD_SIZE, RANK, LOCAL_RANK): {exc}") from None
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"the launch environment says rank {rank} of WORLD_SIZE={world}: not a valid place")
    if world > 1 and "RANK" not in env:
        raise LaunchError(f"WORLD_SIZE={world} is set but RANK is not: launch with torchrun or accelerate launch")
    return rank, world, local


def _join_group(device_hint: str) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device_hint.startswith("cuda") and torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)


def current_ranks(device: str = "cpu") -> Ranks:
    """Ranks of this process, from the launch environment and the joined process group.

    Raises:
        LaunchError: the process group's rank or size differs from the environment's.
    """
    rank, world, local = launch_environment()
    if world == 1:
        return Ranks()
    import torch.distributed as dist

    _join_group(device)
    seen = (dist.get_rank(), dist.get_world_size())
    if seen != (rank, world):
        raise LaunchError(f"the launcher announced rank {rank} of {world} processes but the process group sees rank "
                          f"{seen[0]} of {seen[1]}; refusing to run (shards would collide)")
    return Ranks(rank, world, local, dist.barrier)


def process_device(device: str, ranks: Ranks) -> str:
    """``cuda`` (or ``auto`` on a CUDA machine) without an index becomes ``cuda:<local rank>`` when
    several processes run."""
    if ranks.count > 1 and device in ("cuda", "auto"):
        if device == "auto":
            import torch

            if not torch.cuda.is_available():
                return "cpu"
        return f"cuda:{ranks.local_index}"
    return device
