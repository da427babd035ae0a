"""Decay laws of D(w) and their weighted least-squares fits in log space (pure numpy/scipy).

Families (power law and exponent ratio from arXiv 2605.25085), one :class:`Family` record each in
:data:`FAMILY_RECORDS` (name, parameters, law, point and batch fits, plot style and label, help words):

- ``power``       D = C w^-alpha          log D = log C - alpha log w   (statsmodels WLS)
- ``exponential`` D = C exp(-w / tau)     log D = log C - w / tau       (statsmodels WLS)
- ``power_floor`` D = C w^-alpha + D_inf  (scipy.optimize.least_squares on log D, D_inf >= 0)

``w`` is a point of the sweep in tokens (a window w, or a retention budget k). Each law is fitted
to the mean curve in log space by weighted least squares, weight of a point = 1 / var(log mean)
~= (mean / se)^2 (delta method). AIC = -2 llf + 2 p with the Gaussian WLS log-likelihood of
statsmodels (``llf = -n/2 (log(2 pi WRSS/n) + 1) + 1/2 sum log weights``; Akaike, IEEE TAC 19(6),
1974), p = number of law parameters. Extrapolation error: mean absolute error of log D on held-out
points. No file or model access here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from truncsens.fits.least_squares import (FitError, lm_power_floor, log_weights, power_floor_point, weighted_line,
                                         wls_aic, wls_line)

__all__ = ["FAMILIES", "FAMILY_RECORDS", "Family", "FitError", "extrapolation_mae", "family_record", "fit_family",
           "fit_family_batch", "law_log", "law_value", "log_weights", "weighted_line", "wls_aic"]


def law_log(family: str, params: dict[str, np.ndarray | float], w: np.ndarray) -> np.ndarray:
    """log D predicted by a law at windows ``w`` (broadcasting: params [...,1] x w [S]).

    Raises:
        ValueError: unknown family.
    """
    law = family_record(family).log_law
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return law(params, np.asarray(w, dtype=np.float64))


def law_value(family: str, params: dict[str, float], w: np.ndarray | float) -> np.ndarray:
    """D predicted by a law at windows ``w`` (``exp`` of :func:`law_log`)."""
    return np.exp(law_log(family, params, np.asarray(w, dtype=np.float64)))


def fit_family(family: str, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    """Point fit of one family to one curve (statsmodels WLS or scipy least_squares).

    Args:
        family: a name of :data:`FAMILIES`.
        x: [S] windows in tokens.
        y, w: [S] log mean and weights (from :func:`log_weights`); weight 0 drops a window.

    Returns:
        dict of the family's parameters (its record's ``params``) plus ``wrss`` (weighted residual
        sum of squares in log space), ``aic`` (NaN when there are no more windows than
        parameters), ``converged`` (bool, from the optimizer's own status) and ``optimizer`` (its
        method and message). WLS (power, exponential) is a closed-form solve: it converged when
        the design has full rank and the estimates are finite. ``power_floor``: scipy's
        ``least_squares`` status > 0 (a tolerance met; 0 = evaluation limit reached); a floor the
        optimizer leaves at its bound (``active_mask``, or below
        :data:`truncsens.fits.least_squares.FLOOR_AT_BOUND` of the
        smallest fitted D) is reported as exactly 0.

    Raises:
        FitError: fewer usable windows than parameters, or the optimizer found no finite solution.
        ValueError: unknown family.
    """
    record = family_record(family)
    x = np.asarray(x, dtype=np.float64)
    keep = w > 0
    need = record.n_params + 1  # more windows than parameters: an exact fit says nothing about the law
    if keep.sum() < need:
        raise FitError(f"{family} needs at least {need} windows with a positive mean in the fit range, got {int(keep.sum())}")
    xs, ys, ws = x[keep], y[keep], w[keep]
    params, converged, optimizer = record.point_fit(xs, ys, ws)
    wrss = float((ws * (ys - law_log(family, params, xs)) ** 2).sum())
    params["wrss"] = wrss
    # with no residual degrees of freedom the fit is exact and AIC compares nothing
    params["aic"] = wls_aic(wrss, ws, record.n_params) if xs.size > record.n_params else math.nan
    params["converged"] = bool(converged)
    params["optimizer"] = optimizer
    return params


def fit_family_batch(family: str, x: np.ndarray, y: np.ndarray, w: np.ndarray, start: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """The same fits for many curves at once (bootstrap resamples), vectorized in numpy.

    ``power`` and ``exponential`` are the closed-form WLS line (identical to statsmodels);
    ``power_floor`` runs a batched Levenberg-Marquardt (Marquardt scaling, ``D_inf >= 0`` by
    projection) from ``start`` (the point fit), checked against scipy in the tests; a resample
    whose iteration did not converge (iteration limit reached) gets NaN parameters.

    Args:
        x: [S] windows; y, w: [B, S] log means and weights.
        start: point-fit parameters (needed for ``power_floor``).

    Returns:
        family parameters, each [B] (NaN where a resample cannot be fitted).

    Raises:
        ValueError: unknown family.
    """
    return family_record(family).batch_fit(np.asarray(x, dtype=np.float64), y, w, start)


def extrapolation_mae(family: str, params: dict, x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Mean absolute error of log D on held-out windows.

    Args:
        params: family parameters, floats or [B] arrays.
        x: [H] held-out windows; y: [..., H] observed log means; valid: [..., H] bool.

    Returns:
        [...] MAE (NaN where no held-out window is valid).
    """
    p = {k: np.asarray(v, dtype=np.float64)[..., None] for k, v in params.items()}
    pred = law_log(family, p, np.asarray(x, dtype=np.float64))
    err = np.where(valid, np.abs(y - pred), 0.0)
    n = valid.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, err.sum(-1) / n, np.nan)


