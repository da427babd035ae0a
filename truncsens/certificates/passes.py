"""The passes of one batch of targets: a probed prefill, the full-cache decode of the target's
query, and one evicted decode per (policy, budget), each recording attention-level certificates.

Prefill-evict semantics (docs/method.md section 3): keys and values of the first T − 1 tokens come
from the full context; only the target's query (token T − 1) reads an evicted cache, in every layer,
so its hidden state at layer l + 1 follows from the Hájek output ô of layer l. Scores are the
attention each key received in the full-context pass, mean over layers and heads, summed over all
query rows (H2O-style, arXiv 2306.14048; the ``attention`` score of
:meth:`truncsens.engine.semantics.Semantics.scores`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from truncsens.certificates.probe import CertifyProbe, probed
from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs
from truncsens.policies import Policy, PolicyError

RECORDS = ("error", "radius_eb", "radius_normal", "o_norm", "variance", "value_range", "n_random", "has_tail")


@dataclass
class BatchRecords:
    """What :func:`certify_batch` returns (B targets, P policies, K budgets, L layers, H heads).

    Attributes:
        ref_logprobs: [B, V] float64 full-cache next-token log-probabilities.
        logprobs: [P, K, B, V] float64 under each policy and budget.
        records: name (:data:`RECORDS`) -> [P, K, B, L, H] float64; radii are NaN for policies
            without a random design.
        kept_tokens: [P, K, B] int64 keys the target's query kept.
        scores: [B, T] float32 attention score of each key.
    """

    ref_logprobs: torch.Tensor
    logprobs: torch.Tensor
    records: dict[str, torch.Tensor]
    kept_tokens: torch.Tensor
    scores: torch.Tensor


def design_of(policy: Policy, context_len: int, budget: int, seeds: Sequence[int], scores: torch.Tensor):
    """(kept, pi, tail), each [B, T], of the target's query (T − 1) under ``policy``.

    ``pi`` is the policy's inclusion probability where it has a random design (``design()``), else 1 on
    kept keys; ``tail`` marks the keys drawn at random (none for deterministic or uniform policies).

    Args:
        scores: [B, T] scores of the target's query.

    Raises:
        PolicyError: from the policy (budget out of range, bad scores).
    """
    q = torch.tensor([context_len - 1], device=scores.device)
    s = scores.unsqueeze(1) if policy.needs_scores else None  # [B, 1, T]
    kept = policy.keep(context_len, budget, q, list(seeds), s).keep[:, 0]  # [B, T]
    if hasattr(policy, "design"):
        pi, tail = policy.design(budget, q, s)
        return kept, pi[:, 0], tail[:, 0]
    return kept, kept.to(torch.float64), torch.zeros_like(kept)


@torch.no_grad()
def certify_batch(model, input_ids: torch.Tensor, policies: Sequence[Policy], budgets: Sequence[int],
                  seeds: Sequence[Sequence[Sequence[int]]], delta: float) -> BatchRecords:
    """All passes of B targets.

    Args:
        model: a transformers causal LM that uses the attention interface
            (:func:`truncsens.certificates.probe.check_model`).
        input_ids: [B, T] int64 reference contexts (T >= 2); the target's query is token T − 1.
        policies: P policies; budgets: K budgets (each < T).
        seeds: seeds[p][j] is the list of B seeds of policy p at budget j.
        delta: miss probability of the radii, in (0, 1).

    Returns:
        :class:`BatchRecords`.

    Raises:
        PolicyError: a policy refuses a budget or the scores.
        NonFiniteLogitsError: NaN or infinite logits.
    """
    B, T = input_ids.shape
    device = input_ids.device
    pos = torch.arange(T, device=device).expand(B, T)  # [B, T]
    cache = kvcache.new_cache(model)
    kw = {kvcache.cache_keyword(model): cache}
    probe = CertifyProbe(mode="prefill", delta=delta)
    ones = torch.ones(B, T, dtype=torch.long, device=device)
    P, K = len(policies), len(budgets)
    with probed(model):
        model(input_ids=input_ids[:, : T - 1], position_ids=pos[:, : T - 1], attention_mask=ones[:, : T - 1],
              use_cache=True, logits_to_keep=1, certify_probe=probe, **kw)
        heads = probe.n_heads_seen  # L x H: every forward adds each layer's heads once
        probe.mode = "reference"
        out = model(input_ids=input_ids[:, T - 1 :], position_ids=pos[:, T - 1 :], attention_mask=ones, use_cache=True,
                    logits_to_keep=1, certify_probe=probe, **kw)
        kvcache.truncate(cache, T - 1)
        ref_lp = last_logprobs(out.logits[:, -1, :])  # [B, V]
        scores = probe.received / heads  # [B, T] mean over layers and heads, summed over query rows
        logprobs = torch.empty(P, K, B, ref_lp.shape[-1], dtype=torch.float64, device=device)
        kept_tokens = torch.zeros(P, K, B, dtype=torch.long)
        records: dict[str, torch.Tensor] = {}
        for p, policy in enumerate(policies):
            for j, k in enumerate(budgets):
                if k >= T:
                    raise PolicyError(f"budget {k} is at or above the context of {T} tokens: nothing would be evicted")
                kept, pi, tail = design_of(policy, T, k, seeds[p][j], scores)
                probe.evict(kept, pi, tail)
                try:
                    out = model(input_ids=input_ids[:, T - 1 :], position_ids=pos[:, T - 1 :], attention_mask=ones,
                                use_cache=True, logits_to_keep=1, certify_probe=probe, **kw)
                finally:
                    kvcache.truncate(cache, T - 1)
                logprobs[p, j] = last_logprobs(out.logits[:, -1, :])
                kept_tokens[p, j] = kept.sum(-1).cpu()
                for name in RECORDS:
                    values = probe.stacked(name).cpu()  # [B, L, H]
                    if name in ("radius_eb", "radius_normal") and not hasattr(policy, "design"):
                        values = torch.full_like(values, float("nan"))
                    if name not in records:
                        records[name] = torch.full((P, K, *values.shape), float("nan"), dtype=torch.float64)
                    records[name][p, j] = values
    return BatchRecords(ref_lp, logprobs, records, kept_tokens, scores)
