"""Merging caches (:mod:`truncsens.policies.merging`) under ``streaming`` and ``prefill_evict``.

A merging cache holds at most k − 1 slots between queries. Each slot has a key and a value per layer
and key/value head (keys after the rotary embedding, as transformers caches them), and a count n of
the tokens it stands for; a query's attention logit on a slot gets ``log n`` (an additive bias in the
4D attention mask, 0 on unmerged tokens), so mask-only policies never come here. When the policy maps
the slots onto fewer (:class:`~truncsens.policies.merging.MergeStep`), each new slot's key and value
are the count-weighted means of its members' (:func:`merge_slots`), in float64, stored in the cache's dtype.

- ``streaming`` (:func:`stream_merging`): the prompt x[0..T-2] in chunks of C tokens, then the
  query x[T-1]; each chunk reads the cache (with its biases) and the chunk's earlier tokens, at their
  original positions; at each chunk end the policy merges the cache down to k − 1 slots.
- ``prefill_evict`` (:func:`prefill_merging`): the full prefill's cache of x[0..T-2] is merged down
  to k − 1 slots in one step, then x[T-1] is decoded against it.

Models with sliding-window layers, head granularity and reindexed positions are refused by the
semantics (a merged slot has no single position).
"""

from __future__ import annotations

import torch

from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs, model_dtype
from truncsens.policies.merging import MergePolicy, MergeView
from truncsens.policies.steps import chunk_bounds


def merge_slots(cache, dest: torch.Tensor, count: torch.Tensor, n_new: int) -> torch.Tensor:
    """Replace the cache's n slots by ``n_new``: slot i of every layer becomes the count-weighted mean
    of the old slots j with ``dest[b, j] == i``, keys and values alike (float64 sums; a slot of one
    member is copied unchanged, so only the merged slots are computed).

    Args:
        cache: a transformers cache of B sequences and n slots; dest: [B, n] int64 in 0..n_new − 1;
        count: [B, n] float64 tokens per old slot.

    Returns:
        [B, n_new] float64 counts of the new slots.
    """
    B, n = dest.shape
    device = dest.device
    new_count = torch.zeros(B, n_new, dtype=torch.float64, device=device).scatter_add_(1, dest, count)
    members = torch.zeros(B, n_new, dtype=torch.long, device=device).scatter_add_(1, dest, torch.ones_like(dest))
    order = torch.arange(n, device=device).expand(B, n)
    first = torch.full((B, n_new), n, dtype=torch.long, device=device).scatter_reduce_(1, dest, order, "amin")  # [B, n_new]
    multi = members.gather(1, dest) > 1  # [B, n] old slots of a merged group
    r = int(multi.sum(1).max()) if n else 0
    if r:
        idx = torch.argsort((~multi).to(torch.int8), dim=1, stable=True)[:, :r]  # [B, r] merged slots first
        weight = torch.where(multi.gather(1, idx), count.gather(1, idx), torch.zeros((), dtype=torch.float64))  # [B, r]
        into = dest.gather(1, idx)  # [B, r]
        merged = (members > 1).view(B, 1, n_new, 1)

    def new_slots(t: torch.Tensor) -> torch.Tensor:
        H, d = t.shape[1], t.shape[3]
        out = t.gather(2, first.view(B, 1, n_new, 1).expand(B, H, n_new, d))  # [B, H, n_new, d] copies
        if not r:
            return out
        part = t.gather(2, idx.view(B, 1, r, 1).expand(B, H, r, d)).double() * weight.view(B, 1, r, 1)
        num = torch.zeros(B, H, n_new, d, dtype=torch.float64, device=t.device)
        num.scatter_add_(2, into.view(B, 1, r, 1).expand(B, H, r, d), part)
        return torch.where(merged, (num / new_count.view(B, 1, n_new, 1)).to(t.dtype), out)

    for layer in range(kvcache.n_layers(cache)):
        k, v = kvcache.layer_kv(cache, layer)
        kvcache.set_layer_kv(cache, layer, new_slots(k), new_slots(v))
    return new_count


def slot_similarity(cache, victims: torch.Tensor) -> torch.Tensor:
    """[B, r, n] float32 cosine similarity of the keys of slots ``victims`` [B, r] with every slot's
    key, mean over layers and key/value heads."""
    total = None
    layers = kvcache.n_layers(cache)
    for layer in range(layers):
        k = torch.nn.functional.normalize(kvcache.layer_kv(cache, layer)[0].float(), dim=-1)  # [B, H, n, d]
        B, H, n, d = k.shape
        picked = k.gather(2, victims.view(B, 1, -1, 1).expand(B, H, victims.shape[1], d))  # [B, H, r, d]
        sim = (picked @ k.transpose(-1, -2)).mean(1)  # [B, r, n]
        total = sim if total is None else total + sim
    return total / layers


