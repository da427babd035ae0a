"""Certificates in a streaming cache: one sequential run per (policy, budget) in which every layer
and key/value head evicts as the stream goes, and the target's query (and, for a trajectory, every
step's query) records ô, V̂, the radii and the true error from that cache.

Streaming semantics (docs/method.md section 3): the context x[0..T-1] is processed in order, token
by token, with the cache of each token's own step; keys are never re-admitted and every score a
policy reads is one this run computed. The first k tokens (k: the budget) are processed in one
chunk, in which nothing is evicted: with chunk 1 a step evicts only once more than k - 1 keys are
cached, which first happens after token k - 1, so the chunk gives the same cache, scores and
outputs as k single steps.

Per layer l and key/value head h (the row ``(b·L + l)·Hkv + h``, seeds of
:func:`~truncsens.certificates.designs.layer_head_seeds`), the policy's own streaming rule
(:meth:`~truncsens.policies.base.Policy.evict`) decides after every token from a
:class:`~truncsens.policies.base.StreamView` of that row. For ``poisson`` the view's ``accumulated``
score is the design's online score of the head (:class:`~truncsens.certificates.designs.CertifyDesign`):

- ``window``: the attention the last W queries of this run paid to each key (summed over the
  group's query heads), the online counterpart of the prefill window score;
- ``h2o``: the attention every query so far paid to each key;
- ``key_norm``: each key's L2 norm;

tempered (score^γ) and raised by :data:`~truncsens.certificates.passes.SCORE_FLOOR` times the
mean over the row's cached keys. The attention a query "paid" is the run's own: its softmax over the
cached keys with their Hájek offsets. ``poisson`` thins its tail with known inclusion probabilities
(:mod:`truncsens.policies.poisson`, "Streaming"): the π a kept key carries is its inclusion
probability given the run, so the Hájek output, V̂ and the radius of
:func:`truncsens.certificates.estimator.attention_records` read the design as at prefill-evict.

Truth: o is the attention output of the same query over every key this run computed (the evicted
ones included: a simulation has them, a server does not); the error is ``‖ô − o‖₂`` per layer and
query head. Attention is computed in float64 and ô returned in the model's dtype, so layer l + 1
reads the evicted run.

Cost: the state is held for the live slots only, as a server holds its cache: per (layer, row) the n
slots of the keys still cached (n ≈ k; a ``poisson`` row may hold a few more, its budget holds in
expectation), each with its position, flags, π, uniform, scores and window ring; an evicted key's
slot is masked, and the slots are compacted once more than 32 are dead (amortized O(k)). A token step reads its keys and values from the run's key log at the slots'
positions (a gather of n keys), attends over them and the policy decides over them: O(k) work per
step, whatever the context. Only a recorded step reads every key computed, once, for the truth and
the records (one pass over the key log, which a simulation keeps and a server does not); the
per-position records (π when last decided, the design score, drawn flags) are written when a key is
evicted, so the design records need no per-step pass either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from truncsens.certificates.design_records import design_records, score_shares
from truncsens.certificates.designs import CertifyDesign, layer_head_seeds
from truncsens.certificates.estimator import attention_records
from truncsens.certificates.probe import SCORE_BLOCK
from truncsens.policies import Policy
from truncsens.policies.base import StreamView, uniforms
from truncsens.policies.live_stream import live_first

SCORE_FLOOR = 1e-6  # (as truncsens.certificates.passes.SCORE_FLOOR) added score, relative to the row's mean
STEP_RECORDS = ("error", "radius_eb", "radius_normal", "o_norm", "variance", "value_range", "n_random", "has_tail",
                "o_hat_norm", "kept_share", "tail_mass")
COMPACT_SLACK = 32  # dead slots a run keeps (masked) before it compacts its slots
SLOT_FIELDS = ("pos", "alive", "offset", "drawn", "pi", "last_pi", "u", "received", "window_sum", "score", "norm")


@dataclass
class StreamState:
    """The streaming cache of one run: B sequences, L layers, Hkv key/value heads, T positions, held
    for its live slots (module docstring, "Cost").

    Each per-slot tensor is [L, B·Hkv, S] (layer l, row ``b·Hkv + h``, S slots of which the first
    :attr:`n` are in use, in increasing position within each row; a row that caches fewer keys than
    others has dead slots, ``alive`` False).

    Attributes:
        policy, budget: the streaming rule and k (keys of a query, its own included; per head).
        design: the design whose online score ``poisson`` reads.
        delta: miss probability of the radii.
        n: slots in use.
        pos: int64 position of each slot's key; alive: bool key still cached; offset: float32 Hájek
            offsets; drawn: bool keys drawn at random; pi: float64 inclusion probability (1: certain);
            last_pi: float64 the π the key had when last decided; u: float64 its uniform.
        received: float32 attention each key received from every query so far (the h2o score);
            window: float32 [L, B·Hkv, W, S] the last W queries' attention rows (a ring, slot t mod W);
            window_sum: float32 their sum (the window score); score: float32 each key's design score
            when last decided; norm: float32 each key's L2 norm (the key_norm score).
        uniforms: float64 [L, B·Hkv, T] one uniform per key and row (:func:`~truncsens.certificates.designs.layer_head_seeds`).
        evicted_pi, evicted_score, evicted_drawn: [L, B·Hkv, T + 1] last_pi, score and drawn of every
            evicted key, written at its eviction (column T: a discard column), for the design records.
        record: whether the current step records; records: layer -> name (:data:`STEP_RECORDS`) ->
            [B, H] float64 of the last recorded step; step_terms: what every layer of this token step
            reads (:func:`_step_terms`), None until its first layer.
    """

    policy: Policy
    budget: int
    design: CertifyDesign
    delta: float
    n_layers: int
    n_kv: int
    T: int
    n: int
    slots: dict[str, torch.Tensor]
    window: torch.Tensor
    uniforms: torch.Tensor
    evicted_pi: torch.Tensor
    evicted_score: torch.Tensor
    evicted_drawn: torch.Tensor
    record: bool = False
    records: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    step_terms: dict[str, torch.Tensor] | None = None

    @classmethod
    def new(cls, policy: Policy, budget: int, design: CertifyDesign, delta: float, seeds: Sequence[int], n_layers: int,
            n_kv: int, T: int, device) -> "StreamState":
        """An empty cache for B = ``len(seeds)`` sequences of up to T tokens (one uniform per key and
        (sequence, layer, KV head) row from :func:`~truncsens.certificates.designs.layer_head_seeds`)."""
        R = len(seeds) * n_kv
        u = uniforms(layer_head_seeds(seeds, n_layers, n_kv), (T,), device)  # [B·L·Hkv, T], row (b·L + l)·Hkv + h
        u = u.view(len(seeds), n_layers, n_kv, T).transpose(0, 1).reshape(n_layers, R, T)  # [L, B·Hkv, T]
        S = budget + COMPACT_SLACK + 16
        return cls(policy, budget, design, delta, n_layers, n_kv, T, 0, _empty_slots(n_layers, R, S, device),
                   torch.zeros(n_layers, R, design.obs_window, S, device=device), u,
                   torch.ones(n_layers, R, T + 1, dtype=torch.float64, device=device),
                   torch.zeros(n_layers, R, T + 1, device=device),
                   torch.zeros(n_layers, R, T + 1, dtype=torch.bool, device=device))

    def __getattr__(self, name: str):  # the slot tensors by name: state.alive, state.pi, ...
        slots = self.__dict__.get("slots")
        if slots is not None and name in slots:
            return slots[name]
        raise AttributeError(name)

    def open(self, start: int, c: int) -> None:
        """New slots for the keys ``start .. start + c - 1`` (every layer and row), before their forward."""
        S = self.window.shape[-1]
        if self.n + c > S:  # grow: a poisson row held more keys than the others so far
            grow = max(self.n + c, 2 * S) - S
            for name, t in self.slots.items():
                self.slots[name] = torch.cat([t, torch.zeros(*t.shape[:2], grow, dtype=t.dtype, device=t.device)], -1)
            self.window = torch.cat([self.window, self.window.new_zeros(*self.window.shape[:3], grow)], -1)
        a, b = self.n, self.n + c
        s = self.slots
        s["pos"][:, :, a:b] = torch.arange(start, start + c, device=s["pos"].device)
        s["alive"][:, :, a:b] = True
        s["drawn"][:, :, a:b] = False
        for name in ("pi", "last_pi"):
            s[name][:, :, a:b] = 1.0
        for name in ("offset", "received", "window_sum", "score", "norm"):
            s[name][:, :, a:b] = 0.0
        s["u"][:, :, a:b] = self.uniforms[:, :, start : start + c]
        self.window[..., a:b] = 0.0
        self.n = b
        self.step_terms = None  # the next step's (:func:`_step_terms`)

    def design_scores(self) -> torch.Tensor:
        """[L, B·Hkv, n] float64 online design score of the slots' keys (module docstring), tempered
        and floored over each row's cached keys."""
        kind, n = self.design.score, self.n
        s = {"h2o": self.received, "window": self.window_sum}.get(kind, self.norm)[:, :, :n]
        s = self.design.tempered(s.to(torch.float64).clamp_min(0))
        alive = self.alive[:, :, :n]
        mean = (s * alive).sum(-1, keepdim=True) / alive.sum(-1, keepdim=True).clamp_min(1)  # [L, R, 1]
        return s + torch.where(mean > 0, SCORE_FLOOR * mean, torch.ones_like(mean))

    def add_attention(self, layer: int, probs: torch.Tensor, first: int) -> None:
        """Add the attention rows ``probs`` [B·Hkv, c, n] of ``layer`` over the n slots (queries
        ``first .. first + c - 1``, already summed over each KV head's query heads) to the h2o score
        and the window ring."""
        c, n = probs.shape[1], probs.shape[2]
        self.received[layer, :, :n] += probs.sum(1)
        W = self.window.shape[2]
        for i in range(max(0, c - W), c):  # only the last W rows can stay in the ring
            ring = self.window[layer, :, (first + i) % W, :n]  # [R, n] a view
            self.window_sum[layer, :, :n] -= ring
            ring.copy_(probs[:, i])
            self.window_sum[layer, :, :n] += ring

    def evict(self, end: int) -> None:
        """The policy's streaming step of every (layer, sequence, KV head) row after ``end`` tokens, in
        one call over the L·B·Hkv rows and their n slots (each row decides alone); evicted keys' records
        are written by position, and their slots dropped once more than :data:`COMPACT_SLACK` are dead.

        Raises:
            PolicyError: the policy's own refusals (scores all zero, ...) or a rule no cache could follow.
        """
        from truncsens.policies.streaming import check_step

        L, R, n = self.n_layers, self.alive.shape[1], self.n

        def flat(name: str) -> torch.Tensor:  # [L, R, S] -> [L·R, n] (a copy)
            return self.slots[name][:, :, :n].reshape(L * R, n)

        score = self.design_scores().reshape(L * R, n) if self.policy.needs_scores else None  # float64
        view = StreamView(flat("alive"), flat("offset"), flat("drawn"), self.budget, end, flat("u"),
                          accumulated=score, pi=flat("pi"), positions=flat("pos"))
        step = self.policy.evict(view)
        check_step(self.policy, self.budget, view, step)
        decided = step.pi.to(torch.float64) if step.pi is not None else step.keep.to(torch.float64)  # [L·R, n]
        last_pi = torch.where(view.alive, decided, flat("last_pi"))
        new_score = torch.where(view.alive, score.float(), flat("score")) if score is not None else flat("score")
        gone = torch.where(view.alive & ~step.keep, view.positions, self.T)  # [L·R, n] evicted keys' positions
        for record, value in ((self.evicted_pi, last_pi), (self.evicted_score, new_score),
                              (self.evicted_drawn, step.drawn)):
            record.view(L * R, -1).scatter_(1, gone, value)
        new = {"alive": step.keep, "last_pi": last_pi, "score": new_score, "drawn": step.drawn,
               "offset": torch.where(step.keep, step.offset.float(), torch.zeros_like(step.offset.float())),
               "pi": torch.where(step.keep, decided, torch.ones_like(decided))}
        for name, value in new.items():
            self.slots[name][:, :, :n] = value.view(L, R, n)
        m = int(step.keep.sum(-1).max())
        if n - m > COMPACT_SLACK:  # drop the dead slots (amortized: masked until then)
            self.compact()

    def compact(self) -> None:
        """Move each row's live slots to its first slots, in order, and drop the slots past the
        longest row's (:attr:`n` becomes the most keys a row caches)."""
        L, R, n = self.n_layers, self.alive.shape[1], self.n
        keep = self.alive[:, :, :n].reshape(L * R, n)
        m = int(keep.sum(-1).max())
        order = live_first(keep, m)  # [L·R, m] live slots first, in order
        for t in self.slots.values():
            t[:, :, :m] = t[:, :, :n].reshape(L * R, n).gather(1, order).view(L, R, m)
        self.alive[:, :, m:n] = False  # slots past the live ones are free
        W = self.window.shape[2]
        ring = self.window[..., :n].reshape(L * R, W, n).gather(2, order.unsqueeze(1).expand(L * R, W, m))
        self.window[..., :m] = ring.view(L, R, W, m)
        self.n = m

    def by_position(self, T: int) -> dict[str, torch.Tensor]:
        """The cache now by position, name -> [L, B·Hkv, T]: alive (bool), last_pi (float64; 1 on
        keys never decided), score (float32; 0 on keys never decided) and drawn (bool), every evicted
        key's from its eviction."""
        n = self.n
        at = torch.where(self.alive[:, :, :n], self.pos[:, :, :n], self.T)  # [L, R, n] live slots' positions
        out = {}
        for name, evicted in (("alive", torch.zeros_like(self.evicted_drawn)), ("last_pi", self.evicted_pi),
                              ("score", self.evicted_score), ("drawn", self.evicted_drawn)):
            out[name] = evicted.clone().scatter_(2, at, self.slots[name][:, :, :n])[:, :, :T]
        return out

    def design_records(self, B: int, T: int) -> dict[str, torch.Tensor]:
        """The server-side design records (:func:`~truncsens.certificates.design_records.design_records`)
        of the cache now, name -> [B, L, Hkv]: kept keys, each key's π when last decided (evicted
        keys: the π they had to stay; 0 for a deterministic policy) and the design score shares."""
        def by_target(t: torch.Tensor) -> torch.Tensor:  # [L, B·Hkv, T] -> [B, L, Hkv, T]
            return t.reshape(self.n_layers, B, self.n_kv, T).transpose(0, 1)

        now = self.by_position(T)
        shape = (B, self.n_layers, self.n_kv, T)
        share = score_shares(by_target(now["score"])) if self.policy.needs_scores else \
            torch.full(shape, 1.0 / T, dtype=torch.float64, device=self.alive.device)
        return design_records(by_target(now["alive"]), by_target(now["last_pi"]), share)

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """:func:`stream_attention` of this state (what the attention function calls)."""
        return stream_attention(self, module, query, key, value, scaling)


