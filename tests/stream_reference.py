"""Today's streaming certify path before its state was compacted to the live slots, kept as the
reference the compacted engine is held to (tests/test_certify_streaming.py): every per-key tensor
spans all T positions, each step attends with a mask over every key computed and the policy decides
over every position. Slow (O(T) per token step) but plain; not an oracle (it shares the policies,
the estimator and the probe with the engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from truncsens.certificates.design_records import design_records, per_head, score_shares
from truncsens.certificates.probe import probed
from truncsens.certificates.designs import CertifyDesign, layer_head_seeds
from truncsens.certificates.estimator import attention_records
from truncsens.certificates.probe import SCORE_BLOCK
from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs
from truncsens.engine.reference_pass import head_counts
from truncsens.policies import Policy, PolicyError
from truncsens.policies.base import StreamView, uniforms

SCORE_FLOOR = 1e-6  # (as truncsens.certificates.passes.SCORE_FLOOR) added score, relative to the row's mean
STEP_RECORDS = ("error", "radius_eb", "radius_normal", "o_norm", "variance", "value_range", "n_random", "has_tail",
                "o_hat_norm", "kept_share", "tail_mass")


@dataclass
class StreamState:
    """The streaming cache of one run: B sequences, L layers, Hkv key/value heads, T positions.

    Each per-row tensor is [L, B·Hkv, T] (layer l, row ``b·Hkv + h``), so a layer's rows are a view.

    Attributes:
        policy, budget: the streaming rule and k (keys of a query, its own included; per head).
        design: the design whose online score ``poisson`` reads.
        delta: miss probability of the radii.
        alive: bool cached keys; offset: float32 Hájek offsets; drawn: bool keys drawn at random;
            pi: float64 inclusion probability of each cached key (1: certain).
        last_pi: float64 the inclusion probability each key had when last decided (kept or evicted;
            1 on keys never evicted): the π of the design records.
        uniforms: float64, one uniform per key and row.
        received: float32 attention each key received from every query so far (the h2o score).
        window: float32 [L, B·Hkv, W, T] the last W queries' attention rows (a ring, slot t mod W);
            window_sum: float32 [L, B·Hkv, T] their sum (the window score).
        score: float32 each key's design score when last decided (the design records' share).
        record: whether the current step records; records: layer -> name (:data:`STEP_RECORDS`) ->
            [B, H] float64 of the last recorded step.
    """

    policy: Policy
    budget: int
    design: CertifyDesign
    delta: float
    n_layers: int
    n_kv: int
    alive: torch.Tensor
    offset: torch.Tensor
    drawn: torch.Tensor
    pi: torch.Tensor
    last_pi: torch.Tensor
    uniforms: torch.Tensor
    received: torch.Tensor
    window: torch.Tensor
    window_sum: torch.Tensor
    score: torch.Tensor
    record: bool = False
    records: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def new(cls, policy: Policy, budget: int, design: CertifyDesign, delta: float, seeds: Sequence[int], n_layers: int,
            n_kv: int, T: int, device) -> "StreamState":
        """An empty cache for B = ``len(seeds)`` sequences of up to T tokens (one uniform per key and
        (sequence, layer, KV head) row from :func:`~truncsens.certificates.designs.layer_head_seeds`)."""
        R = len(seeds) * n_kv
        zeros = torch.zeros(n_layers, R, T, device=device)
        u = uniforms(layer_head_seeds(seeds, n_layers, n_kv), (T,), device)  # [B·L·Hkv, T], row (b·L + l)·Hkv + h
        u = u.view(len(seeds), n_layers, n_kv, T).transpose(0, 1).reshape(n_layers, R, T)  # [L, B·Hkv, T]
        return cls(policy, budget, design, delta, n_layers, n_kv,
                   alive=torch.zeros(n_layers, R, T, dtype=torch.bool, device=device), offset=zeros.clone(),
                   drawn=torch.zeros(n_layers, R, T, dtype=torch.bool, device=device),
                   pi=torch.ones(n_layers, R, T, dtype=torch.float64, device=device),
                   last_pi=torch.ones(n_layers, R, T, dtype=torch.float64, device=device), uniforms=u,
                   received=zeros.clone(), window=torch.zeros(n_layers, R, design.obs_window, T, device=device),
                   window_sum=zeros.clone(), score=zeros.clone())

    def design_scores(self, norms: torch.Tensor | None, end: int) -> torch.Tensor:
        """[L, B·Hkv, end] float64 online design score of keys 0..end-1 (module docstring), tempered
        and floored over each row's cached keys. ``norms``: [L, B·Hkv, end, d] the keys (``key_norm`` only)."""
        kind = self.design.score
        if kind == "h2o":
            s = self.received[:, :, :end]
        elif kind == "window":
            s = self.window_sum[:, :, :end]
        else:  # key_norm
            s = norms.float().norm(dim=-1)
        s = self.design.tempered(s.to(torch.float64).clamp_min(0))
        alive = self.alive[:, :, :end]
        mean = (s * alive).sum(-1, keepdim=True) / alive.sum(-1, keepdim=True).clamp_min(1)  # [L, R, 1]
        return s + torch.where(mean > 0, SCORE_FLOOR * mean, torch.ones_like(mean))

    def add_attention(self, layer: int, probs: torch.Tensor, first: int) -> None:
        """Add the attention rows ``probs`` [B·Hkv, c, end] of ``layer`` (queries ``first .. first + c - 1``,
        already summed over each KV head's query heads) to the h2o score and the window ring."""
        c, end = probs.shape[1], probs.shape[2]
        self.received[layer, :, :end] += probs.sum(1)
        W = self.window.shape[2]
        for i in range(max(0, c - W), c):  # only the last W rows can stay in the ring
            ring = self.window[layer, :, (first + i) % W]  # [R, T] a view
            self.window_sum[layer] -= ring
            ring.zero_()
            ring[:, :end] = probs[:, i]
            self.window_sum[layer] += ring

    def evict(self, keys: Sequence[torch.Tensor], end: int) -> None:
        """The policy's streaming step of every (layer, sequence, KV head) row after ``end`` tokens, in
        one call over the L·B·Hkv rows (each row decides alone, so one batched call equals L calls).

        Args:
            keys: L tensors [B, Hkv, end, d], each layer's keys (read for the ``key_norm`` score).

        Raises:
            PolicyError: the policy's own refusals (scores all zero, ...) or a rule no cache could follow.
        """
        from truncsens.policies.streaming import check_step

        L, R = self.n_layers, self.alive.shape[1]
        score = None
        if self.policy.needs_scores:
            norms = torch.stack([k.reshape(R, end, -1) for k in keys]) if self.design.score == "key_norm" else None
            score = self.design_scores(norms, end).reshape(L * R, end)  # [L·R, end] float64

        def flat(t: torch.Tensor) -> torch.Tensor:  # [L, R, T] -> [L·R, end] (a copy)
            return t[:, :, :end].reshape(L * R, end)

        view = StreamView(flat(self.alive), flat(self.offset), flat(self.drawn), self.budget, end, flat(self.uniforms),
                          accumulated=score, pi=flat(self.pi))
        step = self.policy.evict(view)
        check_step(self.policy, self.budget, view, step)
        decided = step.pi.to(torch.float64) if step.pi is not None else step.keep.to(torch.float64)  # [L·R, end]

        def put(t: torch.Tensor, value: torch.Tensor) -> None:
            t[:, :, :end] = value.view(L, R, end)

        put(self.last_pi, torch.where(view.alive, decided, flat(self.last_pi)))
        if score is not None:
            put(self.score, torch.where(view.alive, score.float(), flat(self.score)))
        put(self.alive, step.keep)
        put(self.offset, torch.where(step.keep, step.offset.float(), torch.zeros_like(step.offset.float())))
        put(self.drawn, step.drawn)
        put(self.pi, torch.where(step.keep, decided, torch.ones_like(decided)))

    def design_records(self, B: int, T: int) -> dict[str, torch.Tensor]:
        """The server-side design records (:func:`~truncsens.certificates.design_records.design_records`)
        of the cache now, name -> [B, L, Hkv]: kept keys, each key's π when last decided (evicted
        keys: the π they had to stay; 0 for a deterministic policy) and the design score shares."""
        def by_target(t: torch.Tensor) -> torch.Tensor:  # [L, B·Hkv, T] -> [B, L, Hkv, T]
            return t[:, :, :T].reshape(self.n_layers, B, self.n_kv, T).transpose(0, 1)

        shape = (B, self.n_layers, self.n_kv, T)
        share = score_shares(by_target(self.score)) if self.policy.needs_scores else \
            torch.full(shape, 1.0 / T, dtype=torch.float64, device=self.alive.device)
        return design_records(by_target(self.alive), by_target(self.last_pi), share)


    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """:func:`stream_attention` of this state (what the attention function calls)."""
        return stream_attention(self, module, query, key, value, scaling)


