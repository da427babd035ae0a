"""The full-context reference pass, with attention statistics and a reusable prefix cache.

One pass over the reference context ``x[0..T-1]`` gives (a) the reference next-token
log-probabilities at the last position, (b) optionally the attention probabilities averaged over
layers and heads, (c) optionally the mean key norms, and (d) optionally the key/value cache of the
first ``T - 1`` tokens, from which prefill-evict decodes the last token against an evicted cache.

The pass runs as a prefill of ``T - q`` tokens and a causal step of the last q (q = 1: one decode).
Attention statistics are read from the model's own attention calls (:mod:`truncsens.engine.score_attention`):
the model runs its own implementation (SDPA, ...) unchanged, and the queries and keys of each call
give the few softmax rows the policies need (``needs``; :class:`~truncsens.engine.attention_rows.AttentionRows`),
in blocks of query rows, without a T × T tensor. The full matrix (``attention=True``: tests and
oracles) and models whose attention calls cannot be read use the **eager fallback**: forward hooks
on the attention modules (``*.self_attn`` and similar) while the model temporarily uses the
``eager`` implementation (the only one that returns attention weights), memory B · T² floats; the
previous implementation is restored afterwards.

For a model with sliding-window layers (:mod:`truncsens.engine.attention_windows`) the cache keeps every
key of every layer, so statistics and prefill-evict see all T keys; the model's own masks apply the
windows (attention outside a layer's window is 0).

Head granularity (``heads=Hkv``, docs/method.md "Granularity"): the statistics keep a key/value
head dimension instead: attention of KV head h is the mean over layers and over the query heads of
h's group (query heads ``h·G .. h·G + G - 1``, G = H / Hkv, transformers' ``repeat_kv`` order), and
key norms are the mean over layers of head h's key norms.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from truncsens.engine import kvcache
from truncsens.engine.attention_rows import AttentionNeeds, AttentionRows
from truncsens.engine.attention_windows import layer_windows
from truncsens.engine.forward import rows_logprobs
from truncsens.engine.score_attention import NotInterceptable, intercept_attention


@dataclass
class ReferencePass:
    """What the reference pass returns (B sequences of T tokens).

    Attributes:
        logprobs: [B, V] float64 log-softmax (from float32 or wider logits) at the last position.
        last_attention: [B, T] float32 attention probabilities of the last query, mean over layers
            and heads (rows sum to 1), or None.
        attention: [B, T, T] float32 attention probabilities, query rows, mean over layers and
            heads, or None.
        key_norm: [B, T] float32 L2 norm of each key, mean over layers and key/value heads, or None.
        With ``heads=Hkv`` (head granularity) the three carry a key/value head dimension after B:
        [B, Hkv, T], [B, Hkv, T, T], [B, Hkv, T] (module docstring).
        cache: key/value cache of the first T - 1 tokens (full context), or None.
        rows: the attention rows and accumulated rows a run's policies read
            (:class:`~truncsens.engine.attention_rows.AttentionRows`, asked for by ``needs``), or None.
    """

    logprobs: torch.Tensor
    last_attention: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    key_norm: torch.Tensor | None = None
    cache: object | None = None
    rows: AttentionRows | None = None


@contextlib.contextmanager
def eager_attention(model) -> Iterator[None]:
    """Run ``model`` with eager attention inside the block, restoring its implementation after.

    Raises:
        RuntimeError: the model cannot switch its attention implementation.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == "eager":
        yield
        return
    if not hasattr(model, "set_attn_implementation"):
        raise RuntimeError("attention statistics need a transformers model that can switch to eager attention")
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")  # Llama/Qwen/Mistral, GPT-2/GPT-Neo, Falcon


def head_counts(model) -> tuple[int, int]:
    """(query heads H, key/value heads Hkv) of a transformers model's config (Hkv = H without
    grouped-query attention, e.g. GPT-2).

    Raises:
        ValueError: the config names no number of attention heads, or H is not a multiple of Hkv.
    """
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    config = get() if get else config
    h = getattr(config, "num_attention_heads", None)
    if not isinstance(h, int):
        raise ValueError("head granularity: the model config names no number of attention heads")
    kv = getattr(config, "num_key_value_heads", None) or h
    if h % kv:
        raise ValueError(f"head granularity: {h} query heads are not a multiple of {kv} key/value heads")
    return h, kv


