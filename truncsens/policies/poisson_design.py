"""Certainty-plus-Poisson eviction: inclusion probabilities, the Hájek estimator, its variance
estimate and certificate radii. Pure torch math, no model code.

Source: P. Xie, "Error Certificates for KV-Cache Eviction via Randomized Design" (arXiv 2607.21475),
see ``docs/method.md``, section 5. What the paper states: each tail token ``i`` is kept
independently with a known probability ``π_i``, and adding ``log(1/π_i)`` to the logit of each kept
tail token turns the attention output into the Hájek ratio estimator

    ô = Σ_{i∈S} (w_i/π_i) v_i / Σ_{i∈S} (w_i/π_i),   w_i = exp(q·k_i/√d),

of the full output ``o = Σ_i w_i v_i / Σ_i w_i`` (certain tokens have ``π_i = 1``). The formulas below
that the abstract does not state are the standard Poisson-sampling ones (Särndal, Swensson and
Wretman, *Model Assisted Survey Sampling*, 1992, sections 3.3 and 5.7), marked [ours] in docs/method.md:

- ``π_i = min(1, c·score_i)`` with ``c`` found by bisection (over the number of tokens with
  ``π_i = 1``, which makes it exact) so that ``Σ_tail π_i`` equals the tail budget (expected number
  of kept tail tokens);
- linearization ``ô − o ≈ (1/Z) Σ_i (I_i/π_i − 1) w_i (v_i − o)``; its variance estimate over the
  kept set ``V̂ = (1/Ẑ²) Σ_{i∈S∩tail} (1 − π_i)/π_i² · w_i² · ‖v_i − ô‖²`` with ``Ẑ = Σ_S w_i/π_i``
  (independent draws: no joint-inclusion terms);
- the certificate radius ``r = z_{1−δ/2}·sqrt(V̂)`` (normal), or the empirical-Bernstein radius of
  Maurer and Pontil (2009, Theorem 4) for a finite-sample version.

Shapes use ``...`` for any leading batch shape (sequences, queries, heads) and ``n`` for keys.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

class PoissonDesignError(ValueError):
    """The Poisson design cannot reach the asked expected count (e.g. every score is zero)."""


def solve_scale(scores: torch.Tensor, eligible: torch.Tensor, expected: torch.Tensor | float) -> torch.Tensor:
    """The scale ``c`` with ``Σ_{eligible} min(1, c·score_i) = expected``, by bisection.

    With the scores sorted in decreasing order ``s_(0) >= s_(1) >= ...`` and ``R_j = Σ_{i>=j} s_(i)``,
    the solution saturates the first ``j*`` tokens (π = 1) and has ``c = (m − j*)/R_{j*}``, where
    ``j*`` is the first ``j`` with ``h(j) = R_j − (m − j)·s_(j) >= 0``. ``h`` is non-decreasing for
    ``j <= m − 1`` (``h(j+1) − h(j) = (m − j − 1)(s_(j) − s_(j+1))``) and ``h(⌈m⌉ − 1) >= 0``, so the
    bisection runs over ``j`` in ``[0, ⌈m⌉ − 1]`` (about log2(n) vectorized steps) and is exact up to
    float64 rounding, instead of iterating on ``c`` itself.

    Args:
        scores: [..., n] non-negative scores (any float dtype).
        eligible: [..., n] bool, the tail tokens that take part in the draw.
        expected: [...] or a number: the tail budget m (expected kept count), 0 <= m.

    Returns:
        [...] float64 scale c (0 where m = 0; where m equals the number of positive scores, the
        smallest c that keeps them all, ``1/min s``).

    Raises:
        PoissonDesignError: a score is negative or not finite, the budget is negative or not
            finite, or a row asks for more tokens than
            it has eligible tokens with a positive score (in particular: all scores zero).
    """
    s = torch.where(eligible, scores.to(torch.float64), torch.zeros((), dtype=torch.float64, device=scores.device))
    if not torch.isfinite(s).all() or (s < 0).any():
        raise PoissonDesignError("poisson scores must be finite and non-negative")
    m = torch.as_tensor(expected, dtype=torch.float64, device=s.device).expand(s.shape[:-1])  # [...]
    if not bool(torch.isfinite(m).all()) or bool((m < 0).any()):
        raise PoissonDesignError(f"the poisson tail budget must be a finite number >= 0, got {m.flatten()[:5].tolist()}")
    n_pos = (s > 0).sum(-1)  # [...]
    short = (m > n_pos + 1e-9) & (m > 0)
    if short.any():
        if (n_pos[short] == 0).all():
            raise PoissonDesignError(
                "poisson scores are all zero: no tail token can be drawn; use --score attention, or a model whose keys "
                "are not all zero")
        raise PoissonDesignError(
            f"poisson tail budget {float(m[short].max()):g} exceeds the {int(n_pos[short].min())} tail tokens with a "
            "positive score; raise the certain set (sinks, --sinks) or use another score (--score)")
    active = m > 0
    desc = torch.sort(s, dim=-1, descending=True).values  # [..., n]
    rest = desc.flip(-1).cumsum(-1).flip(-1)  # [..., n]  R_j = sum_{i >= j} s_(i)
    lo = torch.zeros(m.shape, dtype=torch.long, device=s.device)  # [...]
    hi = (m.ceil().long() - 1).clamp(min=0, max=s.shape[-1] - 1)  # [...]
    for _ in range(max(1, s.shape[-1]).bit_length() + 1):
        mid = (lo + hi) // 2
        h = rest.gather(-1, mid.unsqueeze(-1)).squeeze(-1) - (m - mid) * desc.gather(-1, mid.unsqueeze(-1)).squeeze(-1)
        lo, hi = torch.where(h >= 0, lo, mid + 1), torch.where(h >= 0, mid, hi)
    j = torch.minimum(lo, hi)  # [...] saturated tokens
    r_j = rest.gather(-1, j.unsqueeze(-1)).squeeze(-1)  # [...]
    c = (m - j) / torch.where(r_j > 0, r_j, torch.ones_like(r_j))
    return torch.where(active, c, torch.zeros_like(c))


def inclusion_probabilities(scores: torch.Tensor, eligible: torch.Tensor, expected: torch.Tensor | float) -> torch.Tensor:
    """Poisson inclusion probabilities ``π_i = min(1, c·score_i)`` on eligible tokens, 0 elsewhere.

    Args:
        scores: [..., n] non-negative scores.
        eligible: [..., n] bool tail tokens.
        expected: [...] or a number, the tail budget (``Σ π`` over eligible tokens equals it).

    Returns:
        [..., n] float64 probabilities in [0, 1].

    Raises:
        PoissonDesignError: see :func:`solve_scale`.
    """
    c = solve_scale(scores, eligible, expected)  # [...]
    s = scores.to(torch.float64)
    pi = torch.clamp(c.unsqueeze(-1) * s, min=0.0, max=1.0)  # [..., n]
    positive = eligible & (s > 0)  # [..., n]
    m = torch.as_tensor(expected, dtype=torch.float64, device=s.device).expand(s.shape[:-1])  # [...]
    everything = (m >= positive.sum(-1)) & (m > 0)  # [...] the budget covers every positive token: pi = 1 exactly
    pi = torch.where(everything.unsqueeze(-1) & positive, torch.ones_like(pi), pi)
    return torch.where(eligible, pi, torch.zeros_like(pi))


def check_probabilities(pi: torch.Tensor, name: str = "pi") -> None:
    """Check that every entry of ``pi`` is a probability: in [0, 1] and not NaN (any float dtype).

    Raises:
        ValueError: naming how many entries are NaN or outside [0, 1], and the first few.
    """
    if not pi.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of probabilities, got {pi.dtype}")
    bad = torch.isnan(pi) | (pi < 0) | (pi > 1)
    if bool(bad.any()):
        values = pi[bad].flatten()[:5].tolist()
        raise ValueError(f"{name} must lie in [0, 1]: {int(bad.sum())} entries are NaN or outside, e.g. {values}")


def draw(pi: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Independent Bernoulli(π_i) draws from given uniforms: kept where ``u_i < π_i``.

    The comparison is made in float64 (π of any float dtype — float16, bfloat16, float32, float64 —
    converts exactly), and ``π = 1`` is always kept and ``π = 0`` never, whatever the uniform: a
    float32 cast would round the float64 uniform ``1 − 2⁻²⁶`` up to 1 and drop a certain key.

    Args:
        pi: [..., n] inclusion probabilities in [0, 1].
        uniforms: [..., n] (broadcastable) uniforms in [0, 1], typically float64 from ``torch.rand``.

    Returns:
        [..., n] bool.

    Raises:
        ValueError: a π or a uniform is NaN or outside [0, 1].
    """
    check_probabilities(pi, "pi")
    check_probabilities(uniforms, "uniforms")
    p = pi.to(torch.float64)
    return ((uniforms.to(torch.float64) < p) | (p == 1)) & (p > 0)