def _group(t: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, H, ...] -> [B, Hkv, ...] summed over each key/value head's query heads."""
    B, H = t.shape[:2]
    return t.view(B, n_kv, H // n_kv, *t.shape[2:]).sum(2)


def stream_attention(state: StreamState, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """One layer of the streaming run: query [B, H, c, d] of positions ``state.position ..`` against
    key/value [B, Hkv, end, d] (every key the run computed; the cache is never cut) -> ô [B, c, H, dv].

    A chunk (c > 1) is only the first one, with every key cached: plain causal attention (in row
    blocks, float64). A step (c = 1) reads the cached keys with their offsets, records when
    ``state.record``. The eviction after the token is :meth:`StreamState.evict`, once every layer ran.
    """
    B, H, c, _ = query.shape
    n_kv = key.shape[1]
    n_rep = H // n_kv
    end = key.shape[2]
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError("certify --semantics streaming needs attention modules with a layer index (layer_idx)")
    first = end - c
    T = state.alive.shape[-1]
    if c > 1:  # the first chunk: nothing evicted yet
        k = key.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, end, d]
        v = value.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, end, dv]
        out = []
        cols = torch.arange(end, device=query.device)
        for a in range(0, c, SCORE_BLOCK):
            b = min(c, a + SCORE_BLOCK)
            logits = torch.matmul(query[:, :, a:b].to(torch.float64), k.transpose(-1, -2)) * scaling  # [B, H, b-a, end]
            pos = torch.arange(first + a, first + b, device=query.device)
            logits = logits.masked_fill(cols.view(1, -1) > pos.view(-1, 1), -math.inf)
            p = torch.softmax(logits, dim=-1)  # [B, H, b-a, end]
            out.append(torch.matmul(p, v))  # [B, H, b-a, dv]
            state.add_attention(layer, _group(p.float(), n_kv).reshape(B * n_kv, b - a, end), first + a)  # [B·Hkv, b-a, end]
        state.alive[layer, :, first:end] = True
        return torch.cat(out, 2).transpose(1, 2).to(query.dtype)  # [B, H, c, dv] -> [B, c, H, dv]
    state.alive[layer, :, end - 1] = True

    def heads(t: torch.Tensor) -> torch.Tensor:  # [L, B·Hkv, T] -> [B, H, end] of this layer
        return t[layer, :, :end].reshape(B, n_kv, end).repeat_interleave(n_rep, dim=1)

    alive, pi = heads(state.alive), heads(state.pi)  # [B, H, end] each
    tail = heads(state.drawn) if state.policy.expected_budget else torch.zeros_like(alive)  # keys drawn at random
    pi_kept = torch.where(alive & tail, pi, torch.ones_like(pi))  # [B, H, end]
    if state.record:  # the certificate's records: float64, as at prefill-evict
        k = key.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, end, d]
        v = value.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, end, dv]
        logits = torch.matmul(query.to(torch.float64), k.transpose(-1, -2)).squeeze(2) * scaling  # [B, H, end]
        rec = attention_records(logits, v, torch.ones_like(alive), alive, pi_kept, tail, state.delta)
        state.records[layer] = {name: getattr(rec, name).to(torch.float64) for name in STEP_RECORDS}
        o_hat = rec.o_hat
        z = torch.where(alive, logits - torch.log(pi_kept), torch.full_like(logits, -math.inf))
        p = torch.softmax(z, dim=-1)  # [B, H, end]
    else:  # any other step: the run's own arithmetic (the model's dtype), per KV head group
        qg = query.reshape(B, n_kv, n_rep, -1)  # [B, H, 1, d] -> [B, Hkv, G, d]
        logits = torch.matmul(qg, key.transpose(-1, -2)) * scaling  # [B, Hkv, G, end]
        off = torch.log(pi_kept.view(B, n_kv, n_rep, end)).to(logits.dtype)  # [B, Hkv, G, end]
        z = torch.where(alive.view(B, n_kv, n_rep, end), logits - off, torch.full_like(logits, -math.inf))
        p = torch.softmax(z, dim=-1)  # [B, Hkv, G, end]
        o_hat = torch.matmul(p, value).view(B, H, -1)  # [B, Hkv, G, dv] -> [B, H, dv]
        p = p.view(B, H, end)
    if end < T:  # the attention this query paid (the run's own), for the online scores
        state.add_attention(layer, _group(p.float(), n_kv).reshape(B * n_kv, 1, end), end - 1)  # [B·Hkv, 1, end]
    return o_hat.unsqueeze(1).to(query.dtype)  # [B, H, dv] -> [B, 1, H, dv]


