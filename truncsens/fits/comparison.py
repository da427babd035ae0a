"""Which decay law extrapolates best: ranking the fitted families of one curve and metric by their
held-out error, with the error ratio's bootstrap interval (docs/fit.md). Pure numpy (the curve is
only read for its label and file).

Comparison: ``factor`` = runner-up error / winner error, its interval from the same document
resamples as the fits (it may reach below 1 when the two are close); a ratio interval containing 1
is "undecided". ``power_vs_exponential`` = exponential error / power error (> 1: the power law
extrapolates better, the paper's comparison, arXiv 2605.25085). With no held-out point the
comparison falls back to AIC (``factor`` = exp(dAIC / 2), the inverse relative likelihood; Burnham
& Anderson, *Model Selection and Multimodel Inference*, 2002).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

from truncsens.fits.laws import FAMILY_RECORDS

_N_PARAMS = {f.name: f.n_params for f in FAMILY_RECORDS}
from truncsens.stats import interval_or_none

if TYPE_CHECKING:
    from truncsens.fits.curves import Curve


def ratio_undecided(ci: Sequence[float | None] | None) -> bool:
    """Whether an error-ratio interval contains 1 (the data do not tell the two families apart)."""
    return bool(ci) and all(c is not None and math.isfinite(c) for c in ci) and ci[0] <= 1.0 <= ci[1]


TIE_RTOL = 1e-6  # held-out errors this close (relative) differ only by the optimizers' tolerances (trf vs closed-form WLS)


def rank_by_error(errors: dict[str, float]) -> list[str]:
    """Families ordered by held-out error (lower first). Errors within ``TIE_RTOL`` of each other
    count as equal and the family with fewer parameters comes first (then the name), so a
    ``power_floor`` whose floor fits at 0 — the same curve as ``power`` — always ranks after it,
    whatever the last digits of the two optimizations."""
    def key(f: str):
        tied_to = min((g for g in errors if abs(errors[g] - errors[f]) <= TIE_RTOL * max(abs(errors[f]), 1e-300)),
                      key=lambda g: errors[g])
        return (errors[tied_to], _N_PARAMS.get(f, 99), f)
    return sorted(errors, key=key)


def compare_families(curve: Curve, metric: str, mae: dict[str, np.ndarray], point: dict[str, dict], level: float) -> dict:
    """Rank the converged families of one metric: by held-out error ([1+B] per family), else by AIC.
    ``undecided``: the interval of the error ratio runner-up / winner contains 1."""
    out = {"curve": None, "label": curve.label, "results_file": curve.results_file, "metric": metric,
           "mae": {f: float(v[0]) for f, v in mae.items()}, "aic": {f: p["aic"] for f, p in point.items()},
           "basis": None, "winner": None, "runner_up": None, "factor": None, "power_vs_exponential": None,
           "undecided": None}
    usable = {f: v for f, v in mae.items() if np.isfinite(v[0])}
    if len(usable) >= 2:
        ranked = rank_by_error({f: float(v[0]) for f, v in usable.items()})
        win, run = ranked[0], ranked[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            fac = usable[run] / usable[win]
        ci = interval_or_none(fac[1:], level)
        out.update(basis="extrapolation", winner=win, runner_up=run, factor={"value": float(fac[0]), "ci": ci},
                   undecided=ratio_undecided(ci))
        if "power" in usable and "exponential" in usable:
            with np.errstate(divide="ignore", invalid="ignore"):
                pve = usable["exponential"] / usable["power"]
            pci = interval_or_none(pve[1:], level)
            out["power_vs_exponential"] = {"value": float(pve[0]), "ci": pci, "undecided": ratio_undecided(pci)}
    elif sum(not math.isnan(p["aic"]) for p in point.values()) >= 2:
        ranked = sorted((f for f in point if not math.isnan(point[f]["aic"])), key=lambda f: point[f]["aic"])
        win, run = ranked[0], ranked[1]
        diff = point[run]["aic"] - point[win]["aic"]
        out.update(basis="aic", winner=win, runner_up=run,
                   factor={"value": float(math.exp(min(diff / 2, 700))) if math.isfinite(diff) else math.inf, "ci": None})
    return out