def _bias_mask(count: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, c, n + c] additive mask: ``log n`` on the n cache slots, causal within the c new tokens."""
    B, n = count.shape
    mask = torch.zeros(B, 1, c, n + c, dtype=torch.float32, device=count.device)
    mask[..., :n] = count.log().float().view(B, 1, 1, n)
    mask[..., n:] = torch.full((c, c), float("-inf"), device=count.device).triu(1)
    return mask.to(dtype)


def _step(cache, policy: MergePolicy, budget: int, anchor: torch.Tensor, count: torch.Tensor, end: int):
    """Merge the cache down to k − 1 slots when it holds more: (anchor [B, n'], count [B, n'])."""
    if anchor.shape[1] <= budget - 1:
        return anchor, count
    step = policy.merge(MergeView(anchor, count, budget, end, lambda v: slot_similarity(cache, v)))
    return step.anchor, merge_slots(cache, step.dest, count, step.anchor.shape[1])


def read_tokens(anchor: torch.Tensor, count: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] bool tokens the query reads unmerged (slots of count 1 holding their own token); merged
    tokens count as evicted (their keys are no longer read as themselves)."""
    B = anchor.shape[0]
    out = torch.zeros(B, T + 1, dtype=torch.bool, device=anchor.device)
    index = torch.where((count == 1) & (anchor >= 0), anchor, torch.full_like(anchor, T))
    return out.scatter_(1, index, True)[:, :T]


@torch.no_grad()
def stream_merging(model, input_ids: torch.Tensor, policy: MergePolicy, budget: int,
                   chunk: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a merging cache over ``input_ids`` [B, T] in chunks of ``chunk`` tokens (module docstring).

    Returns:
        (log-probabilities [B, V] float64 after the last token, [B, T] bool the target's query read
        unmerged, :func:`read_tokens`; its own token included).

    Raises:
        PolicyError: a bad budget or chunk.
    """
    B, T = input_ids.shape
    policy.check(budget, T)
    device, dtype = input_ids.device, model_dtype(model)
    cache, kw = kvcache.new_cache(model), kvcache.cache_keyword(model)
    anchor = torch.zeros(B, 0, dtype=torch.long, device=device)
    count = torch.zeros(B, 0, dtype=torch.float64, device=device)
    for s, e in chunk_bounds(T, chunk):
        c = e - s
        pos = torch.arange(s, e, device=device).expand(B, c)
        out = model(input_ids=input_ids[:, s:e], position_ids=pos, attention_mask=_bias_mask(count, c, dtype),
                    use_cache=True, logits_to_keep=1, **{kw: cache})
        anchor = torch.cat([anchor, pos], 1)
        count = torch.cat([count, torch.ones(B, c, dtype=torch.float64, device=device)], 1)
        if e == T:
            return last_logprobs(out.logits[:, -1, :]), read_tokens(anchor, count, T)
        anchor, count = _step(cache, policy, budget, anchor, count, e)
    raise AssertionError("unreachable: chunk_bounds ends at T")


@torch.no_grad()
def prefill_merging(model, input_ids: torch.Tensor, full_cache, policy: MergePolicy,
                    budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a copy of ``full_cache`` (the full prefill of x[0..T-2], left unchanged) down to k − 1
    slots, then decode x[T-1] at position T − 1 against it.

    Returns:
        (log-probabilities [B, V] float64, [B, T] bool tokens read unmerged, :func:`read_tokens`).

    Raises:
        PolicyError: a bad budget.
    """
    B, T = input_ids.shape
    policy.check(budget, T)
    device = input_ids.device
    layers = range(kvcache.n_layers(full_cache))
    cache = kvcache.cache_from(model, [kvcache.layer_kv(full_cache, l)[0][:, :, : T - 1] for l in layers],
                               [kvcache.layer_kv(full_cache, l)[1][:, :, : T - 1] for l in layers])
    anchor = torch.arange(T - 1, device=device).expand(B, T - 1)
    count = torch.ones(B, T - 1, dtype=torch.float64, device=device)
    anchor, count = _step(cache, policy, budget, anchor, count, T - 1)
    pos = torch.full((B, 1), T - 1, device=device)
    out = model(input_ids=input_ids[:, T - 1 :], position_ids=pos, attention_mask=_bias_mask(count, 1, model_dtype(model)),
                use_cache=True, logits_to_keep=1, **{kvcache.cache_keyword(model): cache})
    read = torch.cat([anchor, pos], 1), torch.cat([count, torch.ones(B, 1, dtype=torch.float64, device=device)], 1)
    return last_logprobs(out.logits[:, -1, :]), read_tokens(*read, T)
