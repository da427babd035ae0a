"""The streaming certainty-plus-Poisson design keeps its inclusion probabilities known.

Over many seeds (one row each), every tail key that the cache holds with inclusion probability
π_old survives a step with the probability ρ = π_new/π_old the step records (calibration of the
recorded survival probabilities), and at the end ``E[I_j/π_j] = 1`` for every key j (the
Horvitz–Thompson identity that makes the Hájek output consistent). Both checks fail for a π that is
not the key's inclusion probability, e.g. the π of its first draw kept for its life (the design of
earlier versions, which then cut the tail by score).
"""

from __future__ import annotations

import math

import torch

from truncsens.policies import make_policy
from truncsens.policies.streaming import ChunkStats, run_stream

ROWS, T, K = 4000, 40, 8


def _streamed():
    """Run poisson (2 sinks, k = 8: recent 2, top 2, tail m = 2) over ROWS rows with fixed attention
    rows (the same for every seed), recording every step's view and answer."""
    g = torch.Generator().manual_seed(5)
    rows = {e: torch.rand(e, generator=g) ** 3 for e in range(1, T + 1)}  # one attention row per step
    seen = []

    class Recorder(type(make_policy("poisson"))):
        def evict(self, view):
            step = super().evict(view)
            seen.append((view.alive.clone(), view.drawn.clone(), view.inclusion().clone(), step))
            return step

    def observe(s, e, alive, offset):
        w = rows[e].expand(alive.shape[0], 1, e)
        return ChunkStats(attention=w / w.sum(-1, keepdim=True))

    run_stream(Recorder(n_sink=2), K, T, 1, list(range(ROWS)), observe)
    return seen


def _z(hits: torch.Tensor, p: torch.Tensor) -> float:
    """(Σ hits − Σ p) / sqrt(Σ p(1 − p)): a binomial z-score."""
    return float((hits.sum() - p.sum()) / (p * (1 - p)).sum().clamp_min(1e-12).sqrt())


def test_survival_frequencies_match_the_recorded_probabilities():
    seen = _streamed()
    rho, hit = [], []
    for alive, drawn, pi_old, step in seen:
        held = alive & drawn & step.drawn  # tail keys held before the step, thinned by it
        r = torch.where(held, step.pi / pi_old, torch.zeros_like(pi_old))
        rho.append(r[held])
        hit.append(step.keep[held].double())
    rho, hit = torch.cat(rho), torch.cat(hit)
    thinned = rho < 1
    assert int(thinned.sum()) > 10_000  # enough transitions that are random
    assert abs(_z(hit[thinned], rho[thinned])) < 4
    for lo, hi in ((0, 0.3), (0.3, 0.6), (0.6, 0.9), (0.9, 1.0)):
        band = thinned & (rho >= lo) & (rho < hi)
        assert int(band.sum()) > 150
        assert abs(_z(hit[band], rho[band])) < 4, (lo, hi)


def test_horvitz_thompson_identity_holds_for_the_recorded_pi_only():
    seen = _streamed()
    alive, drawn, pi_old, last = seen[-1]
    kept = last.keep  # [ROWS, e] after the last step
    pi = torch.where(kept, last.pi, torch.ones_like(last.pi))
    ratio = torch.where(kept, 1 / pi, torch.zeros_like(pi))  # I_j / π_j
    tail = last.drawn[0].clone()
    tail &= last.drawn.all(0)  # keys drawn in every row (the early keys: thinned many times)
    assert int(tail.sum()) >= 10
    per_row = ratio[:, tail].mean(1)  # [ROWS] rows are independent: a CLT over rows
    mean, se = float(per_row.mean()), float(per_row.std()) / math.sqrt(ROWS)
    assert abs(mean - 1) < 4 * se, (mean, se)
    assert se < 0.05  # the check has power
    # the π of a key's first draw, kept for its life, is not its inclusion probability
    first = torch.ones_like(pi)
    for a, d, p_old, step in seen:
        new = step.drawn & ~d  # drawn for the first time at this step
        first[:, : new.shape[1]] = torch.where(new, step.pi, first[:, : new.shape[1]])
    wrong = torch.where(kept, 1 / first, torch.zeros_like(first))[:, tail].mean(1)  # [ROWS]
    assert abs(float(wrong.mean()) - 1) > 10 * float(wrong.std()) / math.sqrt(ROWS)
