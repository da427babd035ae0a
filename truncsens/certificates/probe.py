"""An attention function for transformers' attention interface that records certificates.

Registered as ``truncsens_certify`` with ``transformers.AttentionInterface`` (and the ``sdpa`` mask
builder with ``AttentionMaskInterface``); any model whose attention modules call
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` can use it. The
per-call state travels as the keyword ``certify_probe`` of the model's forward (transformers passes
extra keywords down to the attention function), so nothing is global but the registration.

Modes of a :class:`CertifyProbe`:

- ``"prefill"``: ordinary attention (delegated to ``sdpa``); in addition the attention each key
  receives, summed over heads and query rows, is accumulated in blocks of query rows (never
  heads × T × T at once) — the H2O-style score of the token-level design — and, per layer and
  key/value head, the scores of the per-head designs (:mod:`truncsens.certificates.designs`):
  attention summed over all prefill rows (``h2o``), over the last W rows (``window``), and key norms.
- ``"reference"``: the target's query decoded against the full cache: ordinary attention, and its
  attention row summed over heads is added to the score; per layer and head, the relative
  difference between that output (in the run's dtype) and the float64 output over the same keys is
  recorded (``floor``): what the run's arithmetic alone puts between two outputs that are equal in
  exact arithmetic, the measured side of the numerical floor of the certificate records.
- ``"evict"``: the target's query decoded against the full cache; in every layer and head, from the
  same query vector, the exact output o over all keys, the Hájek output ô over the kept keys, V̂ and
  the radii (:func:`truncsens.certificates.estimator.attention_records`); ô is returned, so the next
  layer reads the evicted run (prefill-evict semantics, docs/method.md section 3). The design is
  [B, L, Hkv, T] (one per layer and key/value head) or [B, 1, 1, T] (shared).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from truncsens.engine.attention_features import attention_features, describe
from truncsens.certificates.estimator import attention_records

NAME = "truncsens_certify"
SCORE_BLOCK = 256  # query rows per block of the score accumulation


class CertifyModelError(ValueError):
    """The model cannot be probed (it does not use transformers' attention interface, or has
    attention the probe cannot reproduce); the message names the fix."""


@dataclass
class CertifyProbe:
    """State of one probed forward (B sequences).

    Attributes:
        mode: "prefill", "reference" or "evict".
        delta: miss probability of the radii.
        variance: the variance estimate of the radii (:data:`~truncsens.certificates.estimator.VARIANCES`).
        received: [B, T] float32 attention received per key, summed over layers, heads and rows.
        n_heads_seen: layer × head count added to ``received`` by the last forward of each mode.
        obs_window: W, the prefill rows of the per-head ``window`` score.
        head_scores: score name ("h2o", "window", "key_norm") -> {layer index: [B, Hkv, T − 1]
            float32}, filled in "prefill" mode.
        kept, pi, tail: [B, L or 1, Hkv or 1, T] the target query's design in "evict" mode (π = 1 on
            surely kept keys).
        floor: per layer [B, H] float64 ``‖o_dtype − o_float64‖/‖o_float64‖`` of the full-cache
            decode ("reference" mode).
        records: per layer a dict name -> [B, H] float64 (error, variance, radius_eb,
            radius_normal, o_norm, value_range, n_random, has_tail, o_hat_norm, kept_share, tail_mass,
            variance_hajek: the plain V̂) and
            "o" -> [B, H, d], filled in
            "evict" mode.
    """

    mode: str = "prefill"
    delta: float = 0.05
    variance: str = "hajek"
    received: torch.Tensor | None = None
    n_heads_seen: int = 0
    obs_window: int = 32
    head_scores: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    kept: torch.Tensor | None = None
    pi: torch.Tensor | None = None
    tail: torch.Tensor | None = None
    records: list[dict[str, torch.Tensor]] = field(default_factory=list)
    floor: list[torch.Tensor] = field(default_factory=list)

    def evict(self, kept: torch.Tensor, pi: torch.Tensor, tail: torch.Tensor) -> None:
        """Switch to "evict" mode with the target query's design (each [B, T] shared, or
        [B, L, Hkv, T] per layer and key/value head); clears records."""
        if kept.dim() == 2:
            kept, pi, tail = (t[:, None, None, :] for t in (kept, pi, tail))  # [B, T] -> [B, 1, 1, T]
        self.mode, self.kept, self.pi, self.tail, self.records = "evict", kept, pi, tail, []

    def layer_scores(self, name: str) -> torch.Tensor:
        """[B, L, Hkv, T − 1] per-head score ``name`` of every layer, in layer order."""
        by_layer = self.head_scores[name]
        return torch.stack([by_layer[layer] for layer in sorted(by_layer)], dim=1)

    def stacked(self, name: str) -> torch.Tensor:
        """[B, L, H] (or [B, L, H, d] for "o") records of the last evicted forward, layers in order."""
        return torch.stack([r[name] for r in self.records], dim=1)


def _add_received(probe: CertifyProbe, query: torch.Tensor, key: torch.Tensor, scaling: float, n_rep: int,
                  layer: int | None = None) -> None:
    """Add the attention each key receives (summed over heads and rows, causal) to ``probe.received``;
    with ``layer`` (prefill), also record that layer's per-head scores in ``probe.head_scores``."""
    B, H, Tq, _ = query.shape
    Tk = key.shape[2]
    k = key.repeat_interleave(n_rep, dim=1) if n_rep > 1 else key  # [B, H, Tk, d]
    per_head = torch.zeros(B, H, Tk, dtype=torch.float32, device=query.device)  # all rows
    window = torch.zeros(B, H, Tk, dtype=torch.float32, device=query.device)  # the last W rows
    offset = Tk - Tq  # row i of the block reads keys j <= i + offset
    cols = torch.arange(Tk, device=query.device)
    first_window_row = max(0, Tq - probe.obs_window)
    for a in range(0, Tq, SCORE_BLOCK):
        b = min(Tq, a + SCORE_BLOCK)
        s = torch.matmul(query[:, :, a:b].float(), k.float().transpose(-1, -2)) * scaling  # [B, H, b-a, Tk]
        rows = torch.arange(a, b, device=query.device) + offset
        s = s.masked_fill(cols.unsqueeze(0) > rows.unsqueeze(1), float("-inf"))
        p = torch.softmax(s, dim=-1)  # [B, H, b-a, Tk]
        per_head += p.sum(dim=2)
        if b > first_window_row:
            window += p[:, :, max(0, first_window_row - a):].sum(dim=2)
    total = per_head.sum(dim=1)  # [B, Tk]
    if layer is not None:
        Hkv = key.shape[1]
        group = lambda t: t.view(B, Hkv, H // Hkv, Tk).sum(2)  # noqa: E731  [B, H, Tk] -> [B, Hkv, Tk]
        for name, value in (("h2o", group(per_head)), ("window", group(window)),
                            ("key_norm", key.float().norm(dim=-1))):  # [B, Hkv, Tk] each
            probe.head_scores.setdefault(name, {})[layer] = value
    if probe.received is None:
        probe.received = torch.zeros_like(total)
    if probe.received.shape[1] < Tk:
        grown = torch.zeros(B, Tk, dtype=torch.float32, device=query.device)
        grown[:, : probe.received.shape[1]] = probe.received
        probe.received = grown
    probe.received[:, :Tk] += total
    probe.n_heads_seen += H


def _floor(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
           n_rep: int) -> torch.Tensor:
    """[B, H] relative difference of the model's full-cache output ``out`` [B, 1, H, d] (its dtype)
    from the float64 output over the same keys (one decoded query row)."""
    k = key.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, T, d]
    v = value.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, T, dv]
    w = torch.softmax(torch.matmul(query.to(torch.float64), k.transpose(-1, -2)) * scaling, dim=-1)  # [B, H, 1, T]
    exact = torch.matmul(w, v).squeeze(2)  # [B, H, dv]
    got = out.squeeze(1).to(torch.float64)  # [B, 1, H, dv] -> [B, H, dv]
    return (got - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)


