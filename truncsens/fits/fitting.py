"""Fit decay laws to the curves of results datasets, with bootstrap intervals over documents, and
compare the families by held-out extrapolation.

Pure: datasets in (:func:`fit_datasets`), fits out; no file is read or written here (reading results
files is :func:`truncsens.results.load`, the fit face with files is :func:`truncsens.api.fit.fit`).
The laws and their fits are :mod:`truncsens.fits.laws`; the clustered statistics and the percentile
interval are :mod:`truncsens.stats`; the fit file format is :mod:`truncsens.fits.fit_file`.

Per curve and metric: the mean curve and its cluster-robust se (documents as clusters) give the
WLS weights; points whose mean is zero or not finite are excluded and listed. Each family is fitted
on the fit range and predicts the held-out points; the extrapolation error is the mean absolute
error of log D there. Intervals: percentile bootstrap (Efron & Tibshirani 1993, ch. 13) resampling
**documents** with replacement; each resample recomputes the means and standard errors, refits
every family, and recomputes the extrapolation errors and ``alpha_kl / alpha_tv`` (arXiv
2605.25085); the same document resamples are used for all metrics of one curve.

Default ranges (N = ``reference_context`` attr): fit on points from the smallest one >= 4 up to
N/8 (the finite reference context bends the curve near N); hold out the points above that, up
to N/2.

Comparison of the families: :mod:`truncsens.fits.comparison`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import xarray as xr

from truncsens.fits.points import PointClasses, classify_points, usable_mask
from truncsens.fits.curves import Curve, curves_of
from truncsens.fits.comparison import compare_families
from truncsens.fits.fit_file import fit_document
from truncsens.fits.laws import (FAMILIES, FitError, extrapolation_mae, family_record, fit_family, fit_family_batch,
                                 log_weights, min_windows)
from truncsens.stats import interval_or_none, mean_with_inf, resample_weights, resampled_mean_se

from truncsens.metrics import DIVERGENCES as DEFAULT_METRICS  # tv, kl, kl_reverse, js: fitted as D(w) by default


def parse_range(text: str, what: str = "range") -> tuple[int, int]:
    """``"4:128"`` -> (4, 128) (inclusive bounds in tokens).

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


def check_resampling(n_boot: int, seed: int, level: float) -> None:
    """Refuse a document bootstrap's settings that cannot run (``fit``, ``compare-policies``).

    Raises:
        ValueError: ``n_boot`` < 0, ``seed`` < 0 (numpy's generators take none), ``level`` outside (0, 1);
            the message names the keyword and its flag.
    """
    if n_boot < 0:
        raise ValueError(f"bootstrap (--bootstrap) must be >= 0, got {n_boot}")
    if seed < 0:
        raise ValueError(f"seed (--seed) must be >= 0, got {seed}")
    if not 0 < level < 1:
        raise ValueError(f"level (--level) must lie in (0, 1), got {level}")


