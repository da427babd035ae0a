"""Curves of a results dataset: per-document sums of each metric along the sweep (xarray in, arrays out).

A results file sweeps either suffix windows w (dim ``window``) or retention budgets k (dim
``budget``, one curve per policy). A :class:`Curve` keeps the sweep's name in ``sweep`` and its
points in ``points`` (tokens), so budgets are never called windows downstream.

Block-protocol files (:mod:`truncsens.engine.block.runs`) measure each target at an actual window
``w + i`` (0 <= i < K(w) <= w/8) rather than at the nominal w. Their points stay binned by nominal
window, and the abscissa of each bin is the mean actual window of its targets (``Curve.x``), which
the fits use: for a power law C·w^-alpha the mean of C·(w+i)^-alpha over the bin differs from
C·(mean actual)^-alpha by a second-order term, ``alpha (alpha+1) Var(i) / (2 w^2)`` relative,
below 0.1 % at K <= w/8 and alpha <= 2 (Taylor expansion to second order). Exact files have x = points.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import xarray as xr

from truncsens.metrics import divergences_in, present
from truncsens.results.schema import ResultsError, group_label, groups, mean_over_draws, sweep_dim
from truncsens.stats import doc_sums, mean_with_inf, resampled_mean_se


@dataclass
class Curve:
    """One D(x) curve family of a results file: all metrics of one (file, policy).

    Attributes:
        results_file: path as given.
        label: short name for tables (file stem, plus ``[policy]``).
        policy: policy name or None.
        sweep: the sweep dimension, "window" or "budget".
        points: [S] int sweep points in tokens (windows or budgets), ascending.
        sums, counts: metric -> [G, S] per-document sums / counts of the finite values
            (see :func:`truncsens.stats.doc_sums`).
        x: [S] float64 abscissa of each point for the fits: the mean actual window (budget) of its
            targets (block protocol, coord ``actual_window`` / ``actual_budget``), or None: the points themselves (see :attr:`fit_x`).
        n_posinf, n_neginf, n_nan: metric -> [S] number of targets whose value is +inf (KL where
            q = 0 < p), -inf, or NaN at each point; they are never silently dropped: a point with an
            infinite value has an infinite mean (:meth:`mean_se`).
        docs: [G] document ids.
        n_targets: number of targets.
        reference_context: N (tokens; 0 when the file states none).
        attrs: provenance (results attrs, as plain Python values).
    """

    results_file: str
    label: str
    policy: str | None
    sweep: str
    points: np.ndarray
    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    docs: list[str]
    n_targets: int
    reference_context: int
    attrs: dict = field(default_factory=dict)
    n_posinf: dict[str, np.ndarray] = field(default_factory=dict)
    n_neginf: dict[str, np.ndarray] = field(default_factory=dict)
    n_nan: dict[str, np.ndarray] = field(default_factory=dict)
    x: np.ndarray | None = None

    @property
    def fit_x(self) -> np.ndarray:
        """[S] float64 abscissa of the fits: ``x`` when the file records actual windows, else ``points``."""
        return self.points.astype(np.float64) if self.x is None else np.asarray(self.x, np.float64)

    def inf_counts(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """([S] +inf counts, [S] -inf counts) of ``metric`` (zeros when not recorded)."""
        zero = np.zeros(self.points.shape, dtype=np.int64)
        return self.n_posinf.get(metric, zero), self.n_neginf.get(metric, zero)

    @property
    def n_docs(self) -> int:
        """G, the number of documents (the clusters of the bootstrap)."""
        return len(self.docs)

    def mean_se(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """Mean and cluster-robust se per sweep point of one metric: ([S], [S]).

        A point with +inf values has mean +inf and se NaN (:func:`truncsens.stats.mean_with_inf`).
        """
        mean, se = resampled_mean_se(np.ones((1, self.n_docs)), self.sums[metric], self.counts[metric])
        pos, neg = self.inf_counts(metric)
        mean = mean_with_inf(mean[0], pos, neg)
        return mean, np.where(np.isfinite(mean), se[0], np.nan)


def plain(v: object) -> object:
    """A numpy scalar or array as a Python value (attrs read from NetCDF), anything else unchanged."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def default_metrics(datasets: Sequence[xr.Dataset]) -> tuple[str, ...]:
    """What a fit of ``datasets`` fits when no metric is named: the divergences
    (:data:`truncsens.metrics.DIVERGENCES`: tv, kl, kl_reverse, js) that every dataset holds, in that
    order. A file written before a metric existed (e.g. without ``kl_reverse`` and ``js``) is fitted on
    those it has; a full file gives all four."""
    held = [set(ds.data_vars) for ds in datasets]
    return divergences_in(set.intersection(*held)) if held else ()


def curves_of(ds: xr.Dataset, metrics: Sequence[str], results_file: str = "", label: str | None = None,
              min_points: int = 2) -> list[Curve]:
    """Split a results dataset into :class:`Curve` objects (one per layer of a per-layer sweep and per
    policy of a policy sweep, labelled ``label[layer 3]``, ``label[h2o]``).

    A file with a ``draw`` dim is first averaged over draws per target
    (:func:`truncsens.results.mean_over_draws`): a target is one observation whatever R.

    Args:
        min_points: the fewest sweep points a curve may have (a fit: :func:`truncsens.fits.laws.min_windows`).

    Raises:
        ResultsError: unknown metric, or fewer than ``min_points`` sweep points.
    """
    ds = mean_over_draws(ds)
    sweep = sweep_dim(ds)
    unknown = [m for m in metrics if m not in ds.data_vars]
    if unknown:
        raise ResultsError(f"{results_file or 'results'}: unknown metric(s) {', '.join(unknown)}; the file has {', '.join(present(ds.data_vars))}")
    points = np.asarray(ds[sweep].values, dtype=np.int64)
    if points.size < max(min_points, 2):
        raise ResultsError(
            f"{results_file or 'results'} has only {'one' if points.size == 1 else points.size} {sweep}"
            f"{'' if points.size == 1 else 's'} ({points.tolist()}); fitting a decay law needs at least {max(min_points, 2)} "
            f"(more {sweep}s than the law has parameters; measure more {sweep}s, e.g. the default powers of two)")
    order = np.argsort(points)
    label = label or (Path(results_file).stem if results_file else "results")
    attrs = {k: plain(v) for k, v in ds.attrs.items()}
    try:
        n_ref = int(ds.attrs.get("reference_context", 0))
    except (TypeError, ValueError):
        n_ref = 0
    x = None
    if f"actual_{sweep}" in ds.coords:  # block protocol: mean actual window (budget) per nominal one
        x = np.asarray(ds[f"actual_{sweep}"].transpose("target", sweep).values, np.float64).mean(0)[order]  # [S]
    out = []
    for group in groups(ds):
        sub, policy = ds.sel(group), group.get("policy")
        name = policy if set(group) <= {"policy"} else group_label(group)
        sums, counts, docs = {}, {}, []
        pos, neg, nan = {}, {}, {}
        for m in metrics:
            values = np.asarray(sub[m].transpose("target", sweep).values, dtype=np.float64)[:, order]  # [n_targets, S]
            sums[m], counts[m], docs = doc_sums(values, ds["doc"].values)
            pos[m], neg[m], nan[m] = np.isposinf(values).sum(0), np.isneginf(values).sum(0), np.isnan(values).sum(0)  # [S]
        out.append(Curve(results_file, label if not group else f"{label}[{name}]", policy, sweep, points[order],
                         sums, counts, docs, int(ds.sizes["target"]), n_ref, attrs, pos, neg, nan, x))
    return out
