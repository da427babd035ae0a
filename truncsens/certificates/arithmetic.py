"""The emitted certificate: the statistical radius plus the arithmetic error bound of the
computation that produced ô, and the records a summary reads from a certify results file.

A server computes the Hájek output ô in its dtype, so the ô it emits differs from the exact-arithmetic
ô by rounding, which no statistic of the kept set bounds. The certificate it can emit is therefore

    r_cert = r_EB + b·‖ô‖,          b = ARITH_FACTOR · eps(dtype)   (float32: 7.63e-6),

by the triangle inequality ``‖ô_dtype − o‖ ≤ ‖ô_dtype − ô‖ + ‖ô − o‖`` (the sum, not the larger
of the two: each term bounds a different part of the error). ``‖ô‖`` is read off the kept set, so
the server has it; ``‖o‖`` (``attn_norm``) and the error ``‖ô − o‖`` (``attn_error``) are
full-cache (oracle) quantities that only the measurement has.

Why ``ARITH_FACTOR = 64``: the bound is declared per dtype before anything is measured, and must
exceed what the run's arithmetic was measured to do. The full-cache float32 attention output of
the reference model was measured up to 2.84e-6·‖o‖ from its float64 value (``attn_floor_error``,
N = 1,024), 24 eps; the earlier declaration, 10 eps (1.19e-6), lay below it. The rounding error of a
sum of n terms grows like √n·eps in the probabilistic model of rounding (Higham and Mary, SIAM J.
Sci. Comput. 41(5), 2019), 32 eps for n = 1,024 keys; 64 eps is twice that. The measured values do
not follow √n (3.4e-6, 28 eps, at N = 64): a relative difference is largest where ‖o‖ is small
against the values summed. What supports the factor is its margin, 2.2 to 2.7 times every value
measured so far; the summary reports the measured maximum beside b and warns when it exceeds b. A record whose error is at most ``b·‖ô‖`` is "at the floor": its error
cannot be told from the run's own rounding. Such records are counted in coverage (the certificate
covers them through ``b``) and reported as their own column.
"""

from __future__ import annotations

import numpy as np

ARITH_FACTOR = 64  # the declared arithmetic bound: ARITH_FACTOR x eps of the run's dtype, relative to ||o_hat||
ARITH_REFERENCE = "||o_hat||"  # what the relative bound multiplies: a quantity of the kept set
LEGACY_FLOOR_FACTOR = 10  # the floor declared before (attr error_floor_relative, x eps, relative to ||o||):
# kept in results files because the design benchmarks' rules were written under it


def declared_bound(dtype: str, factor: float = ARITH_FACTOR) -> float:
    """The relative arithmetic bound ``b = factor · eps(dtype)`` declared before measuring (float32:
    7.63e-6 at the default :data:`ARITH_FACTOR`, module docstring; :data:`LEGACY_FLOOR_FACTOR` gives
    the earlier floor, 1.19e-6).

    Raises:
        truncsens.models.ModelLoadError: an unknown dtype name.
    """
    import torch

    from truncsens.models import resolve_dtype

    return factor * float(torch.finfo(resolve_dtype(dtype)).eps)


def emitted_radius(radius_eb: np.ndarray, o_hat_norm: np.ndarray, bound_relative: float) -> np.ndarray:
    """``r_cert = r_EB + b·‖ô‖`` (module docstring), the certificate a server emits.

    Args:
        radius_eb: [...] statistical (empirical-Bernstein) radius, values' units; NaN where the
            policy has no random design (stays NaN), +inf stays +inf.
        o_hat_norm: [...] ``‖ô‖₂``, same units, broadcastable.
        bound_relative: ``b`` (:func:`declared_bound`), >= 0.

    Returns:
        [...] float64.

    Raises:
        ValueError: a negative ``bound_relative``.
    """
    if not bound_relative >= 0:
        raise ValueError(f"the arithmetic bound must be >= 0, got {bound_relative}")
    return np.asarray(radius_eb, float) + bound_relative * np.asarray(o_hat_norm, float)


def bound_relative_of(ds) -> float:
    """``b`` of a results file: the attr ``arithmetic_bound_relative``, else (files before it) the
    declared floor ``error_floor_relative``, else 0 (files before any floor)."""
    for name in ("arithmetic_bound_relative", "error_floor_relative"):
        value = ds.attrs.get(name)
        if value is not None:
            return float(value)
    return 0.0


RECORD_VARS = ("attn_error", "attn_norm", "radius_eb", "radius_normal", "attn_variance", "value_range", "n_random",
               "has_tail")


def certificate_records(ds, policy: str, budget: int | None = None) -> dict[str, np.ndarray]:
    """The attention records of one policy (and budget), each [target, (budget,) layer, head], with
    ``radius_certificate`` and ``arith_bound`` (``b·‖ô‖``) added.

    A file written before ``radius_certificate`` existed is summarised by computing it on load:
    from ``attn_hat_norm`` when the file has it, else from the oracle ``‖o‖`` (``attn_norm``) in
    place of ``‖ô‖`` (then ``"oracle_norm": True``; the two differ by at most the error).
    """
    sel = ds.sel(policy=policy) if budget is None else ds.sel(policy=policy, budget=budget)
    r = {v: sel[v].values for v in RECORD_VARS}
    b = bound_relative_of(ds)
    oracle = "attn_hat_norm" not in sel
    norm = sel["attn_norm"].values if oracle else sel["attn_hat_norm"].values
    r["arith_bound"] = b * np.asarray(norm, float)
    r["radius_certificate"] = (sel["radius_certificate"].values if "radius_certificate" in sel
                               else emitted_radius(r["radius_eb"], norm, b))
    r["oracle_norm"] = oracle
    return r
