"""Test oracles: the ground truth the engine is held to, written as plainly as possible.

They share no code with :mod:`truncsens.engine` (no batching, masks, cache helpers or kept-set
geometry of the engine): each runs the model one sequence at a time and reads the last row of the
full logits. The benchmarks time the engine against them too.
"""

from __future__ import annotations

import contextlib
import math
import inspect

import torch

from truncsens.divergences import all_metrics


def _cache_keyword(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _n_layers(cache) -> int:
    return len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)


@contextlib.contextmanager
def _eager(model, wanted: bool = True):
    """Run ``model`` with eager attention (attention weights returned) while inside, if ``wanted``."""
    before = model.config._attn_implementation
    if wanted:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _chunk_steps(T: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) of each streaming step: the prompt 0..T-2 in chunks of ``chunk``, then (T-1, T)."""
    prompt = T - 1
    return [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)] + [(prompt, T)]


def _mask_row(offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[k] offsets of the kept keys -> [1, 1, 1, k] additive mask."""
    return offsets.to(dtype).view(1, 1, 1, -1)


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float().double(), dim=-1)  # float64 from the float32 logits, as the engine


@torch.no_grad()
def last_logprobs(model, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Float64 log-probabilities after the last token of one sequence. ids, position_ids: [T] -> [V]."""
    out = model(input_ids=ids[None, :], position_ids=position_ids[None, :], attention_mask=torch.ones_like(ids)[None, :])
    return _logprobs(out.logits[0, -1])


@torch.no_grad()
def naive_pair(model, context: torch.Tensor, token_id: int, window: int, n_sink: int, positions: str) -> dict[str, float]:
    """All metrics for one target and one window (re-encode), from scratch at batch size 1.

    The kept context is the first ``n_sink`` tokens followed by the last ``window`` tokens of
    ``context`` [N]; ``positions`` "original" keeps their positions, "reindexed" numbers them 0..

    Returns:
        metric name -> float.
    """
    n = context.numel()
    ref = last_logprobs(model, context, torch.arange(n))  # [V]
    index = list(range(n_sink)) + list(range(n - window, n))
    pos = torch.tensor(index) if positions == "original" else torch.arange(len(index))
    lp = last_logprobs(model, context[index], pos)  # [V]
    metrics, _ = all_metrics(ref[None], lp[None], torch.tensor([token_id]))
    return {k: float(v[0]) for k, v in metrics.items()}


@torch.no_grad()
def streaming_loop(model, input_ids: torch.Tensor, keep: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Streaming semantics token by token, rebuilding the cache at every step.

    For each sequence and each step q: a fresh cache is built from the stored keys/values (of every
    layer) of the tokens kept for q, token q is run alone against it with position id q (and the
    offsets of its kept keys as a [1, 1, 1, k] mask), and its new keys/values are stored.

    Args:
        input_ids: [B, T]; keep: [B, T, T] bool (row q = keys kept for query q); offset: [B, T, T] or None.

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    rows = []
    for b in range(B):
        keys: list[torch.Tensor] = []  # per layer [1, H_kv, T, d]: row q holds token q's key once processed
        values: list[torch.Tensor] = []
        logits = None
        for q in range(T):
            earlier = keep[b, q, :q].nonzero().flatten()  # [k-1] kept earlier keys
            cache = _new_cache(model)
            if earlier.numel():
                for layer in range(len(keys)):
                    cache.update(keys[layer].index_select(2, earlier), values[layer].index_select(2, earlier), layer)
            cols = torch.cat([earlier, torch.tensor([q])])  # [k]
            off = offset[b, q, cols] if offset is not None else torch.zeros(cols.numel())
            out = model(input_ids=input_ids[b : b + 1, q : q + 1], position_ids=torch.tensor([[q]]),
                        attention_mask=_mask_row(off, dtype), use_cache=True, logits_to_keep=1, **{kw: cache})
            for layer in range(_n_layers(cache)):
                k_new, v_new = _layer_kv(cache, layer)  # [1, H_kv, k, d], the new token last
                if len(keys) <= layer:
                    keys.append(k_new.new_zeros(1, k_new.shape[1], T, k_new.shape[3]))
                    values.append(v_new.new_zeros(1, v_new.shape[1], T, v_new.shape[3]))
                keys[layer][:, :, q] = k_new[:, :, -1]
                values[layer][:, :, q] = v_new[:, :, -1]
            logits = out.logits[:, -1, :]
        rows.append(_logprobs(logits))
    return torch.cat(rows)  # [B, V]


@torch.no_grad()
def prefill_evict_surgery(model, input_ids: torch.Tensor, keep_last: torch.Tensor,
                          offset_last: torch.Tensor | None) -> torch.Tensor:
    """Prefill-evict by cache surgery: per sequence, full prefill of T - 1 tokens, keep only the kept
    keys/values of every layer (index_select into a new cache), then run the last token against it.

    Args:
        input_ids: [B, T]; keep_last: [B, T] bool keys kept for the last query; offset_last: [B, T] or None.

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    rows = []
    for b in range(B):
        full = _new_cache(model)
        ids = input_ids[b : b + 1]  # [1, T]
        model(input_ids=ids[:, : T - 1], position_ids=torch.arange(T - 1).unsqueeze(0),
              attention_mask=torch.ones_like(ids[:, : T - 1]), use_cache=True, logits_to_keep=1, **{kw: full})
        earlier = keep_last[b, : T - 1].nonzero().flatten()  # [k-1]
        pruned = _new_cache(model)
        for layer in range(_n_layers(full)):
            k, v = _layer_kv(full, layer)  # [1, H_kv, T-1, d]
            pruned.update(k.index_select(2, earlier), v.index_select(2, earlier), layer)
        cols = torch.cat([earlier, torch.tensor([T - 1])])  # [k]
        off = offset_last[b, cols] if offset_last is not None else torch.zeros(cols.numel())
        out = model(input_ids=ids[:, T - 1 :], position_ids=torch.tensor([[T - 1]]), attention_mask=_mask_row(off, dtype),
                    use_cache=True, logits_to_keep=1, **{kw: pruned})
        rows.append(_logprobs(out.logits[:, -1, :]))
    return torch.cat(rows)


@torch.no_grad()
def prefill_evict_one_pass(model, input_ids: torch.Tensor, keep_last: torch.Tensor,
                           offset_last: torch.Tensor | None) -> torch.Tensor:
    """Prefill-evict in one forward with a 4D mask: every row full causal except the last, which reads
    only its kept keys (earlier hidden states are then exactly the full-context ones).

    Args/Returns: as :func:`prefill_evict_surgery`.
    """
    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    keep = torch.ones(T, T, dtype=torch.bool).tril().repeat(B, 1, 1)  # [B, T, T]
    keep[:, -1, :] = keep_last
    mask = torch.zeros(B, T, T, dtype=dtype)
    if offset_last is not None:
        mask[:, -1, :] = offset_last.to(dtype)
    mask = mask.masked_fill(~keep, float("-inf")).unsqueeze(1)  # [B, 1, T, T]
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=torch.arange(T).expand(B, T), use_cache=False,
                logits_to_keep=1)
    return _logprobs(out.logits[:, -1, :])


