"""Re-encode semantics: the model reads only the kept tokens.

For a target with reference context ``x[t-N:t]`` (positions 0..N-1 in the reference pass), the
suffix window ``w`` with ``S`` sinks keeps ``x[t-N : t-N+S]`` followed by ``x[t-w : t]``
(arXiv 2605.25085, sink-plus-recent truncation). With ``positions="original"`` the kept tokens
keep their reference position ids ``[0..S-1] + [N-w..N-1]``; with ``"reindexed"`` they are
numbered ``0..S+w-1``. An explicit all-ones attention mask is always passed, so a jump in position
ids is never taken for a packed-sequence boundary.
"""

from __future__ import annotations

import torch

from truncsens.results import POSITIONS


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits."""


def kept_index(reference_context: int, window: int, n_sink: int) -> torch.Tensor:
    """Indices into the reference context kept by a suffix window with sinks: [n_sink + window].

    Raises:
        ValueError: ``window < 1``, ``n_sink < 0`` or ``n_sink + window > reference_context``.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1 token, got {window}")
    if n_sink < 0:
        raise ValueError(f"--sinks must be >= 0, got {n_sink}")
    if n_sink + window > reference_context:
        raise ValueError(
            f"window {window} + {n_sink} sinks exceeds the reference context of {reference_context} tokens; "
            "use windows below the reference context (minus sinks)")
    return torch.cat([torch.arange(n_sink), torch.arange(reference_context - window, reference_context)])


def kept_position_ids(reference_context: int, window: int, n_sink: int, positions: str) -> torch.Tensor:
    """Position ids of the kept tokens: [n_sink + window] (int64).

    Raises:
        ValueError: unknown ``positions`` mode, or a bad window (see :func:`kept_index`).
    """
    if positions not in POSITIONS:
        raise ValueError(f"--positions must be one of {POSITIONS}, got {positions!r}")
    index = kept_index(reference_context, window, n_sink)
    return index.clone() if positions == "original" else torch.arange(index.numel())


@torch.no_grad()
def next_token_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Float32 log-probabilities of the token after the last input, for each row.

    Args:
        model: causal LM (HF interface with ``logits_to_keep``).
        input_ids: [B, T] int64 on the model's device.
        position_ids: [B, T] int64.

    Returns:
        [B, V] float32 log-softmax of the last position's logits.

    Raises:
        NonFiniteLogitsError: NaN or infinite logits.
    """
    attention_mask = torch.ones_like(input_ids)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1)
    logits = out.logits[:, -1, :].float()  # [B, V]
    if not torch.isfinite(logits).all():
        raise NonFiniteLogitsError(
            "the model produced non-finite logits (NaN/inf); try --dtype float32, or check the checkpoint")
    return torch.log_softmax(logits, dim=-1)