@dataclass(frozen=True)
class FitConfig:
    """What :func:`fit_datasets` does; validated once, on construction.

    Attributes:
        metrics: metric names (data vars of the results file), at least one.
        families: law families, a subset of :data:`truncsens.fits.laws.FAMILIES`.
        fit_range: (lo, hi) sweep points in tokens, inclusive; None = [smallest point >= 4, N/8].
        holdout_range: (lo, hi) inclusive; None = points above the fit range up to N/2.
        n_boot: bootstrap resamples over documents (0: no intervals).
        seed: seed of the resampling.
        level: confidence level of the percentile intervals, in (0, 1).

    Raises:
        FitError: no metric, or an unknown family.
        ValueError: n_boot < 0, seed < 0, level outside (0, 1), or a range with lo < 1 or hi < lo.
    """

    metrics: tuple[str, ...] = DEFAULT_METRICS
    families: tuple[str, ...] = FAMILIES
    fit_range: tuple[int, int] | None = None
    holdout_range: tuple[int, int] | None = None
    n_boot: int = 1000
    seed: int = 0
    level: float = 0.95

    def __post_init__(self) -> None:
        if not self.metrics:
            raise FitError("no metric to fit")
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown:
            raise FitError(f"unknown law family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
        check_resampling(self.n_boot, self.seed, self.level)
        for name, r in (("fit_range (--fit-range)", self.fit_range), ("holdout_range (--holdout-range)", self.holdout_range)):
            if r is not None and not (len(r) == 2 and 1 <= r[0] <= r[1]):
                raise ValueError(f"{name} {r} is empty or starts below 1: need 1 <= LO <= HI")


MIN_DEFAULT_FIT_POINTS = 4


def default_ranges(points: np.ndarray, reference_context: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """Default fit range and holdout range (N = ``reference_context``).

    Fit: [smallest point >= 4, N/8] when it holds at least :data:`MIN_DEFAULT_FIT_POINTS` points;
    otherwise that range is widened, one point at a time, first up to N/4, then down towards 1,
    then up to N/2, until it holds 4 points (or every point up to N/2). Holdout: the points
    above the fit range up to N/2 (None when the fit range reaches N/2).

    Raises:
        FitError: N unknown (0), or fewer than 2 points up to N/2; the message names ``--fit-range``.
    """
    if reference_context <= 0:
        raise FitError("the results file states no reference_context; give fit_range (--fit-range LO:HI)")
    hi8, hi4, hi2 = reference_context // 8, reference_context // 4, reference_context // 2
    pts = sorted({int(w) for w in points})
    chosen = [w for w in pts if 4 <= w <= hi8]
    if len(chosen) < MIN_DEFAULT_FIT_POINTS:
        order = ([w for w in pts if max(hi8, 3) < w <= hi4] + [w for w in reversed(pts) if w < 4 and w <= hi2]
                 + [w for w in pts if max(hi4, 3) < w <= hi2])
        for w in order:
            if len(chosen) >= MIN_DEFAULT_FIT_POINTS:
                break
            chosen.append(w)
    if len(chosen) < 2:
        raise FitError(f"the default fit range needs at least 2 windows up to N/2 = {hi2}, the run has "
                       f"{list(map(int, points))}; give fit_range (--fit-range LO:HI)")
    fit_range = (min(chosen), max(max(chosen), hi8))
    hold = (fit_range[1] + 1, hi2) if hi2 > fit_range[1] else None
    return fit_range, hold


@dataclass
class CurveFits:
    """Everything fitted for one curve (all metrics and families); dict entries as in :mod:`truncsens.fits.fit_file`."""

    curve: Curve
    fit_range: tuple[int, int]
    holdout_range: tuple[int, int] | None
    metrics: dict[str, dict]  # metric -> {"points", "mean", "se", "excluded_points", "excluded", "n_inf", "n_nan", ...}
    fits: list[dict]
    comparisons: list[dict]
    alpha_ratio: dict | None
    notes: list[str]


def _ranges(curve: Curve, cfg: FitConfig) -> tuple[tuple[int, int], tuple[int, int] | None, list[str]]:
    notes = []
    if cfg.fit_range is None:
        fit_range, default_hold = default_ranges(curve.points, curve.reference_context)
        hi8 = curve.reference_context // 8
        if fit_range[0] < 4 or fit_range[1] > hi8:
            notes.append(f"default fit range widened to {fit_range[0]}:{fit_range[1]} (fewer than {MIN_DEFAULT_FIT_POINTS} "
                         f"{curve.sweep}s in [4, N/8 = {hi8}]); --fit-range LO:HI sets it")
    else:
        fit_range = tuple(cfg.fit_range)
        largest = int(np.max(curve.points))
        if fit_range[1] >= largest:
            notes.append(f"--fit-range {fit_range[0]}:{fit_range[1]} reaches the largest measured {curve.sweep} "
                         f"({largest}): every {curve.sweep} from {fit_range[0]} is fitted and none is held out for "
                         "the extrapolation comparison")
        hold_hi = curve.reference_context // 2
        default_hold = (fit_range[1] + 1, hold_hi) if hold_hi > fit_range[1] else None
    holdout_range = tuple(cfg.holdout_range) if cfg.holdout_range is not None else default_hold
    if holdout_range is not None and holdout_range[0] <= fit_range[1] and holdout_range[1] >= fit_range[0]:
        notes.append(f"holdout range {holdout_range[0]}:{holdout_range[1]} overlaps the fit range: its error is not an extrapolation")
    return fit_range, holdout_range, notes


def _exclusion_notes(metric: str, sweep: str, cls: PointClasses, n_inf: np.ndarray, points: np.ndarray) -> list[str]:
    notes = []
    if cls.exact_zero_at is not None:
        notes.append(f"{metric}: D reaches exactly 0 at {sweep} {cls.exact_zero_at} (every target 0): a measured answer; "
                     f"fits use only the {sweep}s before it")
    if cls.infinite:
        counts = {int(p): int(c) for p, c in zip(points, n_inf) if int(p) in cls.infinite}
        notes.append(f"{metric}: {sweep}s {cls.infinite} have an infinite mean (targets with +inf per {sweep}: {counts}); "
                     "left out of the fits")
    if cls.noise_floor:
        notes.append(f"{metric}: {sweep}s {cls.noise_floor} lie at the float32 noise floor (mean <= {cls.floor:g}, "
                     "docs/precision.md): zero sensitivity, left out of the fits")
    if cls.no_values:
        notes.append(f"{metric}: {sweep}s {cls.no_values} have no value (every target NaN); left out of the fits")
    return notes


def fit_curve(curve: Curve, cfg: FitConfig, seed: int | None = None,
              on_metric: Callable[[str], None] | None = None) -> CurveFits:
    """Fit every metric and family of one curve, with bootstrap intervals.

    Points are sorted by :func:`truncsens.fits.points.classify_points`: infinite means, points
    without values, zeros and points at the float32 noise floor are left out of the fits and
    listed; when the curve reaches exactly 0 the fits use only the points before it. A curve
    that has too few usable points for that reason (an exact zero, the noise floor, infinite
    means) gets "skipped" fits with the reason, not an error: it is a measured answer.

    Args:
        curve: from :func:`truncsens.fits.curves.curves_of`.
        cfg: the configuration.
        seed: resampling seed (default ``cfg.seed``).
        on_metric: called with each metric's name before it is fitted (progress).

    Returns:
        :class:`CurveFits` (its dicts are the JSON entries of :mod:`truncsens.fits.fit_file`).

    Raises:
        FitError: bad ranges, too few points in the fit range (the message names ``--fit-range``),
            a curve with no finite value, or bootstrapping one document.
    """
    x = curve.fit_x  # [S] mean actual windows of a block-protocol file, else the points
    pts = curve.points
    fit_range, holdout_range, notes = _ranges(curve, cfg)
    in_fit = (pts >= fit_range[0]) & (pts <= fit_range[1])
    in_hold = np.zeros_like(in_fit) if holdout_range is None else (pts >= holdout_range[0]) & (pts <= holdout_range[1])
    if in_fit.sum() < 2:
        raise FitError(
            f"{curve.label}: the fit range {fit_range[0]}:{fit_range[1]} holds {int(in_fit.sum())} measured "
            f"{curve.sweep}(s) of {pts.tolist()}; need at least 2: give a wider fit_range (--fit-range LO:HI)")
    if cfg.n_boot > 0 and curve.n_docs < 2:
        raise FitError(f"{curve.label}: bootstrap over documents needs at least 2 documents, the file has {curve.n_docs}; "
                       "pass bootstrap=0 (--bootstrap 0) to fit without intervals")
    B = int(cfg.n_boot)
    mult = resample_weights(curve.n_docs, B, cfg.seed if seed is None else seed)  # [1+B, G]
    metrics_out: dict[str, dict] = {}
    fits: list[dict] = []
    comparisons: list[dict] = []
    power_alpha: dict[str, np.ndarray] = {}
    for metric in cfg.metrics:
        if on_metric is not None:
            on_metric(metric)
        mean_all, se_all = resampled_mean_se(mult, curve.sums[metric], curve.counts[metric])  # [1+B, S]
        pos, neg = curve.inf_counts(metric)
        mean_all = mean_with_inf(mean_all, pos, neg)  # a point with a +inf target is infinite in every resample
        cls = classify_points(pts, mean_all[0], metric)
        usable_all = usable_mask(pts, mean_all, metric, cls.exact_zero_at)  # [1+B, S]
        y_all, w_all = log_weights(np.where(usable_all, mean_all, np.nan), se_all)
        mean, se = mean_all[0], se_all[0]
        if not np.isfinite(mean).any():
            raise FitError(f"{curve.label}: no {curve.sweep} has a finite mean {metric} (infinite at {cls.infinite}, "
                           f"no values at {cls.no_values}): nothing to fit")
        n_inf = pos + neg
        notes += _exclusion_notes(metric, curve.sweep, cls, n_inf, pts)
        metrics_out[metric] = {"points": pts.tolist(), "mean": mean.tolist(), "se": se.tolist(),
                               "excluded_points": cls.excluded, "excluded": cls.to_json(), "n_inf": n_inf.tolist(),
                               "n_nan": curve.n_nan.get(metric, np.zeros(pts.shape, int)).tolist()}
        if curve.x is not None:  # block protocol: the abscissa the fits used (mean actual windows)
            metrics_out[metric]["fit_x"] = x.tolist()
        if B:
            metrics_out[metric]["bootstrap_mean"] = mean_all[1:].tolist()  # [B, S]: measured crossings per resample
        fw = in_fit & cls.usable
        hw = in_hold & cls.usable
        skip = None
        if fw.sum() < 2:
            reason = (f"{metric} has {int(fw.sum())} usable {curve.sweep}(s) in the fit range {fit_range[0]}:{fit_range[1]}"
                      f" (excluded: {cls.excluded})")
            if cls.exact_zero_at is None and not cls.noise_floor and not cls.infinite:
                raise FitError(f"{curve.label}: {reason}; need at least 2: give a wider fit_range (--fit-range LO:HI)")
            skip = reason + ("; the curve reaches exactly 0 at " + f"{curve.sweep} {cls.exact_zero_at}" if cls.exact_zero_at is not None
                             else "; the curve is at the noise floor or infinite there") + ": no law to fit, the measurement is the answer"
        fam_mae: dict[str, np.ndarray] = {}
        fam_point: dict[str, dict] = {}
        for family in cfg.families:
            names = family_record(family).params
            base = {
                "curve": None, "results_file": curve.results_file, "label": curve.label, "policy": curve.policy,
                "metric": metric, "family": family, "fit_range": list(fit_range),
                "fit_points": [int(v) for v in pts[fw]],
                "holdout_range": list(holdout_range) if holdout_range else None,
                "holdout_points": [int(v) for v in pts[hw]], "excluded_points": cls.excluded,
                "n_docs": curve.n_docs, "n_targets": curve.n_targets, "n_boot": B,
            }
            skipped = {"status": "skipped", "params": {}, "aic": None, "wrss": None, "extrapolation_mae": None,
                       "n_boot_failed": 0, "converged": None, "optimizer": None}
            if skip:
                fits.append({**base, **skipped, "reason": skip})
                continue
            try:
                point = fit_family(family, x[fw], y_all[0, fw], w_all[0, fw])
            except FitError as exc:
                fits.append({**base, **skipped, "reason": str(exc)})
                continue
            if not point["converged"]:  # marked, kept for inspection, never compared or used for a recommendation
                fits.append({**base, "status": "not_converged", "reason": f"the optimizer did not converge ({point['optimizer']})",
                             "params": {n: {"value": point[n], "ci": None} for n in names},
                             "aic": point["aic"], "wrss": point["wrss"], "extrapolation_mae": None, "n_boot_failed": 0,
                             "converged": False, "optimizer": point["optimizer"]})
                continue
            boot = fit_family_batch(family, x[fw], y_all[1:, fw], np.where(usable_all[1:, fw], w_all[1:, fw], 0.0), start=point) if B else None
            params = {name: {"value": point[name], "ci": interval_or_none(boot[name] if boot else None, cfg.level)}
                      for name in names}
            mae_point = mae_boot = None
            if hw.any():
                mae_point = float(extrapolation_mae(family, {k: point[k] for k in names}, x[hw], y_all[0, hw], np.ones(hw.sum(), bool)))
                if boot:
                    mae_boot = extrapolation_mae(family, boot, x[hw], y_all[1:, hw], usable_all[1:, hw])  # [B]
                fam_mae[family] = np.concatenate([[mae_point], mae_boot if mae_boot is not None else []])
            n_failed = int(np.sum(~np.isfinite(boot[names[1]]))) if boot else 0
            entry = {**base, "status": "ok", "reason": None, "params": params, "aic": point["aic"], "wrss": point["wrss"],
                     "extrapolation_mae": None if mae_point is None else {"value": mae_point, "ci": interval_or_none(mae_boot, cfg.level)},
                     "n_boot_failed": n_failed, "converged": True, "optimizer": point["optimizer"]}
            if family == "power" and boot:
                entry["bootstrap_samples"] = {"C": boot["C"].tolist(), "alpha": boot["alpha"].tolist()}
            if family == "power":
                power_alpha[metric] = np.concatenate([[point["alpha"]], boot["alpha"] if boot else []])
            fam_point[family] = point
            fits.append(entry)
        comparisons.append(compare_families(curve, metric, fam_mae, fam_point, cfg.level))
    alpha_ratio = None
    if "tv" in power_alpha and "kl" in power_alpha:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = power_alpha["kl"] / power_alpha["tv"]  # [1+B]
        alpha_ratio = {"curve": None, "label": curve.label, "results_file": curve.results_file, "value": float(ratio[0]),
                       "ci": interval_or_none(ratio[1:], cfg.level)}
    return CurveFits(curve, fit_range, holdout_range, metrics_out, fits, comparisons, alpha_ratio, notes)


@dataclass
class FitReport:
    """Fits of one or more results datasets; :meth:`to_json` gives the fit file dict (``created``:
    ISO 8601 UTC time of the fit, or "" to stamp it when :meth:`to_json` runs)."""

    config: FitConfig
    results: list[CurveFits]
    created: str = ""

    def to_json(self) -> dict:
        """The fit file as a dict (:func:`truncsens.fits.fit_file.fit_document`; non-finite numbers -> None)."""
        return fit_document(self)


def curve_labels(sources: Sequence[str | Path]) -> list[str]:
    """Table labels of results files: the file stem, or ``parent/stem`` where two stems collide. An empty
    source (a dataset held in memory) is ``results``, or ``results-<i>`` (i from 1) when there are several."""
    stems = [Path(p).stem if str(p) else "" for p in sources]
    memory = [i for i, p in enumerate(sources) if not str(p)]
    return [(s if stems.count(s) == 1 else f"{Path(p).parent.name}/{s}") if str(p) else
            ("results" if len(memory) == 1 else f"results-{memory.index(i) + 1}") for i, (s, p) in enumerate(zip(stems, sources))]


def fit_datasets(datasets: Sequence[xr.Dataset], cfg: FitConfig = FitConfig(), sources: Sequence[str | Path] | None = None,
                 created: str = "", on_stage: Callable[[str, int, int], None] | None = None) -> FitReport:
    """Fit results datasets side by side.

    Each curve gets its own resampling seed ``cfg.seed + index`` so that curves are independent.

    Args:
        datasets: results datasets (:func:`truncsens.results.load`, or ``truncsens.measure``).
        cfg: the configuration.
        sources: the results file of each dataset, as the fit file records it and as labels are
            made (:func:`curve_labels`); "" (or None for all) for a dataset held in memory.
        created: the fit's time stamp (ISO 8601 UTC; "" stamps it when the fit file dict is made).
        on_stage: progress: called ``(what, index, total)`` as each (curve, metric) fit begins, index
            from 1 (:class:`truncsens.engine.run.progress.StageProgress`).

    Raises:
        ResultsError: an unknown metric, or a dataset with fewer sweep points than the least any family of
            ``cfg.families`` can be fitted to (:func:`truncsens.fits.laws.min_windows`: 3 for power).
        FitError: see :func:`fit_curve`.
        ValueError: ``sources`` and ``datasets`` differ in length.
    """
    sources = [""] * len(datasets) if sources is None else [str(p) for p in sources]
    if len(sources) != len(datasets):
        raise ValueError(f"{len(datasets)} datasets but {len(sources)} sources")
    curves: list[Curve] = []
    for ds, source, label in zip(datasets, sources, curve_labels(sources)):
        curves.extend(curves_of(ds, cfg.metrics, source, label, min_points=min_windows(cfg.families)))
    total, done = len(curves) * len(cfg.metrics), iter(range(1, len(curves) * len(cfg.metrics) + 1))
    what = f"{len(cfg.families)} famil{'y' if len(cfg.families) == 1 else 'ies'}" + (f", {cfg.n_boot} bootstrap resamples" if cfg.n_boot else "")

    def stage(curve: Curve):
        if on_stage is None:
            return None
        return lambda metric: on_stage(f"fitting {curve.label} {metric}: {what}", next(done), total)

    return FitReport(cfg, [fit_curve(c, cfg, seed=cfg.seed + i, on_metric=stage(c)) for i, c in enumerate(curves)], created)