class StreamRun:
    """One streaming run's outputs: logprobs [B, V] float64 after its last token, records name ->
    [B, L, H] float64 of its recorded steps (one dict per step, in order), the final state and the
    greedy tokens it generated ([B, n] int64; n = 0 without generation)."""

    def __init__(self, logprobs, steps, state, generated):
        self.logprobs, self.steps, self.state, self.generated = logprobs, steps, state, generated


@torch.no_grad()
def reference_stream_run(model, input_ids: torch.Tensor, policy: Policy, budget: int, seeds: Sequence[int], delta: float,
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
    cache = kvcache.new_preallocated_cache(model, n_layers, T)  # one copy per new key, not per step
    kw = {kvcache.cache_keyword(model): cache}
    steps: list[dict[str, torch.Tensor]] = []
    generated = []
    logprobs = None

    def forward(ids: torch.Tensor, start: int, record: bool):
        state.record, state.records = record, {}
        pos = torch.arange(start, start + ids.shape[1], device=device).expand(B, -1)  # [B, c]
        out = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, certify_stream=state, **kw)
        end = start + ids.shape[1]
        if end < T:  # the cache's decision after this token (or the first chunk), every layer at once
            state.evict([kvcache.layer_kv(cache, layer)[0] for layer in range(n_layers)], end)
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


