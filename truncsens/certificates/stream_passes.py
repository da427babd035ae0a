"""The passes of one batch of targets under streaming: the full-cache reference (the same probed
prefill and decode as at prefill-evict, :func:`truncsens.certificates.passes.full_cache_pass`) and
one streaming run per (policy, budget), each recording the target query's certificates from its
own cache (:mod:`truncsens.certificates.stream_probe`).

The records have the layout of :class:`~truncsens.certificates.passes.BatchRecords`, so the
results files, coverage summaries and attribution reports of ``certify`` and ``certify-attribution``
read a streaming run as they read a prefill-evict one. The difference is the process simulated,
recorded in the attrs: each record of a streaming run comes from a cache that evicted as the stream
went, per layer and key/value head.
"""

from __future__ import annotations

from typing import Sequence

import torch

from truncsens.certificates.design_records import DESIGN_RECORDS, per_head
from truncsens.certificates.designs import CertifyDesign
from truncsens.certificates.passes import PROBE_RECORDS, RECORDS, BatchRecords, full_cache_pass
from truncsens.certificates.probe import probed
from truncsens.certificates.stream_probe import StreamState
from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs
from truncsens.engine.reference_pass import head_counts
from truncsens.policies import Policy, PolicyError


class StreamRun:
    """One streaming run's outputs: logprobs [B, V] float64 after its last token, records name ->
    [B, L, H] float64 of its recorded steps (one dict per step, in order), the final state and the
    greedy tokens it generated ([B, n] int64; n = 0 without generation)."""

    def __init__(self, logprobs, steps, state, generated):
        self.logprobs, self.steps, self.state, self.generated = logprobs, steps, state, generated


@torch.no_grad()
def stream_run(model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int], delta: float,
               design: CertifyDesign = CertifyDesign(), generate: int = 0) -> StreamRun:
    """Stream ``input_ids`` [B, T0] through ``model`` with a cache that evicts under ``policy`` at
    ``budget`` per layer and key/value head, recording the certificates of the last token's query;
    with ``generate`` = n > 0, continue greedily for n − 1 more steps (the top-1 token of the evicted
    run), recording every step: n records, n generated tokens.

    Args:
        model: a causal LM the certify probe accepts (:func:`~truncsens.certificates.probe.check_model`).
        input_ids: [B, T0] int64, T0 > budget; seeds: B seeds (one draw per sequence).
        delta: miss probability of the radii.

    Returns:
        :class:`StreamRun`.

    Raises:
        PolicyError: a budget at or above T0, or the policy's refusals.
        NonFiniteLogitsError: NaN or infinite logits.
    """
    B, T0 = input_ids.shape
    if budget >= T0:
        raise PolicyError(f"budget {budget} is at or above the context of {T0} tokens: nothing would be evicted")
    policy.check(budget, T0)
    n_steps = max(1, generate)
    T = T0 + n_steps - 1  # positions the run processes
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers, n_kv = int(config.num_hidden_layers), head_counts(model)[1]
    device = input_ids.device
    state = StreamState.new(policy, budget, design, delta, seeds, n_layers, n_kv, T, device)
    cache = kvcache.new_preallocated_cache(model, n_layers, T)  # the key log: one copy per new key, read at the slots
    kw = {kvcache.cache_keyword(model): cache}
    steps: list[dict[str, torch.Tensor]] = []
    generated = []
    logprobs = None

    def forward(ids: torch.Tensor, start: int, record: bool):
        state.record, state.records = record, {}
        state.open(start, ids.shape[1])
        pos = torch.arange(start, start + ids.shape[1], device=device).expand(B, -1)  # [B, c]
        out = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, certify_stream=state, **kw)
        end = start + ids.shape[1]
        if end < T:  # the cache's decision after this token (or the first chunk), every layer at once
            state.evict(end)
        if record:
            steps.append({name: torch.stack([state.records[layer][name] for layer in sorted(state.records)], 1)
                          for name in state.records[min(state.records)]})  # name -> [B, L, H]
        return last_logprobs(out.logits[:, -1, :])  # [B, V]

    with probed(model):
        forward(input_ids[:, :budget], 0, False)  # nothing is evicted before the budget is reached
        for t in range(budget, T0):
            logprobs = forward(input_ids[:, t : t + 1], t, t == T0 - 1)
        for t in range(T0, T):
            nxt = logprobs.argmax(-1, keepdim=True)  # [B, 1]
            generated.append(nxt)
            logprobs = forward(nxt, t, True)
    if generate:
        generated.append(logprobs.argmax(-1, keepdim=True))
    return StreamRun(logprobs, steps, state, torch.cat(generated, 1) if generated else torch.zeros(B, 0, dtype=torch.long))


