"""``snapkv``, SnapKV as published: per layer and key/value head, keep the keys an observation window
of the prompt's last queries votes for.

Source: Y. Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"
(arXiv 2404.14469), and its reference implementation in NVIDIA kvpress, ``SnapKVPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/snapkv_press.py``, defaults ``window_size=64``,
``kernel_size=5``). After the prefill of T' = T - 1 tokens, for every layer l and key/value head h:

- the window is the last w prefill queries, positions ``T' - w .. T' - 1``; their attention rows are
  the model's own (causal inside the window, softmax over all T' keys);
- the vote of a prefix key j < T' - w is the mean of those rows over the w window queries and the G
  query heads of h's group (the mean over the group: https://github.com/FasterDecoding/SnapKV/issues/22),
  ``v_j = (1 / (w G)) Σ_i Σ_g a^{(l, hG + g)}_{i, j}`` (:meth:`AttentionRows.layer_window
  <truncsens.engine.attention_rows.AttentionRows.layer_window>`);
- the votes of the T' - w prefix keys are average-pooled over neighbouring keys (kernel p, stride 1,
  zero padding p // 2 counted in the mean: ``torch.nn.functional.avg_pool1d``'s default, as kvpress);
- the window's own w keys are kept, and of the prefix keys those of largest pooled vote, k - 1 in all
  (the budget k counts the query's own key; kvpress keeps ``int(T' (1 - r))`` keys per layer and head,
  the window given the largest score).

[ours]: ties between pooled votes go to the later key (kvpress leaves them to ``torch.topk``); a budget
of at most w + 1 keeps the k - 1 most recent prefix keys (the window keys nearest the query; kvpress
gives every window key the same score and leaves the choice to ``torch.topk``, and refuses T' <= w).
The per-layer, per-head kept sets (:class:`~truncsens.policies.kept.HeadKept`) are decoded exactly
(:func:`truncsens.engine.rerotation.decode_gathered`), so ``snapkv`` runs under ``prefill_evict`` only.

``snapkv_shared`` (:mod:`truncsens.policies.snapkv_shared`) is the variant this package measured as
``snapkv`` before: one kept set for all layers and heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import LAYER_OBSERVATION_WINDOW, Policy, PolicyError, top_per_row
from truncsens.policies.kept import head_kept


def check_window(name: str, window: int, kernel: int) -> None:
    """Raise :class:`PolicyError` unless ``window`` >= 1 and ``kernel`` is odd and >= 1."""
    if window < 1 or kernel < 1 or kernel % 2 == 0:
        raise PolicyError(f"{name} needs an observation window >= 1 (observation_window, --observation-window) and an odd pooling kernel "
                          f">= 1 (pooling_kernel, --pooling-kernel), got {window}, {kernel}")


def pooled_votes(window_mean: torch.Tensor, prefix: int, window: int, kernel: int) -> torch.Tensor:
    """SnapKV's pooled votes of the prefix keys before the observation window (module docstring).

    Args:
        window_mean: [..., >= prefix] mean attention row of the window's queries (over the window and
            the group's query heads) of each layer and head.
        prefix: T', prefill keys; window: w < T'; kernel: odd p >= 1.

    Returns:
        [..., T' - w] float32: ``avg_pool1d`` (kernel p, stride 1, zero padding p // 2 counted in the
        mean) of the votes of keys 0 .. T' - w - 1.
    """
    votes = window_mean[..., : prefix - window].float()  # [..., T'-w]
    lead = votes.shape[:-1]
    flat = votes.reshape(-1, 1, votes.shape[-1])  # [N, 1, T'-w]
    pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)  # [N, 1, T'-w]
    return pooled.reshape(*lead, votes.shape[-1])


def kept_prefix_heads(window_mean: torch.Tensor, budget: int, context_len: int, window: int,
                      kernel: int) -> torch.Tensor:
    """Kept prefix positions per layer and key/value head (module docstring).

    Args:
        window_mean: [L, B, Hkv, >= T - 1] mean attention row of the window ``T - 1 - w .. T - 2``.
        budget: k >= 1 (the query's own key included); context_len: T; window: w; kernel: odd p.

    Returns:
        [L, B, Hkv, min(k, T) - 1] int64, increasing: every prefix key when k >= T; the k - 1 most
        recent when k - 1 <= w; else the w window keys and the k - 1 - w prefix keys of largest
        :func:`pooled_votes` (ties: the later key).
    """
    L, B, H = window_mean.shape[:3]
    P, n = context_len - 1, min(budget, context_len) - 1  # prefill keys, kept prefix keys
    device = window_mean.device
    if n >= P or n <= window:
        return torch.arange(P - n, P, device=device).expand(L, B, H, n).clone()  # [L, B, H, n]
    pooled = pooled_votes(window_mean, P, window, kernel).reshape(L * B * H, P - window)  # [LBH, P-w]
    top = top_per_row(pooled, torch.ones_like(pooled, dtype=torch.bool), n - window)  # [LBH, P-w]
    kept = torch.cat([top, torch.ones(L * B * H, window, dtype=torch.bool, device=device)], -1)  # [LBH, P]
    positions = torch.arange(P, device=device).expand(L * B * H, P)  # [LBH, P]
    return positions[kept].view(L, B, H, n)  # row-major: each row's n kept positions, increasing


@dataclass
class SnapKVPolicy(Policy):
    """SnapKV as published: observation-window votes per layer and key/value head, pooled (module docstring).

    Attributes:
        window: w, prefill queries in the observation window (tokens), >= 1 (kvpress: 64).
        kernel: p, odd average-pooling kernel over keys (tokens), >= 1 (kvpress: 5).
    """

    name: ClassVar[str] = "snapkv"
    layer_heads: ClassVar[bool] = True
    shared_variant: ClassVar[str | None] = "snapkv_shared"
    window: int = 64
    kernel: int = 5

    def __post_init__(self) -> None:
        check_window(self.name, self.window, self.kernel)

    def score_kind(self) -> str:
        """``"layer_window_attention"``."""
        return "layer_window_attention"

    def requirements(self) -> frozenset[str]:
        """The window's attention per layer and key/value head of a full prefill, and a decode of
        per-layer, per-head kept sets (:data:`~truncsens.policies.base.LAYER_OBSERVATION_WINDOW`)."""
        return frozenset({LAYER_OBSERVATION_WINDOW})

    def observation_window(self) -> int:
        """w."""
        return self.window

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int],
             scores: torch.Tensor | None = None):
        """Per-layer, per-head kept sets of the target's query.

        Args:
            context_len: T; budget: k; queries: [1] = [T - 1] (``prefill_evict``); seeds: unused;
            scores: [L, B, Hkv, 1, T] mean attention row of the window ``T - 1 - w .. T - 2`` of each
                layer and key/value head (:meth:`~truncsens.engine.attention_rows.AttentionRows.layer_window`).

        Returns:
            :class:`~truncsens.policies.kept.HeadKept` (``heads`` [L, B, Hkv, k - 1]; ``keep`` [B, 1, T]
            its token-level view, :func:`~truncsens.policies.kept.head_kept`).

        Raises:
            PolicyError: budget out of range, queries other than the last position, or scores missing / misshapen.
        """
        self.check(budget, context_len)
        if queries.tolist() != [context_len - 1]:
            raise PolicyError(f"policy {self.name} decides for the target's query of a prefill (--semantics prefill_evict)")
        if scores is None or scores.dim() != 5 or scores.shape[3] != 1 or scores.shape[4] != context_len:
            got = None if scores is None else tuple(scores.shape)
            raise PolicyError(f"policy {self.name} needs window attention [L, B, Hkv, 1, {context_len}] per layer and "
                              f"key/value head, got {got}")
        heads = kept_prefix_heads(scores[:, :, :, 0], budget, context_len, self.window, self.kernel)  # [L, B, H, k-1]
        return head_kept(heads, context_len, queries)
