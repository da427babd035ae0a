"""``reencode``: the model reads only the kept tokens of the target's query, as a fresh sequence
(docs/method.md, "Semantics"), at positions ``original`` or ``reindexed``; a suffix window of w tokens
is the ``suffix`` policy at budget w (arXiv 2605.25085). No model statistics: policies that read
scores are refused, and ``--granularity head`` too (one re-encoded sequence has a single kept set).

Sliding-window models (:mod:`truncsens.engine.attention_windows`): a layer of window W reads key j
from query q only if ``q - j < W`` on the positions the kept tokens are given.
"""

from __future__ import annotations

from typing import Sequence

import torch

from truncsens.engine.attention_windows import kept_attention_mask, own_window_differs
from truncsens.engine.forward import model_dtype, next_token_logprobs
from truncsens.engine.reference_pass import ReferencePass
from truncsens.engine.semantics.base import Semantics, SemanticsError, windows_of
from truncsens.policies.base import PER_QUERY_DRAWS, Kept, Policy, PolicyError
from truncsens.results import POSITIONS


class Reencode(Semantics):
    """The model reads only the kept tokens of the target's query, as a new sequence."""

    name = "reencode"
    positions = POSITIONS
    provides = frozenset({PER_QUERY_DRAWS})
    needs_transformers = False
    reference_state = False
    score_source = "none (policies that read scores are refused)"
    # original: a sliding layer sees kept sinks only within W original positions of the query (a deployed
    # sliding layer holds no sinks); reindexed: the kept tokens are consecutive, as in a fresh forward
    window_distances = {"original": "original_position", "reindexed": "reindexed_position"}

    def cost(self, context_len: int, budget: int) -> int:
        """``budget`` tokens: the kept tokens are re-encoded."""
        return budget

    def reference(self, model, input_ids: torch.Tensor, policies: Sequence[Policy],
                  granularity: str = "token") -> ReferencePass:
        """Reference log-probabilities only (positions 0..T-1; ``granularity`` is always token here)."""
        B, T = input_ids.shape
        return ReferencePass(next_token_logprobs(model, input_ids, torch.arange(T, device=input_ids.device).expand(B, T)))

    @staticmethod
    def gather(kept: Kept, budget: int, positions: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept token indices and their position ids, both [B, k] int64 in increasing order.

        Raises:
            PolicyError: a row does not keep exactly ``budget`` tokens (re-encoding batches rows of one length).
        """
        keep_last = kept.keep[:, -1, :]  # [B, T] the target's query
        counts = keep_last.sum(-1)
        if not bool((counts == budget).all()):
            raise PolicyError(f"re-encoding needs exactly {budget} kept tokens per target, the policy kept {counts.tolist()}")
        B, T = keep_last.shape
        order = torch.arange(T, device=keep_last.device).expand(B, T)  # [B, T]
        index = order[keep_last].view(B, budget)  # [B, k]
        pos = index if positions == "original" else torch.arange(budget, device=index.device).expand(B, budget)
        return index, pos

    def kept_logprobs(self, model, input_ids: torch.Tensor, kept: Kept, ref: ReferencePass | None,
                      positions: str) -> torch.Tensor:
        """Re-encode ``input_ids`` [B, T] gathered at the kept indices (exactly k per row).

        With original positions and sliding-window layers, each layer's window is applied on the
        original positions (the model's own mask would apply it on indices of the re-encoded
        sequence, which differ once sinks are kept in front of a window).

        Raises:
            SemanticsError: original positions, and a model whose layers cannot be masked per layer
                or that applies its windows on sequence indices where they differ from positions.
        """
        index, pos = self.gather(kept, int(kept.keep[0, -1].sum()), positions)  # [B, k] each
        mask = None
        if positions == "original" and hasattr(model, "set_attn_implementation"):  # a transformers model
            windows = windows_of(model, f"{self.name} with --positions original")
            if windows.windowed and windows.applies_own:
                if own_window_differs(windows, pos):
                    raise SemanticsError(
                        f"the model applies its {windows.describe()} on sequence indices, which differ from the kept "
                        f"tokens' original positions; use --positions reindexed or a contiguous policy (suffix)")
            elif windows.windowed:
                B, k = pos.shape
                causal = torch.ones(k, k, dtype=torch.bool, device=pos.device).tril().expand(B, k, k)  # [B, k, k]
                mask = kept_attention_mask(windows, causal, None, pos, pos, model_dtype(model))
        return next_token_logprobs(model, input_ids.gather(1, index), pos, mask)