def hajek_offsets(pi: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Additive logit offsets ``log(1/π_i)`` on kept tokens, 0 elsewhere (certain tokens: π = 1).

    Args:
        pi: [..., n] inclusion probabilities in [0, 1] (1 for certain tokens).
        kept: [..., n] bool.

    Returns:
        [..., n] offsets, same dtype as ``pi`` (computed in float64).

    Raises:
        ValueError: a π is NaN or outside [0, 1], or a kept token has π = 0 (it cannot have been drawn).
    """
    check_probabilities(pi, "pi")
    if bool((kept & (pi == 0)).any()):
        raise ValueError("a kept token has inclusion probability 0: it cannot have been drawn")
    p = pi.to(torch.float64)
    safe = torch.where(kept, p, torch.ones_like(p))
    return torch.where(kept, -torch.log(safe), torch.zeros_like(p)).to(pi.dtype)


def hajek_attention(logits: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """Hájek estimate of one attention output from the kept keys.

    ``ô = Σ_S (w_i/π_i) v_i / Σ_S (w_i/π_i)``, i.e. softmax over the kept keys of ``logit_i + log(1/π_i)``.
    With ``pi`` all ones this is the plain (uncorrected) attention over the kept keys.

    Args:
        logits: [..., n] attention logits ``q·k_i/√d``.
        values: [..., n, d] value vectors.
        kept: [..., n] bool (at least one kept key per row).
        pi: [..., n] inclusion probabilities (1 for certain keys).

    Returns:
        [..., d] the estimated output.
    """
    z = torch.where(kept, logits + hajek_offsets(pi, kept).to(logits.dtype), torch.full_like(logits, -math.inf))
    weights = torch.softmax(z, dim=-1)  # [..., n]
    return (weights.unsqueeze(-1) * values).sum(-2)  # [..., d]


def hajek_variance(logits: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, pi: torch.Tensor,
                   tail: torch.Tensor) -> torch.Tensor:
    """Variance estimate of the linearized Hájek error, from the kept set only.

    ``V̂ = (1/Ẑ²) Σ_{i∈S∩tail} (1 − π_i)/π_i² · w_i² · ‖v_i − ô‖²``, ``Ẑ = Σ_S w_i/π_i``
    (standard Poisson-design estimator; docs/method.md section 5 [ours]). The common factor of the
    ``w_i`` cancels, so logits are shifted by their kept maximum for stability.

    Args:
        logits: [..., n]; values: [..., n, d]; kept: [..., n] bool; pi: [..., n] (1 for certain).
        tail: [..., n] bool, the tokens drawn at random (certain tokens add no variance).

    Returns:
        [...] the variance estimate (squared units of ``values``, summed over the d coordinates).
    """
    check_probabilities(pi, "pi")
    neg = torch.full_like(logits, -math.inf)
    shift = torch.where(kept, logits, neg).amax(-1, keepdim=True)  # [..., 1]
    w = torch.where(kept, (logits - shift).exp(), torch.zeros_like(logits))  # [..., n]
    safe_pi = torch.where(kept, pi.to(logits.dtype), torch.ones_like(logits))
    z_hat = (w / safe_pi).sum(-1)  # [...]
    o_hat = hajek_attention(logits, values, kept, pi)  # [..., d]
    dev2 = ((values - o_hat.unsqueeze(-2)) ** 2).sum(-1)  # [..., n]
    terms = torch.where(kept & tail, (1 - safe_pi) / safe_pi**2 * w**2 * dev2, torch.zeros_like(w))
    return terms.sum(-1) / z_hat**2


def hajek_bias(logits: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, pi: torch.Tensor,
               tail: torch.Tensor) -> torch.Tensor:
    """Estimated bias of the Hájek ratio, the second-order term the linearization drops, from the kept set.

    ``E[ô − o] ≈ −Cov(Ŷ − oẐ, Ẑ)/Z² = −(1/Z²) Σ_tail (1 − π_i)/π_i · w_i² (v_i − o)`` (the ratio
    estimator's bias, Cochran, *Sampling Techniques*, 3rd ed., 1977, section 6.8, under Poisson
    sampling), estimated by ``b̂ = −(1/Ẑ²) Σ_{i∈S∩tail} (1 − π_i)/π_i² · w_i² (v_i − ô)``
    (docs/method.md section 5 [ours]). Its squared norm added to :func:`hajek_variance` estimates the
    mean squared error ``Var + ‖bias‖²`` (the ``hajek_bias`` variance of ``truncsens certify``).

    Args:
        logits: [..., n]; values: [..., n, d]; kept: [..., n] bool; pi: [..., n] (1 for certain);
        tail: [..., n] bool, the tokens drawn at random.

    Returns:
        [..., d] the bias estimate (units of ``values``).

    Raises:
        ValueError: a π is NaN or outside [0, 1].
    """
    check_probabilities(pi, "pi")
    shift = torch.where(kept, logits, torch.full_like(logits, -math.inf)).amax(-1, keepdim=True)  # [..., 1]
    w = torch.where(kept, (logits - shift).exp(), torch.zeros_like(logits))  # [..., n]
    safe_pi = torch.where(kept, pi.to(logits.dtype), torch.ones_like(logits))
    z_hat = (w / safe_pi).sum(-1)  # [...]
    o_hat = hajek_attention(logits, values, kept, pi)  # [..., d]
    coef = torch.where(kept & tail, (1 - safe_pi) / safe_pi**2 * w**2, torch.zeros_like(w))  # [..., n]
    return -(coef.unsqueeze(-1) * (values - o_hat.unsqueeze(-2))).sum(-2) / z_hat.unsqueeze(-1) ** 2


def certificate_radius(variance: torch.Tensor, delta: float = 0.05) -> torch.Tensor:
    """Normal certificate radius ``z_{1−δ/2}·sqrt(V̂)`` for the attention-output error norm.

    Args:
        variance: [...] variance estimates from :func:`hajek_variance`.
        delta: miss probability in (0, 1).

    Raises:
        ValueError: ``delta`` outside (0, 1).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    z = NormalDist().inv_cdf(1 - delta / 2)
    return z * variance.clamp(min=0).sqrt()


def empirical_bernstein_radius(sample_variance: torch.Tensor, n: torch.Tensor | int, value_range: float,
                               delta: float = 0.05) -> torch.Tensor:
    """Empirical-Bernstein radius of Maurer and Pontil (2009, Theorem 4), two-sided.

    ``r = sqrt(2·V·ln(4/δ)/n) + 7·B·ln(4/δ)/(3(n − 1))`` for the mean of n independent draws in a
    range of width B with sample variance V (δ/2 per side).

    Raises:
        ValueError: ``delta`` outside (0, 1) or n < 2.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    n = torch.as_tensor(n, dtype=torch.float64)
    if (n < 2).any():
        raise ValueError("the empirical-Bernstein radius needs at least 2 draws")
    log_term = math.log(4 / delta)
    return (2 * sample_variance.to(torch.float64) * log_term / n).sqrt() + 7 * value_range * log_term / (3 * (n - 1))