def _evict(probe: CertifyProbe, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """Records of the target query in every head; returns ô as [B, 1, H, d] in the query's dtype."""
    B, H, Tq, d = query.shape
    if Tq != 1:
        raise RuntimeError(f"certify: the evicted pass decodes one token, got {Tq} query rows")
    n_rep = H // key.shape[1]
    k = key.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, T, d]
    v = value.repeat_interleave(n_rep, dim=1).to(torch.float64)  # [B, H, T, dv]
    logits = torch.matmul(query.to(torch.float64), k.transpose(-1, -2)).squeeze(2) * scaling  # [B, H, T]
    T = logits.shape[-1]
    if probe.kept.shape[0] != B or probe.kept.shape[-1] != T:
        raise RuntimeError(f"certify: the kept set has shape {tuple(probe.kept.shape)}, the layer reads {(B, T)} keys")
    layer = getattr(module, "layer_idx", None) if probe.kept.shape[1] > 1 else 0
    if layer is None:
        raise RuntimeError("certify: a per-layer design needs attention modules with a layer index (layer_idx)")

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, L', Hkv', T] -> [B, H or 1, T] of this layer
        t = t[:, layer]  # [B, Hkv', T]
        return t.repeat_interleave(n_rep, dim=1) if t.shape[1] > 1 else t

    rec = attention_records(logits, v, torch.ones(1, 1, T, dtype=torch.bool, device=logits.device),
                            heads(probe.kept), heads(probe.pi), heads(probe.tail), probe.delta,
                            probe.variance)
    probe.records.append({"error": rec.error, "variance": rec.variance, "radius_eb": rec.radius_eb,
                          "radius_normal": rec.radius_normal, "o_norm": rec.o_norm, "o": rec.o,
                          "value_range": rec.value_range, "n_random": rec.n_random.to(torch.float64),
                          "has_tail": rec.has_tail.to(torch.float64), "o_hat_norm": rec.o_hat_norm,
                          "kept_share": rec.kept_share, "tail_mass": rec.tail_mass,
                          "variance_hajek": rec.variance_hajek})
    return rec.o_hat.unsqueeze(1).to(query.dtype)  # [B, 1, H, dv]