class AttentionCollector:
    """Forward hooks on every attention module (``*.self_attn``, ``*.attn``, ...) that sum attention
    probabilities over heads and layers, or, with ``kv_heads``, over layers and the query heads of
    each key/value head's group."""

    def __init__(self, model, kv_heads: int | None = None) -> None:
        self.kv_heads = kv_heads
        found = {name: m for name, m in model.named_modules()
                 if name.rsplit(".", 1)[-1] in ATTENTION_NAMES and type(m).__name__.endswith("Attention")}
        # innermost matches only (GPT-Neo wraps its self-attention in another attention module)
        self.modules = [m for name, m in found.items() if not any(o.startswith(name + ".") for o in found)]
        if not self.modules:
            raise RuntimeError(
                f"attention statistics: the model has no attention modules named {', '.join(ATTENTION_NAMES)}; "
                "use --semantics reencode")
        self.total: torch.Tensor | None = None  # [B, Tq, Tk] sum over layers and heads
        self.count = 0

    def _hook(self, module, args, output) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise RuntimeError(
                f"attention statistics: the attention modules of {type(module).__name__} return no attention weights "
                "under eager attention (the model does not use transformers' attention interface); retention policies "
                "need them: use windows (--windows, semantics reencode) with this model")
        B, H, Tq, Tk = weights.shape
        if self.kv_heads is None:
            s = weights.float().sum(1)  # [B, H, Tq, Tk] -> [B, Tq, Tk]
        else:
            s = weights.float().view(B, self.kv_heads, H // self.kv_heads, Tq, Tk).sum(2)  # -> [B, Hkv, Tq, Tk]
        self.total = s if self.total is None else self.total + s
        self.count += H if self.kv_heads is None else H // self.kv_heads

    @contextlib.contextmanager
    def collect(self) -> Iterator["AttentionCollector"]:
        """Hooks active inside the block; ``mean()`` afterwards gives the result."""
        self.total, self.count = None, 0
        handles = [m.register_forward_hook(self._hook) for m in self.modules]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def mean(self) -> torch.Tensor:
        """[B, Tq, Tk] attention probabilities, mean over layers and heads ([B, Hkv, Tq, Tk] with
        ``kv_heads``: mean over layers and each group's query heads)."""
        return self.total / self.count


def _ones(b: int, t: int, device) -> torch.Tensor:
    return torch.ones(b, t, dtype=torch.long, device=device)


@torch.no_grad()
def reference_pass(model, input_ids: torch.Tensor, last_attention: bool = False, attention: bool = False,
                   key_norm: bool = False, keep_cache: bool = False, heads: int | None = None,
                   queries: int = 1, needs: AttentionNeeds | None = None) -> ReferencePass:
    """Full-context pass over ``input_ids`` with original positions 0..T-1.

    Args:
        model: transformers causal LM.
        input_ids: [B, T] int64, T >= 2.
        last_attention: return the last query's attention row.
        attention: return the full attention matrix (eager attention; memory B·T² floats): the
            fallback and test oracle; runs read :attr:`ReferencePass.rows` instead (``needs``).
        key_norm: return the mean key norms.
        keep_cache: return the cache of the first T - 1 tokens.
        heads: None (statistics averaged over heads) or Hkv: statistics per key/value head (module docstring).
        queries: q, the last positions whose outputs are returned (1 <= q < T; the block protocol,
            :mod:`truncsens.engine.block.policies`): the pass runs as a prefill of T - q tokens and one
            causal step of the last q, ``logprobs`` is then [B, q, V] and ``last_attention`` [B, q, T]
            (rows of the last q queries, zeros beyond each query; [B, Hkv, q, T] per head). The
            cache is still that of the first T - 1 tokens. With q = 1 the shapes are those of
            :class:`ReferencePass`.
        needs: attention rows and accumulated rows to return in ``rows``
            (:class:`~truncsens.engine.attention_rows.AttentionRows`, the rows of the last q queries
            always included), read from the model's own attention calls in blocks of query rows
            (:mod:`truncsens.engine.score_attention`), no T × T tensor; for a model whose attention
            calls cannot be read, from the eager fallback's full matrix.

    Returns:
        :class:`ReferencePass`.

    Raises:
        ValueError: T < 2, q outside 1 .. T - 1, a needed position outside 0 .. T - 1, or observation
            windows per layer (``needs.windows``) with ``attention`` or a model whose attention calls
            cannot be read (the eager fallback averages over layers).
        NonFiniteLogitsError: NaN or infinite logits.
    """
    B, T = input_ids.shape
    if T < 2:
        raise ValueError("the reference pass needs at least 2 context tokens")
    if not 1 <= queries < T:
        raise ValueError(f"the reference pass returns 1 .. T - 1 = {T - 1} last queries, got {queries}")
    q = queries
    last = range(T - q, T)
    if needs is not None or (last_attention and not attention):
        needs = (needs or AttentionNeeds()) | AttentionNeeds.of(rows=last)
        if any(not 0 <= p < T for p in needs.rows + needs.cumulative + tuple(q for q, _ in needs.windows)):
            raise ValueError(f"attention statistics of queries outside 0 .. {T - 1} were asked for")
    if attention and needs is not None and needs.windows:
        raise ValueError("observation windows per layer are read from the model's attention calls, not the eager matrix")
    rows = None
    out = cache = None
    if needs is not None and not attention:
        try:
            with intercept_attention(model, needs, T, heads) as acc:
                out, cache, _, _ = _passes(model, input_ids, q, None)
                if not acc.layers:
                    raise NotInterceptable("no attention call reached transformers' attention interface")
                rows = acc.result()
        except NotInterceptable as exc:
            if needs.windows:  # the eager fallback averages over layers: no per-layer window
                raise ValueError(f"observation windows per layer and key/value head are read from the model's calls "
                                 f"of transformers' attention interface, which this model's attention does not make "
                                 f"({exc}); use a policy whose scores are averaged over layers (e.g. snapkv_shared)") from None
            out = None  # the eager fallback below
    prefix_rows = last_rows = None
    if out is None:
        eager_prefix = attention or (needs is not None and (needs.cumulative or needs.rows[0] < T - q))
        collector = AttentionCollector(model, heads) if (attention or last_attention or needs is not None) else None
        out, cache, prefix_rows, last_rows = _passes(model, input_ids, q, collector, eager_prefix)
    lp = rows_logprobs(out.logits, q)  # [B, q, V]
    result = ReferencePass(lp[:, 0] if q == 1 else lp)  # [B, V] for one query
    if prefix_rows is not None:
        full = torch.zeros(*last_rows.shape[:-2], T, T, dtype=torch.float32, device=input_ids.device)  # [B, (Hkv,) T, T]
        full[..., : T - q, : T - q] = prefix_rows
        full[..., T - q :, :] = last_rows
        if attention:
            result.attention = full
        if needs is not None:
            rows = AttentionRows.of_matrix(full, needs)
    elif last_rows is not None and needs is not None:  # eager decode step only: the last q rows
        pos = torch.arange(T - q, T, device=input_ids.device)  # [q]
        empty = last_rows.new_zeros(*last_rows.shape[:-2], 0, T)  # [B, (Hkv,) 0, T]
        rows = AttentionRows(pos, last_rows, pos[:0], empty)
    if rows is not None:
        result.rows = rows
        last_rows = rows.row(torch.arange(T - q, T))  # [B, (Hkv,) q, T]
    if last_attention or attention:
        result.last_attention = last_rows[..., -1, :] if q == 1 else last_rows  # [B, (Hkv,) T] for one query
    if key_norm:
        norms = [kvcache.layer_kv(cache, layer)[0].float().norm(dim=-1) for layer in range(kvcache.n_layers(cache))]  # [B, Hkv, T] each
        norms = [n if heads else n.mean(1) for n in norms]  # [B, Hkv, T] per head, else [B, T]
        result.key_norm = torch.stack(norms).mean(0)  # [B, T]
    if keep_cache:
        kvcache.truncate(cache, T - 1)
        result.cache = cache
    return result


def _passes(model, input_ids: torch.Tensor, q: int, collector: AttentionCollector | None, eager_prefix: bool = False):
    """The prefill of the first T - q tokens and the causal step of the last q, on a new cache that
    keeps every key (also of sliding-window layers: the model's masks still apply their windows).
    With ``collector`` the step runs under eager attention and its rows are collected, and with
    ``eager_prefix`` the prefill's too.

    Returns:
        (the step's model output, the cache, prefill rows [B, (Hkv,) T-q, T-q] or None, step rows
        [B, (Hkv,) q, T] or None).
    """
    B, T = input_ids.shape
    device = input_ids.device
    pos = torch.arange(T, device=device).expand(B, T)  # [B, T]
    cache = kvcache.new_full_cache(model) if layer_windows(model).windowed else kvcache.new_cache(model)
    kw = kvcache.cache_keyword(model)
    prefix_rows = last_rows = None
    eager = collector is not None and eager_prefix
    with eager_attention(model) if eager else contextlib.nullcontext():
        with collector.collect() if eager else contextlib.nullcontext():
            model(input_ids=input_ids[:, : T - q], position_ids=pos[:, : T - q], attention_mask=_ones(B, T - q, device),
                  use_cache=True, logits_to_keep=1, **{kw: cache})
        if eager:
            prefix_rows = collector.mean()  # [B, T-q, T-q] ([B, Hkv, T-q, T-q] per head)
    with eager_attention(model) if collector else contextlib.nullcontext():
        with collector.collect() if collector else contextlib.nullcontext():
            out = model(input_ids=input_ids[:, T - q :], position_ids=pos[:, T - q :], attention_mask=_ones(B, T, device),
                        use_cache=True, logits_to_keep=q, **{kw: cache})
        if collector:
            last_rows = collector.mean()[..., -q:, :]  # [B, q, T] ([B, Hkv, q, T] per head)
    return out, cache, prefix_rows, last_rows
