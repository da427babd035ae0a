"""A synthetic source whose truncation sensitivity has a known decay law.

Model specs: ``synthetic:ALPHA`` (power law, TV exponent ALPHA) and ``synthetic-geometric:RATE``
(geometric lags, exponential decay ``exp(-RATE w)``); an optional third field sets the largest lag
L (= ``max_context``), e.g. ``synthetic:0.5:2048``. Default L = 1024.

The process: a mixture of lagged copies
---------------------------------------
Binary alphabet {0, 1} (V = 2). With ``q(y | x) = (1 - s)/2 + s [y = x]`` (noisy copy, copy
strength s = :data:`COPY_STRENGTH`) the next-token distribution is::

    p(x_t | x_<t) = ( lam_0 / 2 + sum_{k in shown lags} lam_k q(x_t | x_{t-k}) ) / (lam_0 + sum_{shown} lam_k)

``lam_0`` (:data:`FLOOR`) is a Markov-free floor (uniform); lags 1..L carry weights ``lam_k``. A
model shown only some tokens "predicts with the lags it has": the sum runs over the shown tokens,
their lag ``k = (predicted position) - position_id`` taken from ``position_ids``, and renormalizes.
The corpus (:func:`synthetic_documents`) is sampled from the same process; before position L only
lags 1..t exist and the mixture is renormalized over them.

The lag weights are defined by their tail ``T(w) = sum_{k > w} lam_k``::

    g(w) = m w^-beta            (power)        or   m exp(-rate w)   (geometric),   m = SCALE
    T(w) = g(w) / (1 + g(w))    for 1 <= w < L,   T(L) = 0,   T(0) = 1 - lam_0

so ``lam_k = T(k-1) - T(k) ~ m beta k^-(1+beta)`` for k >> 1 (``~ m (1 - e^-rate) e^-rate k``
geometric), and ``lam_L = T(L-1)`` collects the tail beyond L (a finite process needs it; without it
the curve bends near L).

Implied exponents (derivation)
------------------------------
Let the reference see all L lags (reference context N = L, the default of ``measure``) and the
kept context the last w. Write ``sigma_k = 2 x_{t-k} - 1`` (+-1), ``N_w = sum_{k<=w} lam_k sigma_k``
and ``F = sum_{k>w} lam_k sigma_k`` (``|F| <= T(w)``). Since ``p(1) = 1/2 + (s/2) sum lam_k sigma_k /
(mass of the shown lags)``, the shown mass is ``1 - T(w)`` and ``T/(1-T) = g``::

    TV(w) = |p_L(1) - p_w(1)| = (s/2) |F - g(w) N_w|.

When ``|F| < g |N_w|`` (lag 1 dominates: ``lam_1 > T(1)``; violated only when nearly all removed
lags agree in sign) this is ``(s/2) (g |N_w| - sign(N_w) F)``; the second term has mean zero up to
the correlation of ``sigma_1`` with lags beyond w, which decays fast. Hence

    E TV(w) = C_tv w^-beta,   C_tv ~= (s/2) m E|N_w| ~= (s/2) m lam_1            (alpha_TV = beta)

exactly in w apart from that correlation term (visible only at w < 4). KL is quadratic in the
perturbation for a binary distribution: ``KL ~= (p_L - p_w)^2 / (2 p_w (1 - p_w))``, so

    E KL(w) ~= C_kl w^-2beta                                                        (alpha_KL = 2 beta)

for ``w << L``; as w approaches L the single lag-L weight makes ``F`` less averaged and KL
flattens (its share of the removed mass is ``(w/L)^beta``). The geometric source gives
``E TV ~= C exp(-rate w)`` (tau = 1/rate) and ``E KL ~ exp(-2 rate w)``. The tests check both
numerically (``tests/test_synthetic.py``): fitted alpha_TV within 0.02 of beta on [4, 128], alpha_KL
within 0.1 of 2 beta on [4, 32]. The reference context must equal L for the law to be exact: with
N < L the removed mass is ``T(w) - T(N)`` and the curve bends near N.

Design choices: a binary alphabet makes TV linear in the removed lags (TV = |dp(1)|); with a larger
vocabulary the constant drifts with w as the removed-lag average concentrates (trials with V = 16
to 64 gave fitted TV slopes 0.51 to 0.62 for beta = 0.5). ``s = 0.3`` keeps sign correlations along
the sequence short, ``m = 0.2`` keeps lag 1 dominant, and the ``g/(1+g)`` tail cancels the
renormalization by the shown mass. Measured with ``measure`` defaults (64 documents x 8 targets,
N = 1024): alpha_TV = 0.494 [0.484, 0.505] for beta = 0.5, alpha_KL / alpha_TV = 1.96; the KL
slope on [4, 128] is about 0.97 x 2 beta because of the flattening above.

Results datasets whose mean curves are given functions exactly (for tests of the fitting code,
independent of any model) are :func:`truncsens.results.constructed.curve_results`.

Power law and w(eps) as in arXiv 2605.25085 (polynomial truncation sensitivity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from truncsens.models.loaded import LoadedModel, resolve_dtype

VOCAB = 2
COPY_STRENGTH = 0.3  # s
FLOOR = 0.02  # lam_0
SCALE = 0.2  # m
DEFAULT_MAX_LAG = 1024  # L = max_context


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of the synthetic source.

    Attributes:
        kind: "power" or "geometric".
        exponent: beta (power; the TV exponent) or rate (geometric; per token, tau = 1/rate).
        max_lag: L, the largest lag (also the model's ``max_context``).
        copy_strength: s in (0, 1].
        floor: lam_0 in (0, 1), weight of the uniform component.
        scale: m > 0, the tail scale (``T(w) = g/(1+g)``, ``g = m w^-beta``).
    """

    kind: str
    exponent: float
    max_lag: int = DEFAULT_MAX_LAG
    copy_strength: float = COPY_STRENGTH
    floor: float = FLOOR
    scale: float = SCALE

    @property
    def alpha_tv(self) -> float:
        """TV exponent (power) or rate (geometric) implied by the construction."""
        return self.exponent

    @property
    def alpha_kl(self) -> float:
        """KL exponent (power) or rate (geometric): twice the TV one (see module docstring)."""
        return 2.0 * self.exponent