def _window_mask_arg(offsets: dict[str, torch.Tensor], dtype: torch.dtype):
    """Layer type -> [k_t] offsets of the kept keys: one [1, 1, 1, k] mask when there is one type,
    else a dict layer type -> [1, 1, 1, k_t] mask."""
    masks = {t: _mask_row(off, dtype) for t, off in offsets.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


@torch.no_grad()
def windowed_streaming_loop(model, input_ids: torch.Tensor, keep: torch.Tensor, offset: torch.Tensor | None,
                            layer_types: list[str], windows: dict[str, int | None],
                            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Streaming semantics token by token for a model with a sliding window per layer type.

    As :func:`streaming_loop`, but the cache of layer l at step q holds only the kept earlier keys j
    with ``pos[q] - pos[j] < W`` (W the window of ``layer_types[l]``; all keys when None), selected
    by position from the stored keys; token q then reads them (mask: the offsets of its kept keys,
    one [1, 1, 1, k] tensor for a single layer type, else a dict layer type -> mask).

    Args:
        input_ids: [B, T]; keep: [B, T, T] bool; offset: [B, T, T] or None.
        layer_types: per layer, its type; windows: type -> window in tokens or None.
        position_ids: [T] positions (default 0..T-1); re-encoding with original positions passes
            the kept tokens' positions and a full causal ``keep``.

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    pos = torch.arange(T) if position_ids is None else position_ids
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    rows = []
    for b in range(B):
        keys: list[torch.Tensor] = []  # per layer [1, H_kv, T, d]
        values: list[torch.Tensor] = []
        logits = None
        for q in range(T):
            cache = _new_cache_full()
            offsets: dict[str, torch.Tensor] = {}
            for layer, kind in enumerate(layer_types):
                w = windows[kind]
                earlier = [j for j in range(q) if bool(keep[b, q, j]) and (w is None or int(pos[q] - pos[j]) < w)]
                cols = torch.tensor(earlier + [q], dtype=torch.long)
                offsets[kind] = offset[b, q, cols] if offset is not None else torch.zeros(cols.numel())
                if keys:
                    index = torch.tensor(earlier, dtype=torch.long)
                    cache.update(keys[layer].index_select(2, index), values[layer].index_select(2, index), layer)
            out = model(input_ids=input_ids[b : b + 1, q : q + 1], position_ids=pos[q].view(1, 1),
                        attention_mask=_window_mask_arg(offsets, dtype), use_cache=True, logits_to_keep=1, **{kw: cache})
            for layer in range(len(layer_types)):
                k_new, v_new = _layer_kv(cache, layer)  # [1, H_kv, k, d], the new token last
                if len(keys) <= layer:
                    keys.append(k_new.new_zeros(1, k_new.shape[1], T, k_new.shape[3]))
                    values.append(v_new.new_zeros(1, v_new.shape[1], T, v_new.shape[3]))
                keys[layer][:, :, q] = k_new[:, :, -1]
                values[layer][:, :, q] = v_new[:, :, -1]
            logits = out.logits[:, -1, :]
        rows.append(_logprobs(logits))
    return torch.cat(rows)  # [B, V]


def _new_cache_full():
    """A cache whose every layer keeps every key it is given (no sliding-window layers)."""
    from transformers import DynamicCache

    return DynamicCache()


@torch.no_grad()
def windowed_reencode(model, input_ids: torch.Tensor, index: torch.Tensor, layer_types: list[str],
                      windows: dict[str, int | None]) -> torch.Tensor:
    """Re-encoding with original positions for a windowed model: the kept tokens ``index`` [B, k]
    (increasing) are run token by token, each reading every earlier kept token within its layer's
    window on original positions (:func:`windowed_streaming_loop` with a full causal kept set).

    Returns:
        [B, V] float64 log-probabilities after the last kept token.
    """
    rows = []
    for b in range(input_ids.shape[0]):
        k = index.shape[1]
        keep = torch.ones(1, k, k, dtype=torch.bool).tril()
        rows.append(windowed_streaming_loop(model, input_ids[b : b + 1, index[b]], keep, None, layer_types, windows,
                                            position_ids=index[b]))
    return torch.cat(rows)


@torch.no_grad()
def windowed_prefill_evict(model, input_ids: torch.Tensor, keep_last: torch.Tensor, offset_last: torch.Tensor | None,
                           layer_types: list[str], windows: dict[str, int | None]) -> torch.Tensor:
    """Prefill-evict by cache surgery for a windowed model: per sequence, full prefill of T - 1 tokens
    into a cache that keeps every key, then per layer keep the kept keys j with ``T - 1 - j < W``
    (the layer's window) and run the last token against them.

    Args:
        input_ids: [B, T]; keep_last: [B, T] bool; offset_last: [B, T] or None;
        layer_types, windows: as :func:`windowed_streaming_loop`.

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    rows = []
    for b in range(B):
        full = _new_cache_full()
        ids = input_ids[b : b + 1]  # [1, T]
        model(input_ids=ids[:, : T - 1], position_ids=torch.arange(T - 1).unsqueeze(0),
              attention_mask=torch.ones_like(ids[:, : T - 1]), use_cache=True, logits_to_keep=1, **{kw: full})
        pruned = _new_cache_full()
        offsets: dict[str, torch.Tensor] = {}
        for layer, kind in enumerate(layer_types):
            w = windows[kind]
            earlier = [j for j in range(T - 1) if bool(keep_last[b, j]) and (w is None or T - 1 - j < w)]
            cols = torch.tensor(earlier + [T - 1], dtype=torch.long)
            offsets[kind] = offset_last[b, cols] if offset_last is not None else torch.zeros(cols.numel())
            k, v = _layer_kv(full, layer)  # [1, H_kv, T-1, d]
            index = torch.tensor(earlier, dtype=torch.long)
            pruned.update(k.index_select(2, index), v.index_select(2, index), layer)
        out = model(input_ids=ids[:, T - 1 :], position_ids=torch.tensor([[T - 1]]),
                    attention_mask=_window_mask_arg(offsets, dtype), use_cache=True, logits_to_keep=1, **{kw: pruned})
        rows.append(_logprobs(out.logits[:, -1, :]))
    return torch.cat(rows)


@torch.no_grad()
def evicting_loop(model, input_ids: torch.Tensor, policy, budget: int, seeds: list[int], chunk: int = 1):
    """A real streaming cache: per sequence, a transformers cache that physically drops the keys the
    policy evicts (index_select into a new cache), fed chunk by chunk.

    The prompt x[0..T-2] is fed in chunks of ``chunk`` tokens, then x[T-1] alone. Each chunk is one
    forward against the cache (offsets of the cached keys and a causal mask within the chunk, as a
    [1, 1, c, n + c] additive mask; ``output_attentions`` with eager attention when the policy reads
    attention). After each prompt chunk the oracle accumulates the policy's statistics itself (attention
    averaged over layers and heads, summed over queries; the newest query's row; key norms from the
    cache), asks ``policy.evict`` (the decision under test) and rebuilds the cache from the kept keys.

    Args:
        input_ids: [B, T]; policy: a policy with ``evict``; budget: k; seeds: one per sequence; chunk: C.

    Returns:
        (log-probabilities [B, V] float64 after the last token, evict [B, T] int64: the first query
        that no longer read each key, T if none).
    """
    from truncsens.policies.base import StreamView, uniforms

    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    kind = policy.score_kind()
    needs_attention = kind in ("attention", "last_attention")
    steps = _chunk_steps(T, chunk)
    rows, evicts = [], []
    with _eager(model, needs_attention):
        for b in range(B):
            cache = _new_cache(model)
            cached: list[int] = []  # positions held by the cache, increasing
            offsets, drawn = torch.zeros(T), torch.zeros(T, dtype=torch.bool)
            pi = torch.ones(T, dtype=torch.float64)  # inclusion probability of each cached key (thinning designs)
            acc, last, norms = torch.zeros(T), torch.zeros(T), torch.zeros(T)
            evict = torch.full((T,), T, dtype=torch.long)
            u = uniforms([seeds[b]], (T,), "cpu")  # [1, T]
            for s, e in steps:
                c, n = e - s, len(cached)
                mask = torch.zeros(c, n + c)
                mask[:, :n] = offsets[cached]
                mask[:, n:] = torch.full((c, c), float("-inf")).triu(1)
                out = model(input_ids=input_ids[b : b + 1, s:e], position_ids=torch.arange(s, e).unsqueeze(0),
                            attention_mask=mask.to(dtype).view(1, 1, c, n + c), use_cache=True,
                            output_attentions=needs_attention, **{kw: cache})
                if e == T:
                    rows.append(_logprobs(out.logits[0, -1]))
                    break
                cols = cached + list(range(s, e))
                if needs_attention:
                    att = torch.stack([a[0].float().mean(0) for a in out.attentions]).mean(0)  # [L, c, n+c] -> [c, n+c]
                    last = torch.zeros(T)
                    for i, col in enumerate(cols):
                        acc[col] += float(att[:, i].sum())
                        last[col] = att[-1, i]
                if kind == "key_norm":
                    per_layer = [_layer_kv(cache, l)[0][0, :, n:].float().norm(dim=-1).mean(0) for l in range(_n_layers(cache))]
                    norms[s:e] = torch.stack(per_layer).mean(0)  # [c]
                alive = torch.zeros(1, e, dtype=torch.bool)
                alive[0, cols] = True
                view = StreamView(alive, offsets[:e].unsqueeze(0).clone(), drawn[:e].unsqueeze(0).clone(), budget, e,
                                  u[:, :e], accumulated=acc[:e].unsqueeze(0).clone(), last=last[:e].unsqueeze(0).clone(),
                                  key_norm=norms[:e].unsqueeze(0).clone(), pi=pi[:e].unsqueeze(0).clone())
                step = policy.evict(view)
                keep = step.keep[0]
                if step.pi is not None:
                    pi[:e] = torch.where(keep, step.pi[0].double(), torch.ones(e, dtype=torch.float64))
                for j in cols:
                    if not keep[j]:
                        evict[j] = e
                offsets[:e] = torch.where(keep, step.offset[0].float(), torch.zeros(e))
                drawn[:e] = step.drawn[0]
                index = torch.tensor([i for i, j in enumerate(cols) if keep[j]], dtype=torch.long)
                pruned = _new_cache(model)
                for layer in range(_n_layers(cache)):
                    k, v = _layer_kv(cache, layer)  # [1, H_kv, n + c, d]
                    pruned.update(k.index_select(2, index), v.index_select(2, index), layer)
                cache, cached = pruned, [j for j in cols if keep[j]]
            evicts.append(evict)
    return torch.stack(rows), torch.stack(evicts)


def _heads(model) -> tuple[int, int]:
    """(query heads H, key/value heads Hkv) read from the config (Hkv = H without GQA)."""
    h = model.config.num_attention_heads
    return h, getattr(model.config, "num_key_value_heads", None) or h


def _kv_head_attention(attentions, kv: int) -> torch.Tensor:
    """Per-layer eager attentions [1, H, c, n] -> [Hkv, c, n]: for each key/value head h, the mean
    over layers of the mean over its query heads h·G .. h·G + G - 1."""
    per_layer = []
    for a in attentions:
        h = a.shape[1]
        g = h // kv
        per_layer.append(torch.stack([a[0, i * g : (i + 1) * g].float().mean(0) for i in range(kv)]))  # [Hkv, c, n]
    return torch.stack(per_layer).mean(0)


def _head_mask(offsets: torch.Tensor, visible: torch.Tensor, h: int, dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, c, n] offsets and visibility per key/value head -> [1, H, c, n] additive mask, query head
    i reading key/value head i // (H / Hkv), written head by head."""
    kv = offsets.shape[0]
    g = h // kv
    rows = []
    for i in range(h):
        rows.append(torch.where(visible[i // g], offsets[i // g], torch.full_like(offsets[i // g], float("-inf"))))
    return torch.stack(rows).unsqueeze(0).to(dtype)


@torch.no_grad()
def head_evicting_loop(model, input_ids: torch.Tensor, policy, budget: int, row_seeds: list[int], chunk: int = 1):
    """A streaming cache that evicts per key/value head, fed chunk by chunk (head granularity).

    Per sequence, one transformers cache holds every processed key; what each key/value head has
    evicted is masked out of that head with ``-inf`` (zero weight: a real per-head cache that dropped
    the key computes the same) by an explicit [1, H, c, n + c] mask, query head i reading key/value
    head i // G. After each prompt chunk the oracle computes the statistics itself, per key/value head
    (attention: mean over layers and the group's query heads, summed over queries, or the newest row;
    key norms: mean over layers), and asks ``policy.evict`` once for the Hkv heads of the sequence
    (one row each, uniforms from ``row_seeds[b·Hkv + h]``).

    Args:
        input_ids: [B, T]; policy; budget: k per head; row_seeds: B·Hkv seeds; chunk: C.

    Returns:
        (log-probabilities [B, V] float64 after the last token, evict [B, Hkv, T] int64).
    """
    from truncsens.policies.base import StreamView, uniforms

    B, T = input_ids.shape
    H, kv = _heads(model)
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    kind = policy.score_kind()
    needs_attention = kind in ("attention", "last_attention")
    steps = _chunk_steps(T, chunk)
    rows, evicts = [], []
    with _eager(model, needs_attention):
        for b in range(B):
            cache = _new_cache(model)
            alive = torch.zeros(kv, T, dtype=torch.bool)
            offsets, drawn = torch.zeros(kv, T), torch.zeros(kv, T, dtype=torch.bool)
            pi = torch.ones(kv, T, dtype=torch.float64)  # inclusion probability of each cached key (thinning designs)
            acc, last, norms = torch.zeros(kv, T), torch.zeros(kv, T), torch.zeros(kv, T)
            evict = torch.full((kv, T), T, dtype=torch.long)
            u = uniforms(row_seeds[b * kv : (b + 1) * kv], (T,), "cpu")  # [Hkv, T]
            for s, e in steps:
                c = e - s
                causal = torch.ones(c, e, dtype=torch.bool)
                causal[:, s:] = torch.ones(c, c, dtype=torch.bool).tril()
                visible = (alive[:, :e].clone().unsqueeze(1) | torch.zeros(kv, c, e, dtype=torch.bool))
                visible[:, :, s:] = True
                visible &= causal  # [Hkv, c, e]
                off = offsets[:, :e].unsqueeze(1).expand(kv, c, e)  # [Hkv, c, e]
                out = model(input_ids=input_ids[b : b + 1, s:e], position_ids=torch.arange(s, e).unsqueeze(0),
                            attention_mask=_head_mask(off, visible, H, dtype), use_cache=True,
                            output_attentions=needs_attention, **{kw: cache})
                if e == T:
                    rows.append(_logprobs(out.logits[0, -1]))
                    break
                alive[:, s:e] = True
                if needs_attention:
                    att = _kv_head_attention(out.attentions, kv)  # [Hkv, c, e]
                    acc[:, :e] += att.sum(1)
                    last = torch.zeros(kv, T)
                    last[:, :e] = att[:, -1]
                if kind == "key_norm":
                    per_layer = [_layer_kv(cache, l)[0][0, :, s:e].float().norm(dim=-1) for l in range(_n_layers(cache))]
                    norms[:, s:e] = torch.stack(per_layer).mean(0)  # [Hkv, c]
                view = StreamView(alive[:, :e].clone(), offsets[:, :e].clone(), drawn[:, :e].clone(), budget, e,
                                  u[:, :e], accumulated=acc[:, :e].clone(), last=last[:, :e].clone(),
                                  key_norm=norms[:, :e].clone(), pi=pi[:, :e].clone())
                step = policy.evict(view)
                if step.pi is not None:
                    pi[:, :e] = torch.where(step.keep, step.pi.double(), torch.ones(kv, e, dtype=torch.float64))
                for h in range(kv):
                    for j in range(e):
                        if alive[h, j] and not step.keep[h, j]:
                            evict[h, j] = e
                alive[:, :e] = step.keep
                offsets[:, :e] = torch.where(step.keep, step.offset.float(), torch.zeros(kv, e))
                drawn[:, :e] = step.drawn
            evicts.append(evict)
    return torch.stack(rows), torch.stack(evicts)


@torch.no_grad()
def head_statistics(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-context statistics per key/value head, one sequence at a time (eager attention).

    Returns:
        (attention [B, Hkv, T, T] float32: mean over layers and the group's query heads;
        key_norm [B, Hkv, T] float32: L2 norm of each key, mean over layers).
    """
    B, T = input_ids.shape
    _, kv = _heads(model)
    atts, norms = [], []
    with _eager(model):
        for b in range(B):
            cache = _new_cache(model)
            out = model(input_ids=input_ids[b : b + 1], position_ids=torch.arange(T).unsqueeze(0),
                        attention_mask=torch.ones(1, T, dtype=torch.long), use_cache=True, output_attentions=True,
                        **{_cache_keyword(model): cache})
            atts.append(_kv_head_attention(out.attentions, kv))  # [Hkv, T, T]
            norms.append(torch.stack([_layer_kv(cache, l)[0][0].float().norm(dim=-1)
                                      for l in range(_n_layers(cache))]).mean(0))  # [Hkv, T]
    return torch.stack(atts), torch.stack(norms)


@torch.no_grad()
def head_prefill_evict(model, input_ids: torch.Tensor, keep_last: torch.Tensor,
                       offset_last: torch.Tensor | None) -> torch.Tensor:
    """Prefill-evict per key/value head: per sequence, full prefill of T - 1 tokens, then the last token
    decoded against the full cache with an explicit [1, H, 1, T] mask, query head i reading the kept
    keys of key/value head i // G (and their offsets).

    Args:
        input_ids: [B, T]; keep_last: [B, Hkv, T] bool; offset_last: [B, Hkv, T] or None.

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    H, kv = _heads(model)
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    rows = []
    for b in range(B):
        cache = _new_cache(model)
        ids = input_ids[b : b + 1]
        model(input_ids=ids[:, : T - 1], position_ids=torch.arange(T - 1).unsqueeze(0),
              attention_mask=torch.ones_like(ids[:, : T - 1]), use_cache=True, logits_to_keep=1, **{kw: cache})
        off = offset_last[b] if offset_last is not None else torch.zeros(kv, T)  # [Hkv, T]
        mask = _head_mask(off.unsqueeze(1), keep_last[b].unsqueeze(1), H, dtype)  # [1, H, 1, T]
        out = model(input_ids=ids[:, T - 1 :], position_ids=torch.tensor([[T - 1]]), attention_mask=mask,
                    use_cache=True, logits_to_keep=1, **{kw: cache})
        rows.append(_logprobs(out.logits[:, -1, :]))
    return torch.cat(rows)


@torch.no_grad()
def head_prefill_evict_surgery(model, input_ids: torch.Tensor, keep_last: torch.Tensor) -> torch.Tensor:
    """Prefill-evict per key/value head by cache surgery (no mask mapping assumed): per sequence, full
    prefill of T - 1 tokens, then each KV head's cache keeps only its own kept keys and values
    (gathered head by head; keys carry their rotary positions already), and the last token is run
    against that cache. Every head must keep the same number of keys (deterministic policies).

    Args:
        input_ids: [B, T]; keep_last: [B, Hkv, T] bool, the same count in every head.

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    kw = _cache_keyword(model)
    rows = []
    for b in range(B):
        full = _new_cache(model)
        ids = input_ids[b : b + 1]
        model(input_ids=ids[:, : T - 1], position_ids=torch.arange(T - 1).unsqueeze(0),
              attention_mask=torch.ones_like(ids[:, : T - 1]), use_cache=True, logits_to_keep=1, **{kw: full})
        per_head = [keep_last[b, h, : T - 1].nonzero().flatten() for h in range(keep_last.shape[1])]
        if len({int(i.numel()) for i in per_head}) != 1:
            raise ValueError("head_prefill_evict_surgery needs the same kept count in every head")
        pruned = _new_cache(model)
        for layer in range(_n_layers(full)):
            k, v = _layer_kv(full, layer)  # [1, Hkv, T-1, d]
            ks = torch.stack([k[0, h].index_select(0, i) for h, i in enumerate(per_head)]).unsqueeze(0)
            vs = torch.stack([v[0, h].index_select(0, i) for h, i in enumerate(per_head)]).unsqueeze(0)
            pruned.update(ks, vs, layer)  # [1, Hkv, k-1, d] each
        n = per_head[0].numel() + 1
        out = model(input_ids=ids[:, T - 1 :], position_ids=torch.tensor([[T - 1]]),
                    attention_mask=torch.zeros(1, 1, 1, n, dtype=next(model.parameters()).dtype), use_cache=True,
                    logits_to_keep=1, **{kw: pruned})
        rows.append(_logprobs(out.logits[:, -1, :]))
    return torch.cat(rows)


@torch.no_grad()
def layer_head_prefill_evict(model, input_ids: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Prefill-evict with a kept set per layer and key/value head, written for caches that cannot be
    cut per head (multi-head latent attention caches one latent per position for every head): per
    sequence, full prefill of T - 1 tokens, then the last token decoded against the full cache while a
    forward pre-hook on each layer's attention module (``layer_idx``) swaps its ``attention_mask`` for
    an explicit [1, H, 1, T] mask, query head i of layer l reading the keys ``heads[l, b, i // G]`` and
    its own (``-inf`` elsewhere).

    Args:
        input_ids: [B, T]; heads: [L, B, Hkv, n] int64 kept prefix positions (in 0 .. T - 2).

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    H, kv = _heads(model)
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    modules = {}
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int) and type(module).__name__.endswith("Attention"):
            modules.setdefault(module.layer_idx, module)
    assert sorted(modules) == list(range(heads.shape[0])), sorted(modules)
    rows = []
    for b in range(B):
        cache = _new_cache(model)
        ids = input_ids[b : b + 1]
        model(input_ids=ids[:, : T - 1], position_ids=torch.arange(T - 1).unsqueeze(0),
              attention_mask=torch.ones_like(ids[:, : T - 1]), use_cache=True, logits_to_keep=1, **{kw: cache})
        calls = []
        handles = []
        for layer, module in modules.items():
            visible = torch.zeros(kv, 1, T, dtype=torch.bool)
            for h in range(kv):
                for j in heads[layer, b, h].tolist():
                    visible[h, 0, j] = True
                visible[h, 0, T - 1] = True
            mask = _head_mask(torch.zeros(kv, 1, T), visible, H, dtype)  # [1, H, 1, T]

            def swap(mod, args, kwargs, mask=mask, layer=layer):
                assert "attention_mask" in kwargs, f"layer {layer} is called without an attention_mask keyword"
                calls.append(layer)
                return args, {**kwargs, "attention_mask": mask}

            handles.append(module.register_forward_pre_hook(swap, with_kwargs=True))
        try:
            out = model(input_ids=ids[:, T - 1 :], position_ids=torch.tensor([[T - 1]]),
                        attention_mask=torch.zeros(1, 1, 1, T, dtype=dtype), use_cache=True, logits_to_keep=1,
                        **{kw: cache})
        finally:
            for handle in handles:
                handle.remove()
        assert sorted(calls) == sorted(modules), calls
        rows.append(_logprobs(out.logits[:, -1, :]))
    return torch.cat(rows)


def _merge_rule(slots: list[list[int]], keys: list[torch.Tensor], rule: str, budget: int, n_sink: int,
                n_summary: int) -> list[list[int]]:
    """One merging step on plain lists: ``slots`` (cache order) are lists of the token positions each
    slot stands for; ``keys[layer]`` [H_kv, T, d] every token's key. Returns at most budget - 1 slots."""
    slots = [list(m) for m in slots]
    target = budget - 1

    def is_sink(m):
        return len(m) == 1 and m[0] < n_sink

    def key(m, layer):  # [H_kv, d] the slot's key: the mean of its tokens' keys
        return keys[layer][:, m].float().mean(1)

    if rule == "mean":
        sinks = sum(1 for m in slots if is_sink(m))
        recent = max(0, target - sinks - n_summary)
        old_end = len(slots) - recent
        while len(slots) > target:
            best = None
            for i in range(sinks, old_end - 1):
                total = len(slots[i]) + len(slots[i + 1])
                if best is None or total < best[0]:
                    best = (total, i)
            i = best[1]
            slots[i : i + 2] = [slots[i] + slots[i + 1]]
            old_end -= 1
        return slots
    r = len(slots) - target
    if r <= 0:
        return slots
    victims = [i for i, m in enumerate(slots) if not is_sink(m)][:r]
    survivors = [i for i in range(len(slots)) if i not in victims]
    joined = {i: [] for i in survivors}
    for v in victims:
        best = None
        for i in survivors:
            if is_sink(slots[i]):
                continue
            sims = [torch.nn.functional.cosine_similarity(key(slots[v], l), key(slots[i], l), dim=-1).mean()
                    for l in range(len(keys))]
            sim = float(sum(sims) / len(sims))
            if best is None or sim >= best[0]:  # ties: the newer slot
                best = (sim, i)
        joined[best[1]] += slots[v]
    return [slots[i] + joined[i] for i in survivors]


def _slot_cache(model, slots: list[list[int]], keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A fresh cache of one sequence whose slot s holds the mean key and value of the tokens slots[s]."""
    cache = _new_cache(model)
    for layer in range(len(keys)):
        k = torch.stack([keys[layer][:, m].double().mean(1) for m in slots], 1).to(keys[layer].dtype)  # [H, n, d]
        v = torch.stack([values[layer][:, m].double().mean(1) for m in slots], 1).to(values[layer].dtype)
        cache.update(k.unsqueeze(0), v.unsqueeze(0), layer)
    return cache


@torch.no_grad()
def merging_loop(model, input_ids: torch.Tensor, rule: str, budget: int, n_sink: int, n_summary: int = 1,
                 chunk: int = 1, semantics: str = "streaming") -> torch.Tensor:
    """A k-slot merging cache, one sequence at a time, the cache rebuilt from plain lists at every step.

    Each slot is the list of token positions it stands for; its key and value are the means of those
    tokens' keys and values (keys as cached, after the rotary embedding) and its logit gets
    log(len(slot)). ``rule`` "mean": sinks, ``n_summary`` summaries and recent tokens, the old region
    merged by adjacent pairs of fewest tokens (oldest first); "nearest": the oldest non-sink slots
    merged into the non-sink survivor of most similar key (cosine, mean over layers and heads, the
    survivors' keys before the step). ``streaming``: chunks of ``chunk`` tokens, merging down to
    budget - 1 slots after each prompt chunk; ``prefill_evict``: a full prefill of x[0..T-2], one
    merge, then x[T-1] decoded.

    Returns:
        [B, V] float64 log-probabilities after the last token.
    """
    B, T = input_ids.shape
    dtype = next(model.parameters()).dtype
    kw = _cache_keyword(model)
    steps = _chunk_steps(T, chunk) if semantics == "streaming" else [(0, T - 1), (T - 1, T)]
    rows = []
    for b in range(B):
        keys: list[torch.Tensor] = []  # per layer [H_kv, T, d]: column q holds token q's key once computed
        values: list[torch.Tensor] = []
        slots: list[list[int]] = []
        for s, e in steps:
            c, n = e - s, len(slots)
            cache = _slot_cache(model, slots, keys, values) if slots else _new_cache(model)
            mask = torch.zeros(c, n + c)
            mask[:, :n] = torch.tensor([math.log(len(m)) for m in slots])
            mask[:, n:] = torch.full((c, c), float("-inf")).triu(1)
            out = model(input_ids=input_ids[b : b + 1, s:e], position_ids=torch.arange(s, e).unsqueeze(0),
                        attention_mask=mask.to(dtype).view(1, 1, c, n + c), use_cache=True, **{kw: cache})
            if e == T:
                rows.append(_logprobs(out.logits[0, -1]))
                break
            for layer in range(_n_layers(cache)):
                k_new, v_new = _layer_kv(cache, layer)  # [1, H_kv, n + c, d], the chunk last
                if len(keys) <= layer:
                    keys.append(k_new.new_zeros(k_new.shape[1], T, k_new.shape[3]))
                    values.append(v_new.new_zeros(v_new.shape[1], T, v_new.shape[3]))
                keys[layer][:, s:e] = k_new[0, :, n:]
                values[layer][:, s:e] = v_new[0, :, n:]
            slots = slots + [[j] for j in range(s, e)]
            if len(slots) > budget - 1:
                slots = _merge_rule(slots, keys, rule, budget, n_sink, n_summary)
    return torch.stack(rows)
