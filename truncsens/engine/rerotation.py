"""Decode the target's query against a kept cache gathered per layer and head, optionally with the
kept keys re-rotated to consecutive positions (``prefill_evict`` with ``--positions reindexed``).

Key re-rotation (RoPE, J. Su et al., arXiv 2104.09864): a cached key at position p is stored rotated,
``k_p = R(p) k`` where R(p) rotates each pair of dimensions (i, i + r/2) by the angle ``p θ_i``,
``θ_i = inv_freq[i]`` (the ``rotate_half`` convention of Llama-like models, the first r dimensions
of a head where the rotary part is partial). Since ``R(p') = R(p' - p) R(p)``, the key moves to
position p' by one more rotation of angle ``(p' - p) θ_i``, without recomputing it. Re-indexed, the
i-th kept key of a head (in increasing original position) moves to position i, and the query, after
``n`` kept keys, is decoded at position ``n`` (budget k = n + 1: positions 0..k-2 and k-1). This is
what NVIDIA kvpress's ``KeyRerotationPress`` does after a press evicts (and StreamingLLM's cache,
arXiv 2309.17453, section 3.2); a rotary scaling factor (YaRN's ``attention_scaling``) multiplies
both the stored key and the re-rotated one, so the pure rotation by ``inv_freq`` is exact.

Kept sets come either per token (:class:`~truncsens.policies.base.Kept`, one set for every layer and
head, possibly of different sizes per row: padded and masked) or per layer and key/value head
(:class:`~truncsens.policies.kept.HeadKept`, the same number per head, as score-based presses keep).
A cache that holds fewer heads than the kept sets name (multi-head latent attention, DeepSeek-V2/V3:
one compressed latent per position, from which every head's keys and values are expanded) cannot be
gathered per head: its per-layer, per-head kept sets are applied instead as masks over the full cache,
one [B, H, 1, T] mask per layer (:func:`decode_head_masks`), query head ``h·G + i`` reading the kept
keys of head h, which is what a per-head cache of those keys computes.
"""

from __future__ import annotations

import torch

from truncsens.engine import kvcache
from truncsens.engine.forward import last_logprobs, model_dtype
from truncsens.engine.layer_masks import decode_with_layer_masks
from truncsens.engine.masks import additive_mask, masked_value
from truncsens.engine.reference_pass import head_counts
from truncsens.policies.kept import HeadKept, Kept  # (HeadKept: plain data of the policies, imported from here too)

# rotary types whose inv_freq depends on the sequence length (a key's rotation is not R(p) for a fixed inv_freq)
DYNAMIC_ROPE = ("dynamic", "longrope")


class RotaryError(ValueError):
    """Keys of this model cannot be re-rotated (no rotary embedding, or one that changes with length)."""


