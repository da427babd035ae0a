"""Which points of a mean curve D(x) carry information about its decay: the noise floor of a
float32 forward pass, infinite means, exact zeros (pure numpy, no file access).

A point ``x`` (a window w or a budget k, in tokens) of a mean curve is, in this order:

- ``infinite``: its mean is +inf (some target had KL = +inf, q = 0 where p > 0) or -inf / NaN
  from infinities of both signs: left out of the fits and listed;
- ``no_values``: no target has a value there (NaN mean): left out and listed;
- ``zero``: its mean is exactly 0 (or negative): every target gave D = 0. The first such point
  is the curve's **exact zero** (e.g. a sliding-window model measured at windows beyond its
  attention window): a measured answer, not a failure. Fits use only the points before it;
- ``noise_floor``: ``0 < mean <= NOISE_FLOOR[metric]``: indistinguishable from 0 in float32
  (docs/precision.md, "Noise floor of the forward pass itself"): left out of the log-space
  fits, because their logarithm measures rounding noise, not context sensitivity;
- usable otherwise.

The floors are those of the metric records (:attr:`truncsens.metrics.Metric.noise_floor`): the
largest divergences measured in docs/precision.md between two float32 forwards that are equal in
exact arithmetic, rounded up: TV 1.5e-7, KL 1e-13, JS 2e-14. GPUs with reduced-precision
reductions have a larger floor (docs/precision.md has the script to measure it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from truncsens.metrics import METRICS, find, metric as _record

# Largest |D| between two float32 forwards equal in exact arithmetic (docs/precision.md), rounded up.
NOISE_FLOOR: dict[str, float] = {m.name: m.noise_floor for m in METRICS if m.noise_floor is not None}
TV_NOISE_FLOOR = _record("tv").noise_floor
KL_NOISE_FLOOR = _record("kl").noise_floor
JS_NOISE_FLOOR = _record("js").noise_floor


def noise_floor(metric: str) -> float:
    """The float32 noise floor of ``metric`` (its record's, :data:`NOISE_FLOOR`); 0 for metrics without
    one (NLLs, top-1) and for data vars that are no metric."""
    m = find(metric)
    return 0.0 if m is None or m.noise_floor is None else m.noise_floor


@dataclass(frozen=True)
class PointClasses:
    """Points of one mean curve by kind (see the module docstring); lists of points in tokens.

    Attributes:
        points: [S] all points, ascending.
        infinite, no_values, zero, noise_floor: the excluded points of each kind.
        exact_zero_at: the first point whose mean is exactly 0, or None.
        usable: [S] bool, the points a log-space fit may use (finite, above the floor, before the exact zero).
        floor: the noise floor used.
    """

    points: tuple[int, ...]
    infinite: list[int]
    no_values: list[int]
    zero: list[int]
    noise_floor: list[int]
    exact_zero_at: int | None
    usable: np.ndarray
    floor: float

    @property
    def excluded(self) -> list[int]:
        """Every point a fit leaves out, ascending (the kinds above, and every point after the exact zero)."""
        after = {p for p in self.points if self.exact_zero_at is not None and p > self.exact_zero_at}
        return sorted(set(self.infinite) | set(self.no_values) | set(self.zero) | set(self.noise_floor) | after)

    def to_json(self) -> dict:
        """``{"infinite", "no_values", "zero", "noise_floor": [points], "exact_zero_at", "noise_floor_value"}``."""
        return {"infinite": self.infinite, "no_values": self.no_values, "zero": self.zero, "noise_floor": self.noise_floor,
                "exact_zero_at": self.exact_zero_at, "noise_floor_value": self.floor}


def classify_points(points: np.ndarray, mean: np.ndarray, metric: str) -> PointClasses:
    """Sort the points of a mean curve into the kinds of the module docstring.

    Args:
        points: [S] ascending sweep points in tokens.
        mean: [S] mean D per point (+inf where a target is +inf, NaN where there is no value).
        metric: the metric name (picks the noise floor).

    Returns:
        :class:`PointClasses`.
    """
    pts = np.asarray(points, dtype=np.int64)
    m = np.asarray(mean, dtype=np.float64)
    floor = noise_floor(metric)
    inf = np.isinf(m)
    nan = np.isnan(m)
    zero = np.isfinite(m) & (m <= 0)
    low = np.isfinite(m) & (m > 0) & (m <= floor)
    first_zero = np.nonzero(zero)[0]
    exact_zero_at = int(pts[first_zero[0]]) if first_zero.size else None
    before = pts < exact_zero_at if exact_zero_at is not None else np.ones(pts.shape, bool)
    usable = np.isfinite(m) & (m > floor) & before
    as_list = lambda mask: [int(v) for v in pts[mask]]  # noqa: E731
    return PointClasses(tuple(int(v) for v in pts), as_list(inf), as_list(nan), as_list(zero), as_list(low),
                        exact_zero_at, usable, floor)


def usable_mask(points: np.ndarray, mean: np.ndarray, metric: str, exact_zero_at: int | None) -> np.ndarray:
    """[..., S] bool: which points of (resampled) mean curves [..., S] a fit may use: finite, above the
    noise floor of ``metric``, and before ``exact_zero_at`` (the exact zero of the full-sample curve)."""
    m = np.asarray(mean, dtype=np.float64)
    pts = np.asarray(points)
    before = pts < exact_zero_at if exact_zero_at is not None else np.ones(pts.shape, bool)
    return np.isfinite(m) & (m > noise_floor(metric)) & before
