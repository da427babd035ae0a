"""Decay laws for D(w) with bootstrap intervals over documents, and the extrapolation test.

Families (``design.md``, fits section; power law and exponent ratio from arXiv 2605.25085):

- ``power``       D = C w^-alpha          log D = log C - alpha log w   (statsmodels WLS)
- ``exponential`` D = C exp(-w / tau)     log D = log C - w / tau       (statsmodels WLS)
- ``power_floor`` D = C w^-alpha + D_inf  (scipy.optimize.least_squares on log D, D_inf >= 0)

Each is fitted to the mean-over-targets curve in log space by weighted least squares, weight of a
window = 1 / var(log mean) ~= (mean / se)^2 (delta method), se = cluster-robust standard error of
the mean with documents as clusters. A window whose se is 0 gets the smallest positive relative
error of the curve (all zero: equal weights). Windows whose mean is zero or not finite are
excluded and listed. AIC = -2 llf + 2 p with the Gaussian WLS log-likelihood of statsmodels
(``llf = -n/2 (log(2 pi WRSS/n) + 1) + 1/2 sum log weights``), p = number of law parameters.

Model comparison: each family is fitted on the fit range, and predicts the held-out windows;
the extrapolation error is the mean absolute error of log D there. Intervals: percentile bootstrap
(Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13) resampling **documents**
with replacement; each resample recomputes the per-window means and standard errors, refits every
family, and recomputes the extrapolation errors and ``alpha_kl / alpha_tv``; the same document
resamples are used for all metrics of one curve.

Default ranges (N = ``reference_context`` attr): fit on windows from the smallest one >= 4 up to
N/8 (the finite reference context bends the curve near N); hold out the windows above that, up
to N/2.

Fit file (JSON) written by :func:`write_fit_file` (``schema`` 1)::

    {
      "kind": "truncsens-fit", "schema": 1, "truncsens_version": str, "created": ISO 8601 UTC,
      "settings": {"metrics": [...], "families": [...], "bootstrap": int, "seed": int,
                   "ci_level": 0.95, "fit_range": [lo, hi] | null, "holdout_range": [lo, hi] | null},
      "curves": [ {"index": i, "results_file": str, "label": str, "policy": str | null,
                   "sweep": "window" | "budget", "provenance": {every results attr},
                   "n_docs": int, "n_targets": int, "reference_context": int,
                   "fit_range": [lo, hi], "holdout_range": [lo, hi] | null, "notes": [str],
                   "metrics": {metric: {"window": [...], "mean": [...], "se": [...],
                                        "excluded_windows": [...]}}} ],
      "fits": [ {"curve": i, "results_file", "label", "policy", "metric", "family",
                 "status": "ok" | "skipped", "reason": str | null,
                 "params": {name: {"value": float, "ci95": [lo, hi] | null}},
                 "fit_range": [lo, hi], "fit_windows": [...], "holdout_range": [lo, hi] | null,
                 "holdout_windows": [...], "excluded_windows": [...],
                 "n_docs", "n_targets", "n_boot", "n_boot_failed",
                 "aic": float | null, "wrss": float | null,
                 "extrapolation_mae": {"value", "ci95"} | null,
                 "provenance": {every results attr},
                 "bootstrap_samples": {"C": [...], "alpha": [...]}   (power family, n_boot > 0)} ],
      "comparisons": [ {"curve": i, "results_file", "label", "metric",
                        "basis": "extrapolation" | "aic" | null, "winner", "runner_up",
                        "factor": {"value", "ci95"}, "power_vs_exponential": {"value", "ci95"} | null,
                        "mae": {family: value}, "aic": {family: value}} ],
      "alpha_ratio_kl_tv": [ {"curve": i, "results_file", "label", "value", "ci95"} ]
    }

Parameters: power {C, alpha}; exponential {C, tau, rate = 1/tau}; power_floor {C, alpha, D_inf};
windows in tokens, C and D_inf in the metric's units (TV: probability; KL, JS: nats).
Non-finite numbers are written as null. ``factor`` = runner-up error / winner error, its interval
from the same resamples (it may reach below 1 when the two are close); ``power_vs_exponential`` =
exponential error / power error (> 1: the power law extrapolates better, the paper's comparison).
With no held-out window the comparison falls back to AIC (``factor`` = exp(dAIC / 2)).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import xarray as xr

import truncsens
from truncsens.divergences import METRICS
from truncsens.results import ResultsError, load, sweep_dim, utc_now

FAMILIES = ("power", "exponential", "power_floor")
DEFAULT_METRICS = ("tv", "kl", "kl_reverse", "js")
PARAM_NAMES = {"power": ("C", "alpha"), "exponential": ("C", "tau", "rate"), "power_floor": ("C", "alpha", "D_inf")}
N_LAW_PARAMS = {"power": 2, "exponential": 2, "power_floor": 3}
FIT_KIND = "truncsens-fit"


class FitError(ValueError):
    """A curve cannot be fitted as asked; the message says why."""


@dataclass(frozen=True)
class FitConfig:
    """What :func:`fit_results` does.

    Attributes:
        metrics: metric names (data vars of the results file).
        families: law families, a subset of :data:`FAMILIES`.
        fit_range: (lo, hi) windows, inclusive; None = [smallest window >= 4, N/8].
        holdout_range: (lo, hi) inclusive; None = windows above the fit range up to N/2.
        n_boot: bootstrap resamples over documents (0: no intervals).
        seed: seed of the resampling.
        level: confidence level of the percentile intervals.
    """

    metrics: tuple[str, ...] = DEFAULT_METRICS
    families: tuple[str, ...] = FAMILIES
    fit_range: tuple[int, int] | None = None
    holdout_range: tuple[int, int] | None = None
    n_boot: int = 1000
    seed: int = 0
    level: float = 0.95


# ----------------------------------------------------------------------------- small pure helpers


def parse_range(text: str, what: str = "range") -> tuple[int, int]:
    """``"4:128"`` -> (4, 128) (inclusive window bounds in tokens).

    Raises:
        ValueError: not two whole numbers ``LO:HI`` with 1 <= LO <= HI.
    """
    parts = str(text).split(":")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{what} must look like LO:HI with whole numbers of tokens (e.g. 4:128), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{what} {text!r} is empty or starts below 1: need 1 <= LO <= HI")
    return lo, hi


def doc_sums(values: np.ndarray, doc: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Per-document sums and counts of the finite values.

    Args:
        values: [n_targets, S] metric values.
        doc: [n_targets] document id of each target.

    Returns:
        (sums [G, S] float64, counts [G, S] float64, doc ids [G] in order of first appearance).
    """
    values = np.asarray(values, dtype=np.float64)
    ids, first, codes = np.unique(np.asarray(doc).astype(str), return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    codes = rank[codes.ravel()]
    finite = np.isfinite(values)
    G, S = order.size, values.shape[1]
    sums = np.zeros((G, S))
    counts = np.zeros((G, S))
    np.add.at(sums, codes, np.where(finite, values, 0.0))
    np.add.at(counts, codes, finite.astype(np.float64))
    return sums, counts, [str(ids[i]) for i in order]


def resampled_mean_se(multiplicity: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and cluster-robust standard error of the mean for document resamples.

    ``mean = sum_g m_g S_g / sum_g m_g n_g``; ``se^2 = G/(G-1) sum_g m_g (S_g - n_g mean)^2 / n^2``
    with ``m_g`` the number of times document g is drawn, ``S_g``, ``n_g`` its sum and count, and
    ``G = sum m_g`` (the usual CR1 cluster variance; it is s^2/n for one target per document).

    Args:
        multiplicity: [B, G] draws of each document per resample (all ones: the sample itself).
        sums, counts: [G, S] from :func:`doc_sums`.

    Returns:
        (mean [B, S], se [B, S]); NaN where a window has no values (se NaN when G < 2).
    """
    m = np.asarray(multiplicity, dtype=np.float64)
    n = m @ counts  # [B, S]
    total = m @ sums
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / n
        dev2 = m @ (sums**2) - 2 * mean * (m @ (sums * counts)) + mean**2 * (m @ (counts**2))
        g = m.sum(1, keepdims=True)  # [B, 1]
        se = np.sqrt(np.clip(dev2, 0, None) * g / (g - 1)) / n
    se = np.where(g > 1, se, np.nan)
    return mean, se


def log_weights(mean: np.ndarray, se: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Log of the mean curve and WLS weights 1/var(log mean) = (mean/se)^2 (delta method).

    Windows with a zero, negative or non-finite mean get weight 0 (and log value 0 as a
    placeholder). Relative errors that are 0 or NaN are replaced by the smallest positive one of
    the same row, or 1 if there is none (equal weights).

    Args:
        mean, se: [..., S].

    Returns:
        (log mean [..., S], weights [..., S]).
    """
    mean = np.asarray(mean, dtype=np.float64)
    se = np.asarray(se, dtype=np.float64)
    valid = np.isfinite(mean) & (mean > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(valid, se / np.where(valid, mean, 1.0), np.nan)
    good = np.isfinite(rel) & (rel > 0)
    fill = np.min(np.where(good, rel, np.inf), axis=-1, keepdims=True)
    fill = np.where(np.isfinite(fill), fill, 1.0)
    rel = np.where(good, rel, fill)
    y = np.where(valid, np.log(np.where(valid, mean, 1.0)), 0.0)
    return y, np.where(valid, 1.0 / rel**2, 0.0)


def weighted_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least-squares line ``y ~ b0 + b1 x``, vectorized over leading axes.

    Args:
        x: [S]; y, w: [..., S] (weight 0 drops a point).

    Returns:
        (b0, b1), each [...]; NaN where fewer than two points have weight, or all x are equal.
    """
    x = np.asarray(x, dtype=np.float64)
    sw = w.sum(-1)
    sx, sy = (w * x).sum(-1), (w * y).sum(-1)
    sxx, sxy = (w * x * x).sum(-1), (w * x * y).sum(-1)
    det = sw * sxx - sx * sx
    enough = ((w > 0).sum(-1) >= 2) & (det > 1e-12 * np.maximum(sw * sxx, 1e-300))
    with np.errstate(invalid="ignore", divide="ignore"):
        b1 = np.where(enough, (sw * sxy - sx * sy) / det, np.nan)
        b0 = np.where(enough, (sy - b1 * sx) / sw, np.nan)
    return b0, b1


def law_log(family: str, params: dict[str, np.ndarray | float], w: np.ndarray) -> np.ndarray:
    """log D predicted by a law at windows ``w`` (broadcasting: params [...,1] x w [S]).

    Raises:
        ValueError: unknown family.
    """
    w = np.asarray(w, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if family == "power":
            return np.log(params["C"]) - params["alpha"] * np.log(w)
        if family == "exponential":
            return np.log(params["C"]) - params["rate"] * w
        if family == "power_floor":
            return np.log(params["C"] * w ** (-np.asarray(params["alpha"])) + params["D_inf"])
    raise ValueError(f"unknown law family {family!r}; choose from {', '.join(FAMILIES)}")


def law_value(family: str, params: dict[str, float], w: np.ndarray | float) -> np.ndarray:
    """D predicted by a law at windows ``w`` (``exp`` of :func:`law_log`)."""
    return np.exp(law_log(family, params, np.asarray(w, dtype=np.float64)))


def wls_aic(wrss: float, weights: np.ndarray, n_params: int) -> float:
    """AIC of a Gaussian WLS fit: ``-2 llf + 2 p``, llf as statsmodels' WLS.

    ``llf = -n/2 (log(2 pi wrss / n) + 1) + 1/2 sum log weights`` (n = number of weighted points).
    Returns -inf for a perfect fit (wrss = 0).
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w[w > 0]
    n = w.size
    if wrss <= 0:
        return -math.inf
    llf = -n / 2 * (math.log(2 * math.pi * wrss / n) + 1) + 0.5 * float(np.log(w).sum())
    return -2 * llf + 2 * n_params


def percentile_ci(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the finite samples (Efron & Tibshirani 1993, ch. 13).

    Returns:
        (lo, hi); (nan, nan) when there are no finite samples.
    """
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return (math.nan, math.nan)
    q = 100 * (1 - level) / 2
    lo, hi = np.percentile(s, [q, 100 - q])
    return float(lo), float(hi)


def bootstrap_multiplicities(n_docs: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n_docs] int: how often each document is drawn in each resample (with replacement)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_docs, np.full(n_docs, 1.0 / n_docs), size=n_boot)


# ----------------------------------------------------------------------------- the three families


def fit_family(family: str, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    """Point fit of one family to one curve (statsmodels WLS or scipy least_squares).

    Args:
        family: one of :data:`FAMILIES`.
        x: [S] windows in tokens.
        y, w: [S] log mean and weights (from :func:`log_weights`); weight 0 drops a window.

    Returns:
        dict of the family's parameters (:data:`PARAM_NAMES`) plus ``wrss`` (weighted residual
        sum of squares in log space) and ``aic`` (NaN when there are no more windows than
        parameters).

    Raises:
        FitError: fewer usable windows than parameters, or the optimizer failed.
    """
    x = np.asarray(x, dtype=np.float64)
    keep = w > 0
    need = N_LAW_PARAMS[family] + 1  # more windows than parameters: an exact fit says nothing about the law
    if keep.sum() < need:
        raise FitError(f"{family} needs at least {need} windows with a positive mean in the fit range, got {int(keep.sum())}")
    xs, ys, ws = x[keep], y[keep], w[keep]
    if family in ("power", "exponential"):
        import statsmodels.api as sm

        design = sm.add_constant(np.log(xs) if family == "power" else xs, has_constant="add")
        res = sm.WLS(ys, design, weights=ws).fit()
        b0, b1 = (float(v) for v in res.params)
        if family == "power":
            params = {"C": math.exp(b0), "alpha": -b1}
        else:
            params = {"C": math.exp(b0), "rate": -b1, "tau": (-1.0 / b1) if b1 != 0 else math.inf}
    else:
        params = _fit_power_floor_point(xs, ys, ws)
    wrss = float((ws * (ys - law_log(family, params, xs)) ** 2).sum())
    params["wrss"] = wrss
    # with no residual degrees of freedom the fit is exact and AIC compares nothing
    params["aic"] = wls_aic(wrss, ws, N_LAW_PARAMS[family]) if xs.size > N_LAW_PARAMS[family] else math.nan
    return params


def _fit_power_floor_point(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    from scipy.optimize import least_squares

    lx, sw = np.log(x), np.sqrt(w)
    b0, b1 = weighted_line(lx, y, w)
    starts = [np.array([b0, -b1, 0.0]), np.array([b0, max(-b1, 0.1) * 1.5, 0.5 * float(np.exp(y.min()))])]

    def resid(p: np.ndarray) -> np.ndarray:
        return sw * (y - np.log(np.exp(p[0] - p[1] * lx) + p[2]))

    best = None
    for p0 in starts:
        if not np.all(np.isfinite(p0)):
            continue
        try:
            r = least_squares(resid, p0, bounds=([-np.inf, -np.inf, 0.0], [np.inf, np.inf, np.inf]),
                              x_scale="jac", ftol=1e-14, xtol=1e-14, gtol=1e-14, max_nfev=2000)
        except ValueError:
            continue
        if best is None or r.cost < best.cost:
            best = r
    if best is None or not np.all(np.isfinite(best.x)):
        raise FitError("power_floor: the optimizer found no finite solution")
    return {"C": float(math.exp(best.x[0])), "alpha": float(best.x[1]), "D_inf": float(best.x[2])}


def fit_family_batch(family: str, x: np.ndarray, y: np.ndarray, w: np.ndarray, start: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """The same fits for many curves at once (bootstrap resamples), vectorized in numpy.

    ``power`` and ``exponential`` are the closed-form WLS line (identical to statsmodels);
    ``power_floor`` runs a batched Levenberg-Marquardt (Marquardt scaling, ``D_inf >= 0`` by
    projection) from ``start`` (the point fit), checked against scipy in the tests.

    Args:
        x: [S] windows; y, w: [B, S] log means and weights.
        start: point-fit parameters (needed for ``power_floor``).

    Returns:
        family parameters, each [B] (NaN where a resample cannot be fitted).
    """
    x = np.asarray(x, dtype=np.float64)
    if family == "power":
        b0, b1 = weighted_line(np.log(x), y, w)
        return {"C": np.exp(b0), "alpha": -b1}
    if family == "exponential":
        b0, b1 = weighted_line(x, y, w)
        with np.errstate(divide="ignore"):
            return {"C": np.exp(b0), "rate": -b1, "tau": -1.0 / b1}
    if family == "power_floor":
        return _lm_power_floor(np.log(x), y, w, start)
    raise ValueError(f"unknown law family {family!r}")


def _lm_power_floor(lx: np.ndarray, y: np.ndarray, w: np.ndarray, start: dict[str, float] | None, iters: int = 200) -> dict[str, np.ndarray]:
    B = y.shape[0]
    if start is None:
        b0, b1 = weighted_line(lx, y, w)
        p = np.stack([b0, -b1, np.zeros(B)], axis=1)
    else:
        p = np.tile([math.log(start["C"]), start["alpha"], start["D_inf"]], (B, 1)).astype(np.float64)
    enough = (w > 0).sum(1) >= 4

    def model(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        P = np.exp(np.clip(p[:, :1] - p[:, 1:2] * lx, -700, 700))  # [B, S]
        m = P + p[:, 2:3]
        return P, m

    def cost(p: np.ndarray) -> np.ndarray:
        _, m = model(p)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = y - np.log(m)
        return np.where(np.isfinite(r), w * r * r, np.inf).sum(1)

    c = cost(p)
    mu = np.full(B, 1e-3)
    for _ in range(iters):
        P, m = model(p)
        J = np.stack([P / m, -lx * P / m, 1.0 / m], axis=2)  # [B, S, 3] d log m / d p
        r = y - np.log(m)
        A = np.einsum("bsi,bs,bsj->bij", J, w, J)
        g = np.einsum("bsi,bs,bs->bi", J, w, r)
        active = (p[:, 2] <= 0) & (g[:, 2] <= 0)  # D_inf at its bound and pushed below it: freeze
        A[active, 2, :] = 0.0
        A[active, :, 2] = 0.0
        A[active, 2, 2] = 1.0
        g[active, 2] = 0.0
        diag = np.einsum("bii->bi", A)
        damped = A + mu[:, None, None] * np.einsum("bi,ij->bij", np.maximum(diag, 1e-300), np.eye(3))
        try:
            step = np.linalg.solve(damped, g[:, :, None])[:, :, 0]
        except np.linalg.LinAlgError:
            step = np.stack([np.linalg.lstsq(d, gg, rcond=None)[0] for d, gg in zip(damped, g)])
        trial = p + step
        trial[:, 2] = np.maximum(trial[:, 2], 0.0)
        ct = cost(trial)
        better = np.isfinite(ct) & (ct < c)
        done = better & (c - ct <= 1e-15 * np.maximum(c, 1e-300))
        p = np.where(better[:, None], trial, p)
        c = np.where(better, ct, c)
        mu = np.where(better, mu / 3, mu * 4)
        if np.all(done | (mu > 1e12)):
            break
    ok = enough & np.all(np.isfinite(p), axis=1)
    return {"C": np.where(ok, np.exp(p[:, 0]), np.nan), "alpha": np.where(ok, p[:, 1], np.nan),
            "D_inf": np.where(ok, p[:, 2], np.nan)}


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


# ----------------------------------------------------------------------------- curves of a results file


@dataclass
class Curve:
    """One D(w) curve family of a results file: all metrics of one (file, policy).

    Attributes:
        results_file: path as given.
        label: short name for tables (file stem, plus ``[policy]``).
        policy: policy name or None.
        sweep: "window" or "budget".
        windows: [S] int tokens.
        sums, counts: metric -> [G, S] per-document sums / counts (see :func:`doc_sums`).
        docs: [G] document ids.
        n_targets: number of targets.
        reference_context: N (tokens).
        attrs: provenance (results attrs).
    """

    results_file: str
    label: str
    policy: str | None
    sweep: str
    windows: np.ndarray
    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    docs: list[str]
    n_targets: int
    reference_context: int
    attrs: dict = field(default_factory=dict)

    @property
    def n_docs(self) -> int:
        """G, the number of documents (the clusters of the bootstrap)."""
        return len(self.docs)

    def mean_se(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """Mean and cluster-robust se per window of one metric: ([S], [S])."""
        mean, se = resampled_mean_se(np.ones((1, self.n_docs)), self.sums[metric], self.counts[metric])
        return mean[0], se[0]


def _plain(v: object) -> object:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def curves_of(ds: xr.Dataset, metrics: Sequence[str], results_file: str = "", label: str | None = None) -> list[Curve]:
    """Split a results dataset into :class:`Curve` objects (one per policy, if any).

    Raises:
        ResultsError: unknown metric, or fewer than two windows/budgets.
    """
    sweep = sweep_dim(ds)
    unknown = [m for m in metrics if m not in ds.data_vars]
    if unknown:
        raise ResultsError(f"{results_file or 'results'}: unknown metric(s) {', '.join(unknown)}; the file has {', '.join(m for m in METRICS if m in ds.data_vars)}")
    windows = np.asarray(ds[sweep].values, dtype=np.int64)
    if windows.size < 2:
        raise ResultsError(
            f"{results_file or 'results'} has only one {sweep} ({windows.tolist()}); fitting a decay law needs at least 2 "
            f"(measure more {sweep}s, e.g. the default powers of two)")
    order = np.argsort(windows)
    label = label or (Path(results_file).stem if results_file else "results")
    policies = [str(p) for p in ds["policy"].values] if "policy" in ds.dims else [None]
    attrs = {k: _plain(v) for k, v in ds.attrs.items()}
    try:
        n_ref = int(ds.attrs.get("reference_context", 0))
    except (TypeError, ValueError):
        n_ref = 0
    out = []
    for policy in policies:
        sub = ds if policy is None else ds.sel(policy=policy)
        sums, counts, docs = {}, {}, []
        for m in metrics:
            values = np.asarray(sub[m].transpose("target", sweep).values, dtype=np.float64)[:, order]
            sums[m], counts[m], docs = doc_sums(values, ds["doc"].values)
        out.append(Curve(results_file, label if policy is None else f"{label}[{policy}]", policy, sweep, windows[order],
                         sums, counts, docs, int(ds.sizes["target"]), n_ref, attrs))
    return out


def default_ranges(windows: np.ndarray, reference_context: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """Default fit range [smallest window >= 4, N/8] and holdout range (N/8, N/2].

    Raises:
        FitError: N unknown (0) or no window >= 4 at most N/8.
    """
    if reference_context <= 0:
        raise FitError("the results file states no reference_context; give --fit-range LO:HI")
    hi = reference_context // 8
    candidates = [int(w) for w in windows if 4 <= w <= hi]
    if not candidates:
        raise FitError(
            f"no window lies in the default fit range [4, N/8 = {hi}] (windows {list(map(int, windows))}); give --fit-range LO:HI")
    hold_hi = reference_context // 2
    return (min(candidates), hi), ((hi + 1, hold_hi) if hold_hi > hi else None)


# ----------------------------------------------------------------------------- the whole fit


@dataclass
class CurveFits:
    """Everything fitted for one curve (all metrics and families)."""

    curve: Curve
    fit_range: tuple[int, int]
    holdout_range: tuple[int, int] | None
    metrics: dict[str, dict]  # metric -> {"window","mean","se","excluded_windows"}
    fits: list[dict]
    comparisons: list[dict]
    alpha_ratio: dict | None
    notes: list[str]


def _ci(samples: np.ndarray | None, level: float) -> list[float] | None:
    if samples is None:
        return None
    return list(percentile_ci(samples, level))


def fit_curve(curve: Curve, cfg: FitConfig, seed: int | None = None) -> CurveFits:
    """Fit every metric and family of one curve, with bootstrap intervals.

    Args:
        curve: from :func:`curves_of`.
        cfg: the configuration.
        seed: resampling seed (default ``cfg.seed``).

    Returns:
        :class:`CurveFits` (its dicts are the JSON entries of the module docstring).

    Raises:
        FitError: bad ranges, too few windows, an all-zero curve, or bootstrapping one document.
    """
    unknown = [f for f in cfg.families if f not in FAMILIES]
    if unknown:
        raise FitError(f"unknown law family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    x = curve.windows.astype(np.float64)
    notes: list[str] = []
    if cfg.fit_range is None:
        fit_range, default_hold = default_ranges(curve.windows, curve.reference_context)
    else:
        fit_range = tuple(cfg.fit_range)
        hold_hi = curve.reference_context // 2
        default_hold = (fit_range[1] + 1, hold_hi) if hold_hi > fit_range[1] else None
    holdout_range = tuple(cfg.holdout_range) if cfg.holdout_range is not None else default_hold
    if holdout_range is not None and holdout_range[0] <= fit_range[1] and holdout_range[1] >= fit_range[0]:
        notes.append(f"holdout range {holdout_range[0]}:{holdout_range[1]} overlaps the fit range: its error is not an extrapolation")
    in_fit = (curve.windows >= fit_range[0]) & (curve.windows <= fit_range[1])
    in_hold = np.zeros_like(in_fit) if holdout_range is None else (curve.windows >= holdout_range[0]) & (curve.windows <= holdout_range[1])
    if in_fit.sum() < 2:
        raise FitError(
            f"{curve.label}: the fit range {fit_range[0]}:{fit_range[1]} holds {int(in_fit.sum())} measured "
            f"{curve.sweep}(s) of {curve.windows.tolist()}; need at least 2")
    if cfg.n_boot > 0 and curve.n_docs < 2:
        raise FitError(f"{curve.label}: bootstrap over documents needs at least 2 documents, the file has {curve.n_docs}; "
                       "pass --bootstrap 0 to fit without intervals")
    B = int(cfg.n_boot)
    mult = np.vstack([np.ones((1, curve.n_docs)),
                      bootstrap_multiplicities(curve.n_docs, B, cfg.seed if seed is None else seed) if B else np.zeros((0, curve.n_docs))])
    metrics_out: dict[str, dict] = {}
    fits: list[dict] = []
    comparisons: list[dict] = []
    power_alpha: dict[str, np.ndarray] = {}
    for metric in cfg.metrics:
        mean_all, se_all = resampled_mean_se(mult, curve.sums[metric], curve.counts[metric])  # [1+B, S]
        y_all, w_all = log_weights(mean_all, se_all)
        mean, se = mean_all[0], se_all[0]
        bad = ~(np.isfinite(mean) & (mean > 0))
        if bad.all():
            raise FitError(f"{curve.label}: every {curve.sweep} has zero (or non-finite) mean {metric}: nothing to fit "
                           "(is the reference context equal to every window, or the model insensitive to context?)")
        excluded = [int(v) for v in curve.windows[bad]]
        metrics_out[metric] = {"window": curve.windows.tolist(), "mean": mean.tolist(), "se": se.tolist(),
                               "excluded_windows": excluded}
        fw = in_fit & ~bad
        hw = in_hold & ~bad
        if fw.sum() < 2:
            raise FitError(f"{curve.label}: {metric} has {int(fw.sum())} {curve.sweep}(s) with a positive mean in the fit range "
                           f"{fit_range[0]}:{fit_range[1]}; need at least 2")
        valid_all = np.isfinite(mean_all) & (mean_all > 0)
        fam_mae: dict[str, np.ndarray] = {}
        fam_point: dict[str, dict] = {}
        for family in cfg.families:
            base = {
                "curve": None, "results_file": curve.results_file, "label": curve.label, "policy": curve.policy,
                "metric": metric, "family": family, "fit_range": list(fit_range),
                "fit_windows": [int(v) for v in curve.windows[fw]],
                "holdout_range": list(holdout_range) if holdout_range else None,
                "holdout_windows": [int(v) for v in curve.windows[hw]], "excluded_windows": excluded,
                "n_docs": curve.n_docs, "n_targets": curve.n_targets, "n_boot": B,
            }
            try:
                point = fit_family(family, x[fw], y_all[0, fw], w_all[0, fw])
            except FitError as exc:
                fits.append({**base, "status": "skipped", "reason": str(exc), "params": {}, "aic": None, "wrss": None,
                             "extrapolation_mae": None, "n_boot_failed": 0})
                continue
            boot = fit_family_batch(family, x[fw], y_all[1:, fw], np.where(valid_all[1:, fw], w_all[1:, fw], 0.0), start=point) if B else None
            params = {}
            for name in PARAM_NAMES[family]:
                params[name] = {"value": point[name], "ci95": _ci(boot[name] if boot else None, cfg.level)}
            mae_point = mae_boot = None
            if hw.any():
                mae_point = float(extrapolation_mae(family, {k: point[k] for k in PARAM_NAMES[family]}, x[hw], y_all[0, hw], np.ones(hw.sum(), bool)))
                if boot:
                    mae_boot = extrapolation_mae(family, boot, x[hw], y_all[1:, hw], valid_all[1:, hw])
                fam_mae[family] = np.concatenate([[mae_point], mae_boot if mae_boot is not None else []])
            n_failed = int(np.sum(~np.isfinite(boot[PARAM_NAMES[family][1]]))) if boot else 0
            entry = {**base, "status": "ok", "reason": None, "params": params, "aic": point["aic"], "wrss": point["wrss"],
                     "extrapolation_mae": None if mae_point is None else {"value": mae_point, "ci95": _ci(mae_boot, cfg.level)},
                     "n_boot_failed": n_failed}
            if family == "power" and boot:
                entry["bootstrap_samples"] = {"C": boot["C"].tolist(), "alpha": boot["alpha"].tolist()}
            if family == "power":
                power_alpha[metric] = np.concatenate([[point["alpha"]], boot["alpha"] if boot else []])
            fam_point[family] = point
            fits.append(entry)
        comparisons.append(_compare(curve, metric, fam_mae, fam_point, cfg.level))
    alpha_ratio = None
    if "tv" in power_alpha and "kl" in power_alpha:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = power_alpha["kl"] / power_alpha["tv"]
        alpha_ratio = {"curve": None, "label": curve.label, "results_file": curve.results_file, "value": float(ratio[0]),
                       "ci95": _ci(ratio[1:], cfg.level) if B else None}
    return CurveFits(curve, fit_range, holdout_range, metrics_out, fits, comparisons, alpha_ratio, notes)


def _compare(curve: Curve, metric: str, mae: dict[str, np.ndarray], point: dict[str, dict], level: float) -> dict:
    out = {"curve": None, "label": curve.label, "results_file": curve.results_file, "metric": metric,
           "mae": {f: float(v[0]) for f, v in mae.items()}, "aic": {f: p["aic"] for f, p in point.items()},
           "basis": None, "winner": None, "runner_up": None, "factor": None, "power_vs_exponential": None}
    usable = {f: v for f, v in mae.items() if np.isfinite(v[0])}
    if len(usable) >= 2:
        ranked = sorted(usable, key=lambda f: usable[f][0])
        win, run = ranked[0], ranked[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            fac = usable[run] / usable[win]
        out.update(basis="extrapolation", winner=win, runner_up=run,
                   factor={"value": float(fac[0]), "ci95": _ci(fac[1:], level) if fac.size > 1 else None})
        if "power" in usable and "exponential" in usable:
            with np.errstate(divide="ignore", invalid="ignore"):
                pve = usable["exponential"] / usable["power"]
            out["power_vs_exponential"] = {"value": float(pve[0]), "ci95": _ci(pve[1:], level) if pve.size > 1 else None}
    elif sum(not math.isnan(p["aic"]) for p in point.values()) >= 2:
        ranked = sorted((f for f in point if not math.isnan(point[f]["aic"])), key=lambda f: point[f]["aic"])
        win, run = ranked[0], ranked[1]
        diff = point[run]["aic"] - point[win]["aic"]
        out.update(basis="aic", winner=win, runner_up=run,
                   factor={"value": float(math.exp(min(diff / 2, 700))) if math.isfinite(diff) else math.inf, "ci95": None})
    return out


@dataclass
class FitReport:
    """Fits of one or more results files, ready for JSON (:meth:`to_json`)."""

    config: FitConfig
    results: list[CurveFits]
    created: str = ""

    def to_json(self) -> dict:
        """The fit file as a dict (schema in the module docstring; non-finite numbers -> None)."""
        curves, fits, comps, ratios = [], [], [], []
        for i, cf in enumerate(self.results):
            c = cf.curve
            curves.append({"index": i, "results_file": c.results_file, "label": c.label, "policy": c.policy,
                           "sweep": c.sweep, "provenance": c.attrs, "n_docs": c.n_docs, "n_targets": c.n_targets,
                           "reference_context": c.reference_context, "fit_range": list(cf.fit_range),
                           "holdout_range": list(cf.holdout_range) if cf.holdout_range else None,
                           "metrics": cf.metrics, "notes": cf.notes})
            for f in cf.fits:
                fits.append({**f, "curve": i, "provenance": c.attrs})
            for cmp_ in cf.comparisons:
                comps.append({**cmp_, "curve": i})
            if cf.alpha_ratio is not None:
                ratios.append({**cf.alpha_ratio, "curve": i})
        cfg = self.config
        doc = {
            "kind": FIT_KIND, "schema": 1, "truncsens_version": truncsens.__version__, "created": self.created or utc_now(),
            "settings": {"metrics": list(cfg.metrics), "families": list(cfg.families), "bootstrap": cfg.n_boot,
                         "seed": cfg.seed, "ci_level": cfg.level,
                         "fit_range": list(cfg.fit_range) if cfg.fit_range else None,
                         "holdout_range": list(cfg.holdout_range) if cfg.holdout_range else None},
            "curves": curves, "fits": fits, "comparisons": comps, "alpha_ratio_kl_tv": ratios,
        }
        return sanitize(doc)


def sanitize(obj: object) -> object:
    """A JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to None, tuples to lists."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [sanitize(v) for v in obj.tolist()]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def fit_results(paths: Sequence[str | Path], cfg: FitConfig = FitConfig(), datasets: Sequence[xr.Dataset] | None = None) -> FitReport:
    """Load results files (or use ``datasets``) and fit them side by side.

    Each curve gets its own resampling seed ``cfg.seed + index`` so that curves are independent.

    Raises:
        FileNotFoundError, ResultsError: a path is missing or not a results file.
        FitError: see :func:`fit_curve`.
    """
    if not cfg.metrics:
        raise FitError("no metric to fit")
    curves: list[Curve] = []
    stems = [Path(p).stem for p in paths]
    for i, p in enumerate(paths):
        ds = datasets[i] if datasets is not None else load(p)
        label = stems[i] if stems.count(stems[i]) == 1 else f"{Path(p).parent.name}/{stems[i]}"
        curves.extend(curves_of(ds, cfg.metrics, str(p), label))
    return FitReport(cfg, [fit_curve(c, cfg, seed=cfg.seed + i) for i, c in enumerate(curves)], utc_now())


def write_fit_file(report: FitReport | dict, path: str | Path) -> Path:
    """Write the fit JSON (atomically) and return its path."""
    doc = report.to_json() if isinstance(report, FitReport) else report
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    tmp.replace(path)
    return path


def read_fit_file(path: str | Path) -> dict:
    """Read a fit JSON written by :func:`write_fit_file`.

    Raises:
        FileNotFoundError: no such file.
        FitError: not JSON, or not a truncsens fit file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"fit file not found: {path}")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FitError(f"{path} is not a truncsens fit file (not JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != FIT_KIND:
        raise FitError(f"{path} is not a truncsens fit file (no \"kind\": \"{FIT_KIND}\")")
    return doc


def default_fit_path(paths: Sequence[str | Path]) -> Path:
    """Where ``fit`` writes by default: next to the first results file, ``<stem>.fit.json``
    (``<stem>+<k>more.fit.json`` for several files)."""
    first = Path(paths[0])
    extra = f"+{len(paths) - 1}more" if len(paths) > 1 else ""
    return first.with_name(f"{first.stem}{extra}.fit.json")


# ----------------------------------------------------------------------------- readable table


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}g}"


def _fmt_ci(ci: list | None, digits: int = 4) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return ""
    return f" [{_fmt(ci[0], digits)}, {_fmt(ci[1], digits)}]"


def format_report(doc: dict) -> str:
    """A readable table of a fit file dict (:meth:`FitReport.to_json`), several files side by side."""
    lines = []
    s = doc["settings"]
    pct = f"{100 * s['ci_level']:g}%"  # the --level of the fit (the JSON keys say ci95 whatever it is)
    rows = [("curve", "metric", "family", f"parameters ({pct} CI)", f"held-out log MAE ({pct} CI)", "AIC")]
    for f in doc["fits"]:
        if f["status"] != "ok":
            params = f"skipped: {f['reason']}"
            mae = ""
        else:
            params = "  ".join(f"{k}={_fmt(v['value'])}{_fmt_ci(v['ci95'], 3)}" for k, v in f["params"].items() if k != "rate")
            m = f["extrapolation_mae"]
            mae = "-" if m is None else f"{_fmt(m['value'], 3)}{_fmt_ci(m['ci95'], 3)}"
        rows.append((f["label"], f["metric"], f["family"], params, mae, _fmt(f.get("aic"), 5)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    for c in doc["comparisons"]:
        if c["winner"] is None:
            lines.append(f"{c['label']} {c['metric']}: no comparison (no held-out windows, and fewer than two families "
                         "with residual degrees of freedom for AIC)")
            continue
        fac = c["factor"]
        if c["basis"] == "extrapolation":
            if fac["value"] is not None and fac["value"] < 1.005:  # e.g. power_floor with a zero floor = power
                text = (f"{c['label']} {c['metric']}: {c['winner']} and {c['runner_up']} tie in held-out extrapolation "
                        f"(error ratio {_fmt(fac['value'], 3)}{_fmt_ci(fac['ci95'], 3)})")
            else:
                text = (f"{c['label']} {c['metric']}: {c['winner']} wins held-out extrapolation; {c['runner_up']}'s log error is "
                        f"{_fmt(fac['value'], 3)}x larger{_fmt_ci(fac['ci95'], 3)}")
            pve = c.get("power_vs_exponential")
            if pve and {c["winner"], c["runner_up"]} != {"power", "exponential"}:
                text += f"; exponential/power error ratio {_fmt(pve['value'], 3)}{_fmt_ci(pve['ci95'], 3)}"
        else:
            text = (f"{c['label']} {c['metric']}: no held-out windows; {c['winner']} has the lower AIC "
                    f"(relative likelihood of {c['runner_up']}: 1/{_fmt(fac['value'], 3)})")
        lines.append(text)
    for r in doc.get("alpha_ratio_kl_tv", []):
        lines.append(f"{r['label']}: alpha_kl / alpha_tv = {_fmt(r['value'], 4)}{_fmt_ci(r['ci95'], 4)}")
    lines.append("")
    for c in doc["curves"]:
        hold = c["holdout_range"]
        excl = {m: v["excluded_windows"] for m, v in c["metrics"].items() if v["excluded_windows"]}
        lines.append(
            f"{c['label']}: model {c['provenance'].get('model', '?')}, N={c['reference_context']}, {c['n_docs']} documents, "
            f"{c['n_targets']} targets; fit {c['sweep']}s {c['fit_range'][0]}..{c['fit_range'][1]}, held out "
            + (f"{hold[0]}..{hold[1]}" if hold else "none")
            + (f"; excluded (zero or non-finite mean): {excl}" if excl else ""))
        for n in c.get("notes", []):
            lines.append(f"  note: {n}")
    lines.append(f"intervals: {pct} percentile bootstrap over documents, {s['bootstrap']} resamples, seed {s['seed']}")
    return "\n".join(lines)