def rope_inv_freq(model) -> torch.Tensor:
    """[r/2] float32 inverse frequencies θ_i of the model's rotary embedding (r: rotary dimensions).

    Raises:
        RotaryError: no rotary embedding module with ``inv_freq`` (e.g. GPT-2's learned positions),
            several different ones (per-layer-type rotaries), a rotary type whose frequencies
            change with the sequence length (:data:`DYNAMIC_ROPE`), or multi-head latent attention
            (config ``kv_lora_rank``: DeepSeek-V2/V3 cache a compressed latent and a separate rotary
            key part, not rotated keys).
    """
    what = type(model).__name__
    if getattr(getattr(model, "config", None), "kv_lora_rank", None) is not None:
        raise RotaryError(f"key re-rotation (positions='reindexed', --positions reindexed, under prefill_evict) rotates cached keys; {what} "
                          "uses multi-head latent attention (kv_lora_rank) and caches a compressed latent instead; "
                          "use --positions original")
    found = {id(m): m for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] == "rotary_emb" and isinstance(getattr(m, "inv_freq", None), torch.Tensor)}
    if not found:
        raise RotaryError(f"key re-rotation (positions='reindexed', --positions reindexed, under prefill_evict) needs a RoPE model; {what} has "
                          "no rotary embedding (rotary_emb.inv_freq); use --positions original")
    mods = list(found.values())
    if any(m.inv_freq.shape != mods[0].inv_freq.shape or not torch.equal(m.inv_freq, mods[0].inv_freq) for m in mods):
        raise RotaryError(f"{what} has {len(mods)} different rotary embeddings; key re-rotation supports one")
    kind = getattr(mods[0], "rope_type", "default")
    if kind in DYNAMIC_ROPE:
        raise RotaryError(f"{what} uses {kind} rotary scaling, whose frequencies change with the sequence length; "
                          "key re-rotation needs fixed frequencies (use --positions original)")
    return mods[0].inv_freq.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., r] -> [..., r]: (x1, x2) -> (-x2, x1) on the two halves (the Llama convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE-encoded keys by ``delta`` positions: ``R(delta) k``.

    Args:
        keys: [..., n, d] keys already rotated to their positions.
        delta: [..., n] integer position shifts (new - old), broadcastable to ``keys[..., 0]``.
        inv_freq: [r/2] inverse frequencies (:func:`rope_inv_freq`), r <= d.

    Returns:
        [..., n, d] keys of the same dtype; dimensions beyond r (partial rotary) unchanged.
    """
    r = 2 * inv_freq.numel()
    work = torch.promote_types(keys.dtype, torch.float32)
    freqs = delta.to(work).unsqueeze(-1) * inv_freq.to(device=keys.device, dtype=work)  # [..., n, r/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., n, r]
    rot = keys[..., :r].to(work)
    out = rot * emb.cos() + rotate_half(rot) * emb.sin()
    return torch.cat((out.to(keys.dtype), keys[..., r:]), dim=-1)


def token_slots(keep: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept prefix positions of each row, in increasing order, padded to the longest row.

    Args:
        keep: [B, P] bool kept prefix keys; offset: [B, P] float offsets.

    Returns:
        (index [B, n] int64, valid [B, n] bool, offset [B, n] float), n = max kept per row (padding
        points at position 0 and is not valid).
    """
    B, P = keep.shape
    pos = torch.arange(P, device=keep.device).expand(B, P)  # [B, P]
    order = torch.argsort(torch.where(keep, pos, pos + P), dim=-1)  # [B, P] kept first, increasing
    n = int(keep.sum(-1).max()) if B else 0
    index = order[:, :n]  # [B, n]
    valid = keep.gather(1, index)  # [B, n]
    return torch.where(valid, index, torch.zeros_like(index)), valid, torch.where(valid, offset.gather(1, index), 0.0)


@torch.no_grad()
def decode_gathered(model, input_ids: torch.Tensor, kept: Kept, cache, reindex: bool) -> torch.Tensor:
    """Log-probabilities of the token after ``input_ids`` [B, T], decoding token T - 1 against a new
    cache holding, per layer and key/value head, only the kept keys of ``cache`` (the full-context
    cache of the first T - 1 tokens, left unchanged).

    Args:
        model: transformers causal LM (RoPE when ``reindex``).
        input_ids: [B, T] int64.
        kept: :class:`HeadKept` (per-head sets, ``heads`` [L, B, H_kv, n]) or
            :class:`~truncsens.policies.base.Kept` (one set per row from ``keep[:, -1, :T-1]``, with
            its offsets as additive logit offsets).
        cache: the prefill cache (T - 1 positions per layer); when it holds fewer heads than ``kept.heads``
            (multi-head latent attention), per-head sets are applied as masks (:func:`decode_head_masks`).
        reindex: re-rotate the kept keys to positions 0..n_b - 1 and decode the query at n_b (n_b: kept
            keys of row b); else keys keep their positions and the query is at T - 1.

    Returns:
        [B, V] float64 log-probabilities.

    Raises:
        RotaryError: ``reindex`` and a model whose keys cannot be re-rotated (:func:`rope_inv_freq`).
        ValueError: a row of ``keep`` drops the query's own key.
        LayerMaskError: per-head masks that cannot reach every layer (:func:`decode_head_masks`).
    """
    B, T = input_ids.shape
    inv_freq = rope_inv_freq(model) if reindex else None
    L = kvcache.n_layers(cache)
    own_offset = kept.offset[:, -1, T - 1 :].float()  # [B, 1] the query's own key
    if isinstance(kept, HeadKept) and kept.heads is not None:
        if kvcache.layer_kv(cache, 0)[0].shape[1] != kept.heads.shape[2] and not reindex:
            return decode_head_masks(model, input_ids, kept.heads, cache)
        index = kept.heads  # [L, B, H, n]
        valid = torch.ones(B, index.shape[-1], dtype=torch.bool, device=index.device)  # [B, n]
        offset = torch.zeros(valid.shape, dtype=torch.float32, device=index.device)
    else:
        if not bool(kept.keep[:, -1, T - 1].all()):
            raise ValueError("a policy dropped the query's own key; it is always read")
        rows, valid, offset = token_slots(kept.keep[:, -1, : T - 1], kept.offset[:, -1, : T - 1])  # [B, n] each
        H = kvcache.layer_kv(cache, 0)[0].shape[1]
        index = rows.view(1, B, 1, -1).expand(L, B, H, rows.shape[-1])  # [L, B, H, n]
    n = index.shape[-1]
    keys, values = [], []
    for layer in range(L):
        k, v = kvcache.layer_kv(cache, layer)  # [B, H, T-1, d_k], [B, H, T-1, d_v]
        at = index[layer].unsqueeze(-1)  # [B, H, n, 1]
        k_kept = k.gather(2, at.expand(*index[layer].shape, k.shape[-1]))  # [B, H, n, d_k]
        v_kept = v.gather(2, at.expand(*index[layer].shape, v.shape[-1]))  # [B, H, n, d_v]: its own width
        if reindex:
            k_kept = rerotate(k_kept, torch.arange(n, device=k.device) - index[layer], inv_freq)
        keys.append(k_kept)
        values.append(v_kept)
    small = kvcache.cache_from(model, keys, values)
    if reindex:
        q_pos = valid.sum(-1, keepdim=True)  # [B, 1] after n_b kept keys
    else:
        q_pos = torch.full((B, 1), T - 1, dtype=torch.long, device=input_ids.device)  # [B, 1]
    own = torch.ones(B, 1, dtype=torch.bool, device=valid.device)
    keep = torch.cat((valid, own), -1).unsqueeze(1)  # [B, 1, n+1]
    off = torch.cat((offset.float(), own_offset), -1).unsqueeze(1)  # [B, 1, n+1]
    mask = additive_mask(keep, off, model_dtype(model))  # [B, 1, 1, n+1]
    out = model(input_ids=input_ids[:, T - 1 :], position_ids=q_pos, attention_mask=mask, use_cache=True,
                logits_to_keep=1, **{kvcache.cache_keyword(model): small})
    return last_logprobs(out.logits[:, -1, :])  # [B, V]


@torch.no_grad()
def decode_head_masks(model, input_ids: torch.Tensor, heads: torch.Tensor, cache) -> torch.Tensor:
    """Log-probabilities of the token after ``input_ids`` [B, T], decoding token T - 1 against the full
    prefill ``cache`` (T - 1 positions, truncated back afterwards) with one [B, H, 1, T] mask per layer:
    query head ``h·G + i`` of layer l reads the prefix keys ``heads[l, b, h]`` and its own key (G = H /
    Hkv). For caches that hold fewer heads than the kept sets (multi-head latent attention: one latent
    per position, every head's keys and values expanded from it), where a gathered cache cannot differ
    per head.

    Args:
        heads: [L, B, Hkv, n] int64 kept prefix positions (in 0..T - 2) of each layer and key/value head.

    Returns:
        [B, V] float64 log-probabilities.

    Raises:
        LayerMaskError: the masks cannot reach every layer's attention (a module called without an
            ``attention_mask`` keyword, or not exactly once).
    """
    B, T = input_ids.shape
    L, _, Hkv, _ = heads.shape
    groups = head_counts(model)[0] // Hkv
    dtype = model_dtype(model)
    zero = torch.zeros((), dtype=dtype, device=heads.device)
    masked = torch.tensor(masked_value(dtype), dtype=dtype, device=heads.device)
    masks = {}
    for layer in range(L):
        keep = torch.zeros(B, Hkv, T, dtype=torch.bool, device=heads.device)
        keep.scatter_(2, heads[layer], True)
        keep[..., T - 1] = True  # the query's own key
        keep = keep.repeat_interleave(groups, dim=1)  # [B, H, T]: query head h·G + i reads head h's keys
        masks[layer] = torch.where(keep, zero, masked).unsqueeze(2)  # [B, H, 1, T]
    return decode_with_layer_masks(model, input_ids, cache, masks)  # [B, V]
