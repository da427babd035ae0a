"""The emitted certificate: the statistical radius plus a declared tolerance, and the records a
summary reads from a certify results file.

Two statements, each with its own coverage (:mod:`truncsens.certificates.coverage_report`):

1. **statistical**: ``‖ô − o‖ ≤ r_EB(δ)`` with probability at least 1 − δ over the Poisson draw
   (empirical Bernstein over the kept tail); ``ô`` and ``o`` both in exact (float64) arithmetic.
2. **emitted certificate**: ``‖ô − o‖ ≤ r_EB(δ) + τ·‖ô‖``, with the **tolerance**

       τ = ARITH_FACTOR · eps(dtype)   (float32: 7.63e-6).

The tolerance is a declared relative slack, not a bound on rounding. It was first argued as one (a
server's ô differs from the exact ô by rounding; ``‖ô_dtype − o‖ ≤ ‖ô_dtype − ô‖ + ‖ô − o‖``), but
two things keep it from being one: the error the coverage is checked against, ``attn_error``, is the
float64 error ``‖ô − o‖``, which holds no rounding; and the float32 rounding of ô itself, measured on
the reference model, exceeds ``τ·‖ô‖`` in about 0.07 % of draws (up to 2.4×). What the term does is
cover records whose error is tiny against ``‖ô‖`` (heads whose tail holds no attention mass: errors
near 1e-10 relative) and that ``r_EB`` misses; the summary reports coverage as a function of τ
(τ = 0: statement 1) so a user sees how much of the coverage the tolerance supplies.

Why ``ARITH_FACTOR = 64``: declared before anything was measured, above the largest full-cache
float32-vs-float64 difference of the reference model's attention output (``attn_floor_error``,
2.84e-6·‖o‖ at N = 1,024, 24 eps; the earlier declaration, 10 eps, lay below it) and twice the
√n·eps growth of a sum of 1,024 terms in the probabilistic model of rounding (Higham and Mary, SIAM J.
Sci. Comput. 41(5), 2019). The summary reports that measured maximum beside τ and warns when it
exceeds τ. ``‖ô‖`` is read off the kept set, so the server has it; ``‖o‖`` (``attn_norm``) and the
error are full-cache (oracle) quantities that only the measurement has. A record whose error is at
most ``τ·‖ô‖`` is "at the floor"; such records are counted in every coverage and as their own column.
The names ``arith_bound``, ``arithmetic_bound_relative`` and ``floor`` stay for the files and JSON
keys users already read.
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
    ``radius_certificate``, ``o_hat_norm`` (``‖ô‖``) and ``arith_bound`` (the tolerance ``τ·‖ô‖``) added,
    and ``tail_mass`` (``attn_tail_mass``) where the file has it.

    A file written before ``radius_certificate`` existed is summarised by computing it on load:
    from ``attn_hat_norm`` when the file has it, else from the oracle ``‖o‖`` (``attn_norm``) in
    place of ``‖ô‖`` (then ``"oracle_norm": True``; the two differ by at most the error).
    """
    sel = ds.sel(policy=policy) if budget is None else ds.sel(policy=policy, budget=budget)
    r = {v: sel[v].values for v in RECORD_VARS}
    b = bound_relative_of(ds)
    oracle = "attn_hat_norm" not in sel
    norm = sel["attn_norm"].values if oracle else sel["attn_hat_norm"].values
    r["o_hat_norm"] = np.asarray(norm, float)
    r["arith_bound"] = b * r["o_hat_norm"]
    r["radius_certificate"] = (sel["radius_certificate"].values if "radius_certificate" in sel
                               else emitted_radius(r["radius_eb"], norm, b))
    r["oracle_norm"] = oracle
    if "attn_tail_mass" in sel:  # files before it: no tail mass
        r["tail_mass"] = sel["attn_tail_mass"].values
    return r