def kept_per_sequence(alive: torch.Tensor, B: int) -> torch.Tensor:
    """Keys a sequence's cache holds, per head: ``alive`` [L, B·Hkv, T] (row ``b·Hkv + h`` of each
    layer, as :meth:`~truncsens.certificates.stream_probe.StreamState.by_position` gives it) -> [B] long, the
    mean over the L·Hkv (layer, key/value head) caches of sequence b, rounded."""
    L, R, T = alive.shape
    per_head = alive.view(L, B, R // B, T).sum(-1)  # [L, B·Hkv, T] -> [L, B, Hkv, T] -> [L, B, Hkv]
    return per_head.to(torch.float64).mean((0, 2)).round().long()  # [B]


@torch.no_grad()
def certify_stream_batch(model, input_ids: torch.Tensor, policies: Sequence[Policy], budgets: Sequence[int],
                         seeds: Sequence[Sequence[Sequence[int]]], delta: float,
                         design: CertifyDesign = CertifyDesign()) -> BatchRecords:
    """All passes of B targets under streaming: what :func:`~truncsens.certificates.passes.certify_batch`
    returns at prefill-evict, with each (policy, budget) a streaming run (:func:`stream_run`).

    Args:
        model, input_ids [B, T], policies (P), budgets (K, each < T), seeds (seeds[p][j]: B seeds),
            delta, design: as :func:`~truncsens.certificates.passes.certify_batch`; the design is read
            per layer and key/value head, online.

    Returns:
        :class:`~truncsens.certificates.passes.BatchRecords`; ``scores`` is the full-cache attention
        each key received (as at prefill-evict); radii NaN for policies without a random design.

    Raises:
        PolicyError: a policy refuses a budget or its scores.
    """
    B, T = input_ids.shape
    with probed(model):
        probe, _, heads, ref_lp = full_cache_pass(model, input_ids, delta, design)
    L, H = len(probe.floor), probe.floor[0].shape[1]
    P, K = len(policies), len(budgets)
    logprobs = torch.empty(P, K, B, ref_lp.shape[-1], dtype=torch.float64, device=input_ids.device)
    kept_tokens = torch.zeros(P, K, B, dtype=torch.long)
    records = {name: torch.full((P, K, B, L, H), float("nan"), dtype=torch.float64) for name in RECORDS}
    for p, policy in enumerate(policies):
        for j, k in enumerate(budgets):
            run = stream_run(model, input_ids, policy, k, seeds[p][j], delta, design)
            logprobs[p, j] = run.logprobs
            kept_tokens[p, j] = kept_per_sequence(run.state.by_position(T)["alive"], B).cpu()
            drawn = run.state.design_records(B, T)  # name -> [B, L, Hkv]
            for name in PROBE_RECORDS:
                values = run.steps[-1][name].cpu()
                if name in ("radius_eb", "radius_normal") and not policy.expected_budget:
                    values = torch.full_like(values, float("nan"))
                records[name][p, j] = values
            for name in DESIGN_RECORDS:
                records[name][p, j] = per_head(drawn[name], L, H).cpu()
    floor = torch.stack(probe.floor, dim=1).cpu()  # L x [B, H] -> [B, L, H]
    return BatchRecords(ref_lp, logprobs, records, kept_tokens, probe.received / heads, floor)
