"""Naive reference implementation: one forward per (target, window) pair at batch size 1.

Used by the equality tests and by ``benchmarks/measure_throughput.py`` as the baseline. It shares
no batching or ``logits_to_keep`` code with :mod:`truncsens.engine.measure`: it runs the model on
one sequence, takes the full logits, and reads the last row.
"""

from __future__ import annotations

import torch

from truncsens.divergences import all_metrics
from truncsens.engine.reencode import kept_position_ids


@torch.no_grad()
def last_logprobs(model, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Float32 log-probabilities after the last token of one sequence. ids, position_ids: [T] -> [V]."""
    out = model(input_ids=ids[None, :], position_ids=position_ids[None, :], attention_mask=torch.ones_like(ids)[None, :])
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


@torch.no_grad()
def naive_pair(model, context: torch.Tensor, token_id: int, window: int, n_sink: int, positions: str) -> dict[str, float]:
    """All metrics for one target and one window, computed from scratch.

    Args:
        model: causal LM on the CPU (or the device of ``context``).
        context: [N] reference context x[t-N:t].
        token_id: the actual next token x[t].
        window, n_sink, positions: as in :mod:`truncsens.engine.reencode`.

    Returns:
        metric name -> float.
    """
    n = context.numel()
    ref = last_logprobs(model, context, torch.arange(n, device=context.device))  # [V]
    kept = torch.cat([context[:n_sink], context[n - window :]])  # [S + w]
    pos = kept_position_ids(n, window, n_sink, positions).to(context.device)
    lp = last_logprobs(model, kept, pos)  # [V]
    metrics, _ = all_metrics(ref[None], lp[None], torch.tensor([token_id], device=context.device))
    return {k: float(v[0]) for k, v in metrics.items()}