# --- the families: each law's own routines, then one record per family --------------------------------


def _power_point(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[dict[str, float], bool, str]:
    b0, b1, converged, optimizer = wls_line(np.log(x), y, w)
    return {"C": math.exp(b0), "alpha": -b1}, converged, optimizer


def _power_batch(x: np.ndarray, y: np.ndarray, w: np.ndarray, start: dict | None) -> dict[str, np.ndarray]:
    b0, b1 = weighted_line(np.log(x), y, w)
    return {"C": np.exp(b0), "alpha": -b1}


def _exponential_point(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[dict[str, float], bool, str]:
    b0, b1, converged, optimizer = wls_line(x, y, w)
    return {"C": math.exp(b0), "rate": -b1, "tau": (-1.0 / b1) if b1 != 0 else math.inf}, converged, optimizer


def _exponential_batch(x: np.ndarray, y: np.ndarray, w: np.ndarray, start: dict | None) -> dict[str, np.ndarray]:
    b0, b1 = weighted_line(x, y, w)
    with np.errstate(divide="ignore"):
        return {"C": np.exp(b0), "rate": -b1, "tau": -1.0 / b1}


def _power_floor_batch(x: np.ndarray, y: np.ndarray, w: np.ndarray, start: dict | None) -> dict[str, np.ndarray]:
    return lm_power_floor(np.log(x), y, w, start)


@dataclass(frozen=True)
class Family:
    """The facts of one decay law; :data:`FAMILY_RECORDS` holds them, everything else reads them.

    Attributes:
        name: ``--family NAME`` and the fit file's ``family``.
        params: the parameters a fit file stores, in order; the second is the one whose non-finite
            bootstrap value counts a failed resample (``n_boot_failed``).
        n_params: free parameters of the law (AIC's p; a fit needs more windows than this).
        log_law: ``(params, w) -> log D`` (params floats or [..., 1] arrays, w [S]; broadcasting).
        point_fit: ``(x [S], y [S], w [S]) -> (params, converged, optimizer message)``: the fit of one
            curve (y log means, w weights > 0).
        batch_fit: ``(x [S], y [B, S], w [B, S], start) -> params, each [B]``: the fits of bootstrap
            resamples (start: the point fit), NaN where a resample cannot be fitted.
        style: matplotlib line style of its curve in figures.
        label: its formula in a figure's legend.
        help: its name in words, as ``--help`` and the docs say it (e.g. "power law").
    """

    name: str
    params: tuple[str, ...]
    n_params: int
    log_law: Callable[[dict, np.ndarray], np.ndarray]
    point_fit: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[dict[str, float], bool, str]]
    batch_fit: Callable[[np.ndarray, np.ndarray, np.ndarray, dict | None], dict[str, np.ndarray]]
    style: str
    label: str
    help: str


FAMILY_RECORDS: tuple[Family, ...] = (
    Family("power", ("C", "alpha"), 2, lambda p, w: np.log(p["C"]) - p["alpha"] * np.log(w),
           _power_point, _power_batch, "-", "C w^-α", "power law"),
    Family("exponential", ("C", "tau", "rate"), 2, lambda p, w: np.log(p["C"]) - p["rate"] * w,
           _exponential_point, _exponential_batch, "--", "C exp(-w/τ)", "exponential"),
    Family("power_floor", ("C", "alpha", "D_inf"), 3,
           lambda p, w: np.log(p["C"] * w ** (-np.asarray(p["alpha"])) + p["D_inf"]),
           power_floor_point, _power_floor_batch, ":", "C w^-α + D∞", "power law + floor"),
)
FAMILIES: tuple[str, ...] = tuple(f.name for f in FAMILY_RECORDS)


def family_record(name: str) -> Family:
    """The record of family ``name``.

    Raises:
        ValueError: unknown family (the message lists the known ones).
    """
    for record in FAMILY_RECORDS:
        if record.name == name:
            return record
    raise ValueError(f"unknown law family {name!r}; choose from {', '.join(FAMILIES)}")


def min_windows(families: Sequence[str] = FAMILIES) -> int:
    """The fewest windows (budgets) any of ``families`` can be fitted to: one more than its parameters
    (power and exponential: 3; an exact fit through 2 points says nothing about the law).

    Raises:
        ValueError: an unknown family, or none.
    """
    if not families:
        raise ValueError("families is empty")
    return min(family_record(f).n_params + 1 for f in families)


def families_in_words() -> str:
    """The families' ``help`` words joined for a sentence: "power law, exponential and power law + floor"."""
    words = [f.help for f in FAMILY_RECORDS]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
