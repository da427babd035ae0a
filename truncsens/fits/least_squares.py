"""The weighted least-squares routines of the decay laws (:mod:`truncsens.fits.laws`), pure numpy/scipy.

Log space throughout: ``y`` = log of a mean curve, ``w`` = WLS weights 1 / var(log mean) (delta
method, :func:`log_weights`). Straight lines (the power law in log w, the exponential in w) are
statsmodels' WLS (:func:`wls_line`) or its vectorized closed form (:func:`weighted_line`); the power
law with a floor is scipy's ``least_squares`` for one curve (:func:`power_floor_point`) and a batched
Levenberg-Marquardt for bootstrap resamples (:func:`lm_power_floor`). AIC of a Gaussian WLS fit:
:func:`wls_aic`. No file or model access here.
"""

from __future__ import annotations

import math

import numpy as np

FLOOR_AT_BOUND = 1e-12  # a power_floor D_inf below this share of the smallest fitted D is its bound, 0


class FitError(ValueError):
    """A curve cannot be fitted as asked; the message says why."""


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


def wls_line(u: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float, bool, str]:
    """statsmodels WLS of ``y ~ b0 + b1 u`` (u, y, w: [S]): (b0, b1, converged, optimizer message).

    A closed-form solve: it converged when the weighted design has full rank and the estimates are finite.
    """
    import statsmodels.api as sm

    design = sm.add_constant(u, has_constant="add")  # [S, 2]
    res = sm.WLS(y, design, weights=w).fit()
    b0, b1 = (float(v) for v in res.params)
    rank = int(np.linalg.matrix_rank(design * np.sqrt(w)[:, None]))
    converged = rank == 2 and math.isfinite(b0) and math.isfinite(b1)
    return b0, b1, converged, f"statsmodels WLS (closed form): design rank {rank} of 2"


def power_floor_point(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[dict[str, float], bool, str]:
    """Point fit of ``power_floor`` from two starts; the lower cost wins. Returns (params, converged, optimizer message)."""
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
    with np.errstate(over="ignore"):
        params = {"C": float(np.exp(best.x[0])), "alpha": float(best.x[1]), "D_inf": float(best.x[2])}
    if best.active_mask[2] != 0 or params["D_inf"] < FLOOR_AT_BOUND * float(np.exp(y.min())):
        params["D_inf"] = 0.0  # trf keeps iterates inside the bounds: a floor at its bound ends near 1e-20, not 0
    converged = bool(best.status > 0) and all(math.isfinite(v) for v in params.values())
    return params, converged, f"scipy least_squares (trf): status {best.status}, {best.message}"


LM_FTOL = 1e-12  # batched Levenberg-Marquardt stops once a step lowers the cost by at most this share of it ...
LM_XTOL = 1e-10  # ... or moves the parameters by at most this share of their norm (MINPACK's ftol / xtol tests)
LM_ITERS = 1000  # a resample still moving after this many iterations gets NaN parameters


def _damped_steps(damped: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The LM steps ``damped @ step = g`` of a batch (damped [B, 3, 3], g [B, 3]) -> [B, 3].

    A resample whose system holds a non-finite number gets step 0 (it stays where it is): its Jacobian
    overflowed (the power term clipped at exp(-700) with no floor makes 1/m ~ 1e304) or its damping did
    (``mu`` multiplied by 4 at each refused step, past 1e308 after a few hundred). Such a matrix must not
    reach LAPACK: its least-squares fallback printed ``On entry to DLASCL parameter number 4 had an
    illegal value`` on the terminal and stopped the fit with "SVD did not converge in Linear Least
    Squares". When one system is singular (the batched solve refuses the whole batch), every row is
    solved by least squares.
    """
    finite = np.isfinite(damped).all(axis=(1, 2)) & np.isfinite(g).all(axis=1)
    damped = np.where(finite[:, None, None], damped, np.eye(3))
    g = np.where(finite[:, None], g, 0.0)
    try:
        return np.linalg.solve(damped, g[:, :, None])[:, :, 0]
    except np.linalg.LinAlgError:  # one singular system refuses the whole batch: least squares, row by row
        return np.stack([np.linalg.lstsq(d, gg, rcond=None)[0] for d, gg in zip(damped, g)])


def lm_power_floor(lx: np.ndarray, y: np.ndarray, w: np.ndarray, start: dict[str, float] | None,
                    iters: int = LM_ITERS) -> dict[str, np.ndarray]:
    """Batched LM of ``power_floor`` (:func:`truncsens.fits.laws.fit_family_batch`). It stops per resample on MINPACK's
    relative tests (:data:`LM_FTOL`, :data:`LM_XTOL`; Moré 1978) or when the damping grows past 1e12
    (no step improves). Large-residual fits with an interior floor converge linearly, in a few hundred
    iterations: with a cost test at machine precision alone, such a resample needed 189 of a 200
    iteration limit on one machine and more on another, so whether it counted (and the interval's end)
    depended on the machine's rounding."""
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
    converged = np.zeros(B, dtype=bool)  # a step met the relative cost tolerance, or no step improves any more
    with np.errstate(over="ignore", invalid="ignore"):  # overflow: the resample stays put (_damped_steps)
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
            step = _damped_steps(damped, g)
            trial = p + step
            trial[:, 2] = np.maximum(trial[:, 2], 0.0)
            ct = cost(trial)
            better = np.isfinite(ct) & (ct < c)
            small_step = np.linalg.norm(step, axis=1) <= LM_XTOL * (np.linalg.norm(p, axis=1) + LM_XTOL)
            done = better & ((c - ct <= LM_FTOL * np.maximum(c, 1e-300)) | small_step)
            p = np.where(better[:, None], trial, p)
            c = np.where(better, ct, c)
            mu = np.where(better, mu / 3, mu * 4)
            converged |= done | (mu > 1e12)
            if np.all(converged):
                break
    ok = enough & converged & np.all(np.isfinite(p), axis=1)  # a resample that hit the iteration limit counts as failed
    return {"C": np.where(ok, np.exp(p[:, 0]), np.nan), "alpha": np.where(ok, p[:, 1], np.nan),
            "D_inf": np.where(ok, p[:, 2], np.nan)}