def parse_spec(spec: str) -> SyntheticSpec:
    """Parse ``synthetic:ALPHA[:L]`` or ``synthetic-geometric:RATE[:L]``.

    Raises:
        ValueError: unknown prefix, missing or non-positive exponent, or L < 8.
    """
    parts = spec.split(":")
    kinds = {"synthetic": "power", "synthetic-geometric": "geometric"}
    if parts[0] not in kinds or len(parts) not in (2, 3):
        raise ValueError(f"bad synthetic model spec {spec!r}: use synthetic:ALPHA or synthetic-geometric:RATE "
                         "(optionally :MAX_LAG), e.g. synthetic:0.5")
    try:
        exponent = float(parts[1])
        max_lag = int(parts[2]) if len(parts) == 3 else DEFAULT_MAX_LAG
    except ValueError:
        raise ValueError(f"bad synthetic model spec {spec!r}: exponent must be a number and MAX_LAG an integer") from None
    if not (math.isfinite(exponent) and exponent > 0):
        raise ValueError(f"bad synthetic model spec {spec!r}: the exponent/rate must be > 0")
    if max_lag < 8:
        raise ValueError(f"bad synthetic model spec {spec!r}: MAX_LAG must be at least 8")
    return SyntheticSpec(kinds[parts[0]], exponent, max_lag)


def tail_mass(spec: SyntheticSpec, w: np.ndarray | float) -> np.ndarray:
    """T(w) = sum_{k>w} lam_k, the lag mass a window of w tokens drops (see module docstring).

    Args:
        w: window(s) in tokens, 0 <= w <= L (any shape).

    Returns:
        float64 array of the shape of ``w``: ``1 - lam_0`` at 0, ``g/(1+g)`` on [1, L), 0 at L.
    """
    w = np.asarray(w, dtype=np.float64)
    safe = np.clip(w, 1.0, None)
    g = spec.scale * (safe ** -spec.exponent if spec.kind == "power" else np.exp(-spec.exponent * safe))
    t = g / (1.0 + g)
    t = np.where(w <= 0, 1.0 - spec.floor, t)
    return np.where(w >= spec.max_lag, 0.0, t)


def lag_weights(spec: SyntheticSpec) -> np.ndarray:
    """Mixture weights ``[lam_0, lam_1, ..., lam_L]`` (float64, sums to 1).

    Raises:
        ValueError: lam_1 <= T(1) (lag 1 would not dominate, which the derivation assumes).
    """
    k = np.arange(1, spec.max_lag + 1)
    lam = np.empty(spec.max_lag + 1)
    lam[0] = spec.floor
    lam[1:] = tail_mass(spec, k - 1) - tail_mass(spec, k)
    if lam[1] <= tail_mass(spec, 1):
        raise ValueError("synthetic source: lag 1 must carry more weight than all longer lags together; lower the scale")
    return lam


