"""The steps of a streaming run (docs/method.md, section 3): when its eviction decisions are taken
(:func:`chunk_bounds`), and the closed-form eviction steps of the policies that keep the first keys
and the most recent others (:func:`recent_eviction_steps`).

A module below both :mod:`truncsens.policies.base` (whose :meth:`~truncsens.policies.base.Policy.eviction_steps`
reads :func:`recent_eviction_steps`) and :mod:`truncsens.policies.streaming` (the loop);
pure functions of positions, no model.
"""

from __future__ import annotations

import torch

from truncsens.policies.errors import PolicyError


def chunk_bounds(context_len: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) of each step: the prompt 0..T-2 in chunks of ``chunk`` tokens, then (T-1, T).

    Raises:
        PolicyError: chunk < 1 or T < 1.
    """
    if chunk < 1:
        raise PolicyError(f"chunk (--chunk) must be at least 1 token, got {chunk}")
    if context_len < 1:
        raise PolicyError("a streaming run needs at least one token")
    prompt = context_len - 1
    return [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)] + [(prompt, context_len)]


def recent_eviction_steps(n_first: int, budget: int, context_len: int, chunk: int,
                          device: torch.device | str = "cpu") -> torch.Tensor:
    """[T] int64 eviction step of every key under a policy that keeps the first ``n_first`` keys and
    the most recent others (``suffix``: 0, ``sink_recent``: its sinks), in closed form: what
    :func:`truncsens.policies.streaming.run_stream` decides, without its O(T) work per step.

    At a chunk end e < T the cache keeps keys j < S (S = ``n_first``) and j >= e - (k - 1 - S), so key
    j >= S is evicted at the first chunk end e >= j + k - S; chunk ends are the multiples of C below
    T - 1 and T - 1 itself (:func:`chunk_bounds`); a key no prompt chunk end evicts gets T.

    Raises:
        PolicyError: chunk < 1 or T < 1 (as :func:`chunk_bounds`).
    """
    chunk_bounds(context_len, chunk)  # the same checks
    T, C = context_len, chunk
    j = torch.arange(T, device=device)
    due = j + budget - n_first  # [T] the first chunk end that may evict key j
    end = torch.div(due + C - 1, C, rounding_mode="floor") * C  # [T] the first multiple of C >= due
    end = torch.where(end < T - 1, end, torch.full_like(end, T - 1))  # the prompt's last chunk ends at T - 1
    steps = torch.where(due <= T - 1, end, torch.full_like(end, T))
    return torch.where(j < n_first, torch.full_like(steps, T), steps)
