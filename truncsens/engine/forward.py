"""Forward passes that return the next-token distribution after the last input token.

Shared by every semantics (:mod:`truncsens.engine.semantics`) and by the reference pass: the model
computes vocabulary logits for the last position only (``logits_to_keep=1``), and the log-softmax is
taken in float64 from the float32 (or wider) logits, so the divergences built on it carry no
rounding of a float32 log-sum-exp (docs/precision.md).
"""

from __future__ import annotations

import torch


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits."""


def last_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Float64 log-softmax of last-position logits (upcast from float32 or better).

    Args:
        logits: [B, V] logits of any float dtype (bfloat16/float16 are first upcast to float32 as
            the model's head produced them).

    Returns:
        [B, V] float64 log-probabilities (natural log).

    Raises:
        NonFiniteLogitsError: NaN or infinite logits.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # upcast only: float64 logits stay float64
    if not torch.isfinite(logits).all():
        raise NonFiniteLogitsError(
            "the model produced non-finite logits (NaN/inf); try --dtype float32, or check the checkpoint")
    return torch.log_softmax(logits.double(), dim=-1)


def rows_logprobs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k, V] float64 log-softmax (:func:`last_logprobs`) of the last k rows of ``logits`` [B, L, V]
    (a forward with ``logits_to_keep=k`` returns exactly those rows).

    Raises:
        NonFiniteLogitsError: NaN or infinite logits.
    """
    rows = logits[:, -k:, :]  # [B, k, V]
    B, _, V = rows.shape
    return last_logprobs(rows.reshape(B * k, V)).view(B, k, V)


def model_dtype(model) -> torch.dtype:
    """The dtype of the model's parameters (an additive attention mask must match it)."""
    return next(model.parameters()).dtype


@torch.no_grad()
def next_token_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        attention_mask: torch.Tensor | dict | None = None) -> torch.Tensor:
    """Log-probabilities of the token after the last input, for each row (no cache, no eviction).

    Without ``attention_mask`` an explicit all-ones mask is passed, so a jump in ``position_ids``
    (sinks kept in front of a window with original positions) is never taken for a packed-sequence
    boundary.

    Args:
        model: causal LM (Hugging Face interface with ``logits_to_keep``).
        input_ids: [B, T] int64 on the model's device.
        position_ids: [B, T] int64.
        attention_mask: a prepared [B, 1, T, T] additive mask or a dict layer type -> such a mask
            (:func:`truncsens.engine.attention_windows.kept_attention_mask`), or None.

    Returns:
        [B, V] float64 log-softmax of the last position's logits.

    Raises:
        NonFiniteLogitsError: NaN or infinite logits.
    """
    if attention_mask is None:
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids,
                    logits_to_keep=1)
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    logits_to_keep=1)
    return last_logprobs(out.logits[:, -1, :])  # [B, V]