class SyntheticOutput:
    """What the model returns: ``logits`` [B, T', V]."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class SyntheticConfig:
    """The few config fields callers read from a Hugging Face model."""

    def __init__(self, spec: SyntheticSpec):
        self.vocab_size = VOCAB
        self.max_position_embeddings = spec.max_lag
        self.model_type = "synthetic"


class SyntheticLM(torch.nn.Module):
    """The lagged-copy mixture as a causal LM (interface of :class:`truncsens.models.LoadedModel`).

    ``forward(input_ids [B, T], attention_mask [B, T] | None, position_ids [B, T] | None,
    logits_to_keep=1)`` returns :class:`SyntheticOutput` with ``logits`` [B, T', V] =
    log p(next | shown tokens), T' = ``logits_to_keep`` (0 = all positions). Query i predicts
    position ``position_ids[:, i] + 1`` from the shown tokens j <= i, each at lag
    ``position_ids[:, i] + 1 - position_ids[:, j]``; lags outside 1..L and masked tokens are ignored.
    """

    def __init__(self, spec: SyntheticSpec, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.spec = spec
        self.config = SyntheticConfig(spec)
        self.out_dtype = dtype
        lam = torch.tensor(lag_weights(spec), dtype=torch.float64)
        self.register_buffer("lam", torch.cat([torch.zeros(1, dtype=torch.float64), lam[1:], torch.zeros(1, dtype=torch.float64)]))  # [L+2], by lag
        s = spec.copy_strength
        kernel = torch.full((VOCAB, VOCAB), (1 - s) / VOCAB, dtype=torch.float64) + s * torch.eye(VOCAB, dtype=torch.float64)
        self.register_buffer("kernel", kernel)  # [V, V]: row x = q(. | x)
        self.floor = float(lam[0])

    @property
    def device(self) -> torch.device:
        """Where the lag weights live."""
        return self.lam.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the returned logits (computed in float64)."""
        return self.out_dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0, **_: object) -> SyntheticOutput:
        """Log-probabilities of the next token at the last ``logits_to_keep`` positions.

        Args:
            input_ids: [B, T] int64 tokens in {0, 1}.
            attention_mask: [B, T] (0: the token is not shown) or None (all shown).
            position_ids: [B, T] int64 (None: 0..T-1); lags are differences of position ids.
            logits_to_keep: T' last positions to return (0: all).

        Returns:
            :class:`SyntheticOutput` with ``logits`` [B, T', 2] = log p (normalized), in ``dtype``.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        keep = T if not logits_to_keep else min(int(logits_to_keep), T)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        rows = self.kernel[input_ids]  # [B, T, V]
        L = self.spec.max_lag
        chunk = max(1, (1 << 22) // max(1, B * T))
        out = []
        for start in range(T - keep, T, chunk):
            stop = min(start + chunk, T)
            qpos = position_ids[:, start:stop] + 1  # [B, q]
            lag = qpos[:, :, None] - position_ids[:, None, :]  # [B, q, T]
            causal = torch.arange(T, device=input_ids.device)[None, :] <= torch.arange(start, stop, device=input_ids.device)[:, None]  # [q, T]
            valid = (lag >= 1) & (lag <= L) & causal[None] & mask[:, None, :]
            weight = self.lam[lag.clamp(0, L + 1)] * valid  # [B, q, T]
            mix = self.floor / VOCAB + weight @ rows  # [B, q, V]
            mix = mix / (self.floor + weight.sum(-1, keepdim=True))
            out.append(torch.log(mix.clamp_min(1e-300)))
        return SyntheticOutput(torch.cat(out, dim=1).to(self.out_dtype))


def load_synthetic(spec: str, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """The synthetic source as a :class:`truncsens.models.LoadedModel` (``tokenizer=None``, ``source="synthetic"``).

    ``device`` is used as given (``truncsens.models.load_model`` checks it first).

    Raises:
        ValueError: bad spec or dtype name.
    """
    parsed = parse_spec(spec)
    model = SyntheticLM(parsed, resolve_dtype(dtype)).to(device).eval()
    return LoadedModel(model=model, tokenizer=None, name=spec, revision="", tokenizer_name="none (token ids)",
                       max_context=parsed.max_lag, device=device, dtype=dtype, source="synthetic")


def synthetic_documents(spec: str, n_docs: int, length: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Sample ``n_docs`` sequences of ``length`` tokens from the process of ``spec``.

    Document i depends only on (spec, length, seed, i), so asking for more documents keeps the first
    ones. Sequential in t, vectorized over documents.

    Returns:
        list of (doc id ``"synthetic-{i:05d}"``, LongTensor [length]).

    Raises:
        ValueError: bad spec, ``n_docs < 1`` or ``length < 1``.
    """
    parsed = parse_spec(spec)
    if n_docs < 1 or length < 1:
        raise ValueError(f"need n_docs >= 1 and length >= 1, got {n_docs} and {length}")
    lam = lag_weights(parsed)
    cum = np.cumsum(lam)  # [L+1]; cum[k] = lam_0 + ... + lam_k
    L, s = parsed.max_lag, parsed.copy_strength
    draws = np.stack([np.random.default_rng([seed, i]).random((3, length)) for i in range(n_docs)], axis=1)  # [3, n, length]
    fresh = (draws[2] < 0.5).astype(np.int64)  # a uniform token, used by the floor and the noise of q
    x = np.zeros((n_docs, length), dtype=np.int64)
    rows = np.arange(n_docs)
    for t in range(length):
        avail = min(t, L)
        k = np.searchsorted(cum, draws[0, :, t] * cum[avail], side="right")
        k = np.minimum(k, avail)  # [n] 0 = floor, else the lag copied from
        src = x[rows, np.maximum(t - k, 0)]
        copy = (k > 0) & (draws[1, :, t] < s)
        x[:, t] = np.where(copy, src, fresh[:, t])
    return [(f"synthetic-{i:05d}", torch.from_numpy(x[i].copy())) for i in range(n_docs)]
