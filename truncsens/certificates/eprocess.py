"""Time-uniform validity of per-step certificates over a trajectory: an e-process and the confidence
sequence it gives. Pure numpy.

Setting (arXiv 2607.21475, "an e-process extends the per-step certificate to time-uniform
validity"; the construction below is [ours], the simplest valid one): at step t = 1, 2, ... of a
generated trajectory a certificate of level δ_t claims ``e_t <= r_t(δ_t)`` with
``P(e_t > r_t(δ_t)) <= δ_t`` given the past. Read naively at level δ at every step, the chance of
*some* miss over n steps grows to ``1 − (1 − δ)^n``.

Construction. Fix weights ``w_t = 1/(t(t + 1))`` (they sum to 1) and run step t at level
``δ_t = δ·w_t``. Define the nondecreasing process

    E_t = Σ_{s<=t} w_s · 1{e_s > r_s(δ_s)} / δ_s .

Each summand has conditional expectation at most ``w_s``, so ``E[E_∞] <= Σ_s w_s = 1`` and, E being
nondecreasing, ``E[E_τ] <= 1`` at every stopping time τ: E is an e-process for the hypothesis "every
certificate holds". By Markov's inequality ``P(∃t: E_t >= 1/δ) = P(E_∞ >= 1/δ) <= δ``. A single miss
at step s adds ``w_s/δ_s = 1/δ``, so ``E`` crosses 1/δ exactly when some certificate misses: the
radii ``r_t(δ_t)`` form a confidence sequence, valid simultaneously over all steps with probability
at least 1 − δ (a union bound, as Howard et al., arXiv 1810.08240, discuss for stitched
boundaries). The price is the slowly shrinking level ``δ_t``: for the normal radius
``z_{1−δ_t/2}`` grows like ``sqrt(2 ln(t²/δ))``.
"""

from __future__ import annotations

import numpy as np


def step_weights(n_steps: int) -> np.ndarray:
    """[n] ``w_t = 1/(t(t+1))``, t = 1..n (they sum to ``1 − 1/(n+1)`` < 1)."""
    t = np.arange(1, n_steps + 1, dtype=np.float64)
    return 1.0 / (t * (t + 1))


def step_levels(n_steps: int, delta: float) -> np.ndarray:
    """[n] per-step miss levels ``δ_t = δ·w_t`` of the confidence sequence.

    Raises:
        ValueError: δ outside (0, 1) or n < 1.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    if n_steps < 1:
        raise ValueError(f"a trajectory needs at least one step, got {n_steps}")
    return delta * step_weights(n_steps)


def e_process(misses: np.ndarray, delta: float) -> np.ndarray:
    """``E_t`` of the module docstring for trajectories of certificate misses.

    Args:
        misses: [..., n] bool, step t's certificate (at level ``δ_t``) missed.
        delta: the overall level.

    Returns:
        [..., n] float64 nondecreasing e-process values (crossing ``1/δ`` at the first miss).
    """
    m = np.asarray(misses, dtype=bool)
    w = step_weights(m.shape[-1])
    return np.cumsum(m * (w / step_levels(m.shape[-1], delta)), axis=-1)


def rejects(misses: np.ndarray, delta: float) -> np.ndarray:
    """[...] bool: the e-process reaches ``1/δ`` somewhere on the trajectory (a time-uniform miss)."""
    return (e_process(misses, delta) >= (1 - 1e-12) / delta).any(-1)
