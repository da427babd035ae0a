"""The passes of one batch of targets: a probed prefill, the full-cache decode of the target's
query, and one evicted decode per (policy, budget), each recording attention-level certificates.

Prefill-evict semantics (docs/method.md section 3): keys and values of the first T − 1 tokens come
from the full context; only the target's query (token T − 1) reads an evicted cache, in every layer,
so its hidden state at layer l + 1 follows from the Hájek output ô of layer l. The design
(:class:`~truncsens.certificates.designs.CertifyDesign`) is drawn per layer and key/value head from
that head's own prefill score (default: the attention of the last 32 prefill queries), or, as the
token-level ablation, once from the attention each key received in the full-context pass, mean
over layers and heads, summed over all query rows (H2O-style, arXiv 2306.14048; the ``attention``
score of :meth:`truncsens.engine.semantics.Semantics.scores`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from truncsens.certificates.design_records import DESIGN_RECORDS, design_records, per_head, score_shares
from truncsens.certificates.designs import CertifyDesign, layer_head_seeds
from truncsens.certificates.probe import CertifyProbe, probed
from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs
from truncsens.policies import Policy, PolicyError

PROBE_RECORDS = ("error", "radius_eb", "radius_normal", "o_norm", "variance", "value_range", "n_random", "has_tail",
                 "o_hat_norm", "kept_share", "tail_mass")
RECORDS = PROBE_RECORDS + DESIGN_RECORDS  # the last four: :mod:`truncsens.certificates.design_records`
DRAW_RECORDS = ("error", "variance", "value_range", "n_random", "o_hat_norm")  # kept per draw (``draws`` >= 2)
PLAIN_VARIANCE = "variance_hajek"  # the plain V̂, recorded beside a corrected variance


@dataclass
class BatchRecords:
    """What :func:`certify_batch` returns (B targets, P policies, K budgets, L layers, H heads).

    Attributes:
        ref_logprobs: [B, V] float64 full-cache next-token log-probabilities.
        logprobs: [P, K, B, V] float64 under each policy and budget.
        records: name (:data:`RECORDS`) -> [P, K, B, L, H] float64; radii are NaN for policies
            without a random design; the design records
            (:mod:`truncsens.certificates.design_records`) read the untempered design score.
        kept_tokens: [P, K, B] int64 keys the target's query kept (per-head designs: the mean over
            layers and key/value heads, rounded).
        scores: [B, T] float32 attention score of each key (the token-level design's score).
        floor: [B, L, H] float64 relative difference of the full-cache attention output in the run's
            dtype from its float64 value (the measured numerical floor, :class:`~truncsens.certificates.probe.CertifyProbe`).
        draws: None, or with D >= 2 draws name (:data:`DRAW_RECORDS`, and :data:`PLAIN_VARIANCE` under a
            corrected variance) -> [P, K, D, B, L, H] float64, the records of every draw (draw 0 is
            ``records``'; a policy that is not randomized repeats its one draw).
    """

    ref_logprobs: torch.Tensor
    logprobs: torch.Tensor
    records: dict[str, torch.Tensor]
    kept_tokens: torch.Tensor
    scores: torch.Tensor
    floor: torch.Tensor
    draws: dict[str, torch.Tensor] | None = None


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


def head_design_of(policy: Policy, context_len: int, budget: int, seeds: Sequence[int],
                   scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kept, pi, tail), each [B, L, Hkv, T]: :func:`design_of` for every (target, layer, key/value
    head) row, from that head's scores [B, L, Hkv, T] and seeds from
    :func:`~truncsens.certificates.designs.layer_head_seeds` of the B target seeds."""
    B, L, Hkv, T = scores.shape
    rows = layer_head_seeds(seeds, L, Hkv)  # B·L·Hkv seeds, row (b·L + l)·Hkv + h
    out = design_of(policy, context_len, budget, rows, scores.reshape(B * L * Hkv, T))  # [B·L·Hkv, T] each
    return tuple(t.reshape(B, L, Hkv, T) for t in out)  # type: ignore[return-value]


def full_cache_pass(model, input_ids: torch.Tensor, delta: float, design: CertifyDesign):
    """The probed prefill of tokens 0..T − 2 and the full-cache decode of the target's query T − 1
    (call inside :func:`~truncsens.certificates.probe.probed`).

    Args:
        input_ids: [B, T] int64.

    Returns:
        (probe, cache, heads, ref_logprobs): the :class:`CertifyProbe` (scores, ``floor``), the cache
        of the prefill (truncated back to T − 1 keys), the layer × head count of one forward, and the
        full-cache next-token log-probabilities [B, V] float64.
    """
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
    ones = torch.ones(B, T, dtype=torch.long, device=input_ids.device)
    cache = kvcache.new_cache(model)
    kw = {kvcache.cache_keyword(model): cache}
    probe = CertifyProbe(mode="prefill", delta=delta, obs_window=design.obs_window)
    model(input_ids=input_ids[:, : T - 1], position_ids=pos[:, : T - 1], attention_mask=ones[:, : T - 1],
          use_cache=True, logits_to_keep=1, certify_probe=probe, **kw)
    heads = probe.n_heads_seen  # L x H: every forward adds each layer's heads once
    probe.mode = "reference"
    out = model(input_ids=input_ids[:, T - 1 :], position_ids=pos[:, T - 1 :], attention_mask=ones, use_cache=True,
                logits_to_keep=1, certify_probe=probe, **kw)
    kvcache.truncate(cache, T - 1)
    return probe, cache, heads, last_logprobs(out.logits[:, -1, :])


SCORE_FLOOR = 1e-6  # added to every key's score, relative to the row's mean score


def _head_scores(probe: CertifyProbe, design: CertifyDesign, T: int) -> torch.Tensor:
    """[B, L, Hkv, T] per-head scores of ``design`` (the prefill covers keys 0..T − 2; the target's own
    key, always kept, scores 0).

    A sharp head's window attention is exactly 0 (float32 underflow) on most keys, and a Poisson
    tail budget larger than its keys with a positive score could not be spread. Every key's score
    is therefore raised by :data:`SCORE_FLOOR` times the row's mean score (by 1 in a row without any
    score: a uniform design): π of such keys stays about 1e-6 of an average key's unless the budget
    needs them, and the design always exists.
    """
    if design.score not in probe.head_scores:
        raise PolicyError("per-head designs need attention modules with a layer index (layer_idx); "
                          "use --granularity token")
    s = design.tempered(probe.layer_scores(design.score)).to(torch.float64)  # [B, L, Hkv, T - 1]
    mean = s.mean(-1, keepdim=True)  # [B, L, Hkv, 1]
    s = s + torch.where(mean > 0, SCORE_FLOOR * mean, torch.ones_like(mean))  # a head with no score: uniform
    return torch.nn.functional.pad(s, (0, T - s.shape[-1]))  # [B, L, Hkv, T]


@torch.no_grad()
def certify_batch(model, input_ids: torch.Tensor, policies: Sequence[Policy], budgets: Sequence[int],
                  seeds: Sequence[Sequence[Sequence[int]]], delta: float,
                  design: CertifyDesign = CertifyDesign(), variance: str = "hajek",
                  draw_seeds: Sequence[Sequence[Sequence[Sequence[int]]]] | None = None) -> BatchRecords:
    """All passes of B targets.

    Args:
        model: a transformers causal LM that uses the attention interface
            (:func:`truncsens.certificates.probe.check_model`).
        input_ids: [B, T] int64 reference contexts (T >= 2); the target's query is token T − 1.
        policies: P policies; budgets: K budgets (each < T).
        seeds: seeds[p][j] is the list of B seeds of policy p at budget j.
        delta: miss probability of the radii, in (0, 1).
        design: per layer and key/value head (default) or shared (:mod:`truncsens.certificates.designs`).
        variance: the variance estimate of the radii (:data:`~truncsens.certificates.estimator.VARIANCES`);
            other than "hajek", the records add :data:`PLAIN_VARIANCE`.
        draw_seeds: None (one draw), or ``draw_seeds[p][j][d]`` the B seeds of draw d + 1 of policy p at
            budget j: each further draw of a randomized policy is one more decode of the target's
            query over the same prefill (the same certain set, independent uniforms).

    Returns:
        :class:`BatchRecords`.

    Raises:
        PolicyError: a policy refuses a budget or the scores.
        NonFiniteLogitsError: NaN or infinite logits.
    """
    B, T = input_ids.shape
    device = input_ids.device
    pos = torch.arange(T, device=device).expand(B, T)  # [B, T]
    ones = torch.ones(B, T, dtype=torch.long, device=device)
    P, K = len(policies), len(budgets)
    with probed(model):
        probe, cache, heads, ref_lp = full_cache_pass(model, input_ids, delta, design)
        probe.variance = variance
        names = RECORDS + ((PLAIN_VARIANCE,) if variance != "hajek" else ())
        per_draw = DRAW_RECORDS + ((PLAIN_VARIANCE,) if variance != "hajek" else ())
        D = 1 + (len(draw_seeds[0][0]) if draw_seeds else 0)
        draws: dict[str, torch.Tensor] = {}
        kw = {kvcache.cache_keyword(model): cache}
        scores = probe.received / heads  # [B, T] mean over layers and heads, summed over query rows
        head_scores = _head_scores(probe, design, T) if design.per_head else None  # [B, L, Hkv, T]
        if design.per_head:  # the untempered design score of each key, as a share of its row
            share = score_shares(torch.nn.functional.pad(probe.layer_scores(design.score), (0, 1)))  # [B, L, Hkv, T]
        else:
            share = score_shares(scores)[:, None, None, :]  # [B, 1, 1, T]
        logprobs = torch.empty(P, K, B, ref_lp.shape[-1], dtype=torch.float64, device=device)
        kept_tokens = torch.zeros(P, K, B, dtype=torch.long)
        records: dict[str, torch.Tensor] = {}
        for p, policy in enumerate(policies):
            for j, k in enumerate(budgets):
                if k >= T:
                    raise PolicyError(f"budget {k} is at or above the context of {T} tokens: nothing would be evicted")
                for d in range(D if policy.randomized else 1):
                    row_seeds = seeds[p][j] if d == 0 else draw_seeds[p][j][d - 1]  # type: ignore[index]
                    if head_scores is not None:
                        kept, pi, tail = head_design_of(policy, T, k, row_seeds, head_scores)  # [B, L, Hkv, T]
                    else:
                        kept, pi, tail = design_of(policy, T, k, row_seeds, scores)  # [B, T]
                    probe.evict(kept, pi, tail)
                    try:
                        out = model(input_ids=input_ids[:, T - 1 :], position_ids=pos[:, T - 1 :], attention_mask=ones,
                                    use_cache=True, logits_to_keep=1, certify_probe=probe, **kw)
                    finally:
                        kvcache.truncate(cache, T - 1)
                    if D > 1:
                        for name in per_draw:
                            values = probe.stacked(name).cpu()  # [B, L, H]
                            if name not in draws:
                                draws[name] = torch.full((P, K, D, *values.shape), float("nan"), dtype=torch.float64)
                            draws[name][p, j, d:] = values  # a policy that is not randomized: its one draw repeated
                    if d:
                        continue
                    logprobs[p, j] = last_logprobs(out.logits[:, -1, :])
                    kept_tokens[p, j] = kept.sum(-1).to(torch.float64).reshape(B, -1).mean(1).round().long().cpu()
                    L, H = probe.stacked("error").shape[1:]
                    drawn = design_records(kept if kept.dim() == 4 else kept[:, None, None, :],
                                           pi if pi.dim() == 4 else pi[:, None, None, :], share)  # name -> [B, L', Hkv']
                    for name in names:
                        values = probe.stacked(name).cpu() if name not in DESIGN_RECORDS else per_head(drawn[name], L, H).cpu()
                        if name in ("radius_eb", "radius_normal") and not hasattr(policy, "design"):
                            values = torch.full_like(values, float("nan"))
                        if name not in records:
                            records[name] = torch.full((P, K, *values.shape), float("nan"), dtype=torch.float64)
                        records[name][p, j] = values
    floor = torch.stack(probe.floor, dim=1).cpu()  # L x [B, H] -> [B, L, H]
    return BatchRecords(ref_lp, logprobs, records, kept_tokens, scores, floor, draws or None)
