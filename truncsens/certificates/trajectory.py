"""The e-process of :mod:`truncsens.certificates.eprocess` on a real generated trajectory: greedy
continuation of a held-out prefix under certainty-plus-Poisson eviction, with the per-step
certificate and the true error of every layer and KV head read by the certify probe.

Step t = 1..n: the sequence so far (prefix + tokens generated so far, T tokens) is run through
:func:`truncsens.certificates.passes.certify_batch` with the poisson policy at budget k (prefill-evict
semantics: the last token's query reads an evicted cache in every layer, drawn afresh with seed
``doc_seed(seed, "trajectory:t")``); the next token is the top-1 token of the evicted run (the
trajectory evicts as it goes). Each (layer, head) of the last query is one certificate stream: its
error ``e_t = ‖ô − o‖₂`` is compared with the empirical-Bernstein radius at the step level
``δ_t = δ/(t(t + 1))`` (the confidence sequence, time-uniform at level δ per stream) and, naively,
at δ at every step. The radii at any level follow from the stored V̂, B̂ and n exactly
(:func:`truncsens.certificates.statistics.radii_at`), since δ does not enter the forward pass.
A stream whose design has no random key at a step has radius 0 there, so any error of that step
counts as a miss (a deterministic loss is not certified).

Under streaming (:func:`streamed_trajectory`) one cache streams the prefix and the generated tokens,
evicting as it goes; each step's record is read from that step's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from truncsens.certificates.eprocess import e_process, rejects, step_levels
from truncsens.certificates.designs import CertifyDesign
from truncsens.certificates.passes import certify_batch
from truncsens.certificates.statistics import radii_at
from truncsens.certificates.stream_passes import stream_run
from truncsens.policies import Policy
from truncsens.targets import doc_seed


@dataclass
class Trajectory:
    """A greedy trajectory under eviction (n steps, L layers, H heads).

    Attributes:
        prefix: [T0] int64 prefix token ids; tokens: [n] int64 generated ids.
        budget: kept keys per step (tokens); delta: the overall level.
        error: [n, L, H] float64 ``‖ô − o‖₂``.
        radius_step: [n, L, H] EB radius at level δ_t; radius_naive: [n, L, H] at level δ.
        has_tail: [n, L, H] bool, the design had random keys.
    """

    prefix: torch.Tensor
    tokens: torch.Tensor
    budget: int
    delta: float
    error: np.ndarray
    radius_step: np.ndarray
    radius_naive: np.ndarray
    has_tail: np.ndarray

    @property
    def misses(self) -> np.ndarray:
        """[n, L, H] bool: the step-level certificate missed (``e_t > r_t(δ_t)``)."""
        return self.error > self.radius_step

    @property
    def naive_misses(self) -> np.ndarray:
        """[n, L, H] bool: the certificate at level δ, read at every step, missed."""
        return self.error > self.radius_naive

    def e_values(self) -> np.ndarray:
        """[L, H, n] the e-process ``E_t`` of each (layer, head) stream
        (:func:`~truncsens.certificates.eprocess.e_process`)."""
        return e_process(np.moveaxis(self.misses, 0, -1), self.delta)


@torch.no_grad()
def greedy_trajectory(model, prefix: torch.Tensor, policy: Policy, budget: int, n_steps: int, delta: float,
                      seed: int = 0, design: CertifyDesign = CertifyDesign()) -> Trajectory:
    """Continue ``prefix`` greedily for ``n_steps`` under ``policy`` (poisson) at ``budget``.

    Args:
        model: a causal LM the certify probe accepts (:func:`truncsens.certificates.probe.check_model`).
        prefix: [T0] int64 token ids, T0 > budget (on the model's device).
        policy: a policy with a random design (``design()``), normally poisson.
        budget: kept keys of each step's query (tokens), at most ``T0 − 1``.
        n_steps: steps n >= 1; delta: overall level in (0, 1).

    Returns:
        :class:`Trajectory`.

    Raises:
        ValueError: n < 1, δ outside (0, 1), a budget at or above the prefix, or a policy without a
            random design (its certificate is always 0).
    """
    _check(policy, budget, prefix)
    levels = step_levels(n_steps, delta)  # [n]; also checks n and δ
    seq = prefix.clone()
    steps, tokens = [], []
    for t in range(1, n_steps + 1):
        out = certify_batch(model, seq.unsqueeze(0), [policy], [budget], [[[doc_seed(seed, f"trajectory:{t}")]]], delta,
                            design)
        nxt = out.logprobs[0, 0, 0].argmax()
        tokens.append(int(nxt))
        steps.append({name: v[0, 0, 0].numpy() for name, v in out.records.items()})  # each [L, H]
        seq = torch.cat([seq, nxt.view(1).to(seq.device)])
    return _trajectory(prefix, tokens, budget, delta, steps, levels)


@torch.no_grad()
def streamed_trajectory(model, prefix: torch.Tensor, policy: Policy, budget: int, n_steps: int, delta: float,
                        seed: int = 0, design: CertifyDesign = CertifyDesign()) -> Trajectory:
    """As :func:`greedy_trajectory`, under streaming: one cache streams ``prefix`` and then its own
    greedy tokens, evicting per layer and key/value head as it goes (never re-admitting a key), with
    one draw per key for the whole run (seed ``doc_seed(seed, "trajectory:stream")``); step t's
    record is that of the query of the t-th generated position, read from the cache of that step
    (:func:`truncsens.certificates.stream_passes.stream_run` with ``generate = n``).

    Raises:
        ValueError: as :func:`greedy_trajectory`.
    """
    _check(policy, budget, prefix)
    levels = step_levels(n_steps, delta)  # [n]; also checks n and δ
    run = stream_run(model, prefix.unsqueeze(0), policy, budget, [doc_seed(seed, "trajectory:stream")], delta, design,
                     generate=n_steps)
    steps = [{name: v[0].cpu().numpy() for name, v in step.items()} for step in run.steps]  # each [L, H]
    return _trajectory(prefix, run.generated[0].tolist(), budget, delta, steps, levels)


def _check(policy: Policy, budget: int, prefix: torch.Tensor) -> None:
    if not hasattr(policy, "design"):
        raise ValueError(f"policy {policy.name!r} has no random design: its certificate radius is 0 at every step")
    if budget >= prefix.numel():
        raise ValueError(f"the trajectory budget {budget} must lie below the prefix length {prefix.numel()}")


def _trajectory(prefix: torch.Tensor, tokens: list[int], budget: int, delta: float, steps: list[dict],
                levels: np.ndarray) -> Trajectory:
    """The :class:`Trajectory` of n step records (name -> [L, H]) at step levels ``levels`` [n]."""
    var, rng_, n_r, tail = (np.stack([s[name] for s in steps]) for name in
                            ("variance", "value_range", "n_random", "has_tail"))  # [n, L, H]
    step_radius = np.stack([radii_at(var[i], rng_[i], n_r[i], tail[i], float(levels[i]))[0] for i in range(len(steps))])
    naive, _ = radii_at(var, rng_, n_r, tail, delta)
    error = np.stack([s["error"] for s in steps])
    return Trajectory(prefix.cpu(), torch.tensor(tokens, dtype=torch.long), budget, delta, error, step_radius,
                      naive, tail > 0)


def trajectory_summary(traj: Trajectory) -> dict:
    """JSON-ready summary: per-step misses (step level and naive, counted over layer × head streams),
    the largest e-value per stream, how many streams the confidence sequence / the naive reading
    ever violated, and the bound δ × streams the former's expected count obeys."""
    L, H = traj.error.shape[1:]
    e = traj.e_values()  # [L, H, n]
    violated = rejects(np.moveaxis(traj.misses, 0, -1), traj.delta)  # [L, H]
    naive = traj.naive_misses.any(0)  # [L, H]
    return {
        "n_steps": int(traj.tokens.numel()), "budget": traj.budget, "prefix_tokens": int(traj.prefix.numel()),
        "delta": traj.delta, "streams": int(L * H),
        "misses_per_step": traj.misses.reshape(len(traj.tokens), -1).sum(1).tolist(),
        "naive_misses_per_step": traj.naive_misses.reshape(len(traj.tokens), -1).sum(1).tolist(),
        "steps_with_random_keys": int(traj.has_tail.any((1, 2)).sum()),
        "max_e_value": float(e.max()), "threshold": 1 / traj.delta,
        "violated_streams": int(violated.sum()), "naive_violated_streams": int(naive.sum()),
        "expected_violated_at_most": traj.delta * L * H,
        "generated_tokens": traj.tokens.tolist(),
    }