def certify_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function (transformers' interface): query [B, H, Tq, d], key/value
    [B, H_kv, Tk, d] -> ([B, Tq, H, d], None). With a ``certify_stream`` keyword, the streaming run's
    attention (:meth:`truncsens.certificates.stream_probe.StreamState.attend`); without it or a
    ``certify_probe`` keyword it is ``sdpa``.

    Raises:
        CertifyModelError: soft-capping, learned sinks or a sliding window (the records would not be
            the model's attention).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    probe: CertifyProbe | None = kwargs.pop("certify_probe", None)
    stream = kwargs.pop("certify_stream", None)  # a streaming run's state (truncsens.certificates.stream_probe)
    if probe is None and stream is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for arg, feature in (("softcap", "attention-logit soft-capping"), ("s_aux", "learned attention-sink logits"),
                         ("sliding_window", "a sliding-window layer")):
        if kwargs.get(arg) is not None:
            raise CertifyModelError(f"certify: the model passed {feature} ({arg}) to its attention, which the "
                                    "certificate probe does not reproduce; truncsens measure applies it")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if stream is not None:
        return stream.attend(module, query, key, value, scale), None
    n_rep = query.shape[1] // key.shape[1]
    if probe.mode == "evict":
        return _evict(probe, module, query, key, value, scale), None
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if probe.mode == "reference" and query.shape[2] == 1:
        probe.floor.append(_floor(out, query, key, value, scale, n_rep))
    _add_received(probe, query, key, scale, n_rep, getattr(module, "layer_idx", None) if probe.mode == "prefill" else None)
    return out, None


def register() -> None:
    """Register :func:`certify_attention` and the sdpa mask builder under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, certify_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def check_model(model, name: str) -> None:
    """Raise :class:`CertifyModelError` unless ``model`` is a transformers model that routes its
    attention through the attention interface, with full (not sliding-window) attention layers."""
    if not hasattr(model, "set_attn_implementation") or not getattr(type(model), "_supports_attention_backend", False):
        raise CertifyModelError(
            f"model {name!r} does not use transformers' attention interface (config._attn_implementation), so its "
            "attention cannot be probed; certify needs a transformers causal LM such as Llama, Qwen2, Mistral or GPT-2")
    from truncsens.engine.attention_windows import WindowError, layer_windows

    try:
        windowed = layer_windows(model).windowed
    except WindowError as exc:
        raise CertifyModelError(str(exc)) from None
    if windowed:
        raise CertifyModelError(f"model {name!r} has sliding-window attention layers; certify supports full attention "
                                "only (truncsens measure supports them under every semantics)")
    features = attention_features(model)
    if features:
        raise CertifyModelError(f"model {name!r} has {describe(features)}, which the certificate probe does not "
                                "reproduce; truncsens measure applies it under every semantics")


@contextlib.contextmanager
def probed(model) -> Iterator[None]:
    """Run ``model`` with :data:`NAME` as its attention implementation inside the block (restored after)."""
    register()
    current = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(current)