def _empty_slots(L: int, R: int, S: int, device) -> dict[str, torch.Tensor]:
    """The slot tensors of :class:`StreamState`, [L, R, S] each, zero."""
    dtypes = {"pos": torch.long, "alive": torch.bool, "drawn": torch.bool, "pi": torch.float64,
              "last_pi": torch.float64, "u": torch.float64}
    return {name: torch.zeros(L, R, S, dtype=dtypes.get(name, torch.float32), device=device) for name in SLOT_FIELDS}


def _group(t: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, H, ...] -> [B, Hkv, ...] summed over each key/value head's query heads."""
    B, H = t.shape[:2]
    return t.view(B, n_kv, H // n_kv, *t.shape[2:]).sum(2)


def _at_slots(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, n, d] the vectors of ``t`` [B, Hkv, end, d] at positions ``pos`` [B, Hkv, n]. Where each
    vector is contiguous (a view of the key log's buffer) the rows are copied whole (``index_select``
    on a [rows, d] view, several times faster than an element-wise ``gather``)."""
    B, H, end, d = t.shape
    s0, s1, s2, s3 = t.stride()
    if s3 != 1 or s2 != d or s0 % d or s1 % d:
        return t.gather(2, pos.unsqueeze(-1).expand(*pos.shape, d))
    rows = torch.as_strided(t, (((B - 1) * s0 + (H - 1) * s1) // d + end, d), (d, 1))  # [rows, d] a view
    first = (torch.arange(B, device=t.device) * (s0 // d)).view(B, 1, 1) + \
        (torch.arange(H, device=t.device) * (s1 // d)).view(1, H, 1)  # [B, H, 1] row of each (b, h)'s position 0
    return rows.index_select(0, (first + pos).reshape(-1)).view(*pos.shape, d)


def _step_terms(state: StreamState, B: int, n_kv: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What every layer of a token step reads, computed once for the L layers: ``alive`` [L, B, Hkv, 1, n]
    bool and ``off`` [L, B, Hkv, 1, n] the Hájek offsets log(π) of kept random keys (0 on certain
    ones) in the model's dtype."""
    L, n = state.n_layers, state.n
    alive = state.alive[:, :, :n].reshape(L, B, n_kv, 1, n)
    tail = state.drawn[:, :, :n].reshape(L, B, n_kv, 1, n) if state.policy.expected_budget else torch.zeros_like(alive)
    pi_kept = torch.where(alive & tail, state.pi[:, :, :n].reshape(L, B, n_kv, 1, n), 1.0)  # float64
    return {"alive": alive, "off": torch.log(pi_kept).to(dtype)}


def stream_attention(state: StreamState, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """One layer of the streaming run: query [B, H, c, d] against key/value [B, Hkv, end, d] (the key
    log: every key the run computed) -> ô [B, c, H, dv].

    A chunk (c > 1) is only the first one, with every key cached (slot i = position i): plain causal
    attention (in row blocks, float64). A step (c = 1) reads the keys of the live slots with their
    offsets (a gather of n keys, O(k)); a recording step (``state.record``) reads every key of the
    log for the truth and the records. The eviction after the token is :meth:`StreamState.evict`,
    once every layer ran.
    """
    B, H, c, _ = query.shape
    n_kv = key.shape[1]
    n_rep = H // n_kv
    end = key.shape[2]
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError("certify with semantics='streaming' (--semantics streaming) needs attention modules with a layer index (layer_idx)")
    first = end - c
    R, n = B * n_kv, state.n
    if state.design.score == "key_norm":  # the new keys' norms (fixed for their life)
        state.norm[layer, :, n - c : n] = key[:, :, first:end].float().norm(dim=-1).reshape(R, c)
    if c > 1:  # the first chunk: nothing evicted yet, slot i holds position i
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
            state.add_attention(layer, _group(p.float(), n_kv).reshape(R, b - a, end), first + a)  # [B·Hkv, b-a, end]
        return torch.cat(out, 2).transpose(1, 2).to(query.dtype)  # [B, H, c, dv] -> [B, c, H, dv]
    slot_pos = state.pos[layer, :, :n].reshape(B, n_kv, n)  # [B, Hkv, n]
    if state.step_terms is None:  # once per token step, for every layer
        state.step_terms = _step_terms(state, B, n_kv, query.dtype)
    alive, off = state.step_terms["alive"][layer], state.step_terms["off"][layer]  # [B, Hkv, 1, n] each
    if state.record:  # the certificate's records over the whole key log: float64, as at prefill-evict
        now = state.by_position(end)  # name -> [L, R, end]
        full = {name: now[name][layer].reshape(B, n_kv, end).repeat_interleave(n_rep, dim=1)
                for name in ("alive", "drawn")}  # [B, H, end] each
        full_pi = torch.ones(R, end + 1, dtype=torch.float64, device=query.device).scatter_(
            1, torch.where(state.alive[layer, :, :n], state.pos[layer, :, :n], end), state.pi[layer, :, :n])[:, :end]
        full_alive = full["alive"]
        full_tail = full["drawn"] if state.policy.expected_budget else torch.zeros_like(full_alive)
        full_pi = full_pi.reshape(B, n_kv, end).repeat_interleave(n_rep, dim=1)  # [B, H, end]
        full_pi_kept = torch.where(full_alive & full_tail, full_pi, torch.ones_like(full_pi))
        k = key.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, end, d]
        v = value.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, end, dv]
        logits = torch.matmul(query.to(torch.float64), k.transpose(-1, -2)).squeeze(2) * scaling  # [B, H, end]
        rec = attention_records(logits, v, torch.ones_like(full_alive), full_alive, full_pi_kept, full_tail, state.delta)
        state.records[layer] = {name: getattr(rec, name).to(torch.float64) for name in STEP_RECORDS}
        o_hat = rec.o_hat
        z = torch.where(full_alive, logits - torch.log(full_pi_kept), torch.full_like(logits, -math.inf))
        p_full = _group(torch.softmax(z, dim=-1).float(), n_kv)  # [B, Hkv, end]
        p = p_full.gather(2, slot_pos.clamp(max=end - 1)) * alive.squeeze(2)  # [B, Hkv, n]
    else:  # any other step: the run's own arithmetic (the model's dtype) over the live slots
        k, v = _at_slots(key, slot_pos), _at_slots(value, slot_pos)  # [B, Hkv, n, d], [B, Hkv, n, dv]
        qg = query.reshape(B, n_kv, n_rep, -1)  # [B, H, 1, d] -> [B, Hkv, G, d]
        logits = torch.matmul(qg, k.transpose(-1, -2)) * scaling  # [B, Hkv, G, n]
        z = torch.where(alive, logits - off, torch.full_like(logits, -math.inf))
        w = torch.softmax(z, dim=-1)  # [B, Hkv, G, n]
        o_hat = torch.matmul(w, v).view(B, H, -1)  # [B, Hkv, G, dv] -> [B, H, dv]
        p = w.float().sum(2)  # [B, Hkv, n]
    if end < state.T:  # the attention this query paid (the run's own), for the online scores
        state.add_attention(layer, p.reshape(R, 1, n), end - 1)  # [B·Hkv, 1, n]
    return o_hat.unsqueeze(1).to(query.dtype)  # [B, H, dv] -> [B, 1, H, dv]
