"""Figures: log-log D(w) with standard-error bars and the fitted laws, one panel per metric
(:func:`plot_report`), and retention policies at equal budget (:func:`plot_comparison`).

D(w) is drawn from a fit file dict (:mod:`truncsens.fits.fit_file`), which holds both the measured
curves (mean and cluster-robust se per sweep point) and the fitted parameters.
Figures are built on ``matplotlib.figure.Figure`` (Agg canvas, no pyplot state), so no display is
needed. Each figure is written as PNG and PDF.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from truncsens.fits.laws import FAMILY_RECORDS, law_value
from truncsens.metrics import find
from truncsens.report.tables import fmt_level

if TYPE_CHECKING:  # type hints only
    from truncsens.report.policy_comparison import PolicyComparison

_FAMILIES = {f.name: f for f in FAMILY_RECORDS}  # line style and legend formula of each family


def axis_label(metric: str) -> str:
    """``"mean <metric>"``, with ``" (nats)"`` for a metric whose record's unit is nats (KL, JS, NLL)."""
    record = find(metric)
    return f"mean {metric}" + (f" ({record.unit})" if record is not None and record.unit == "nats" else "")


def _law_params(fit: dict) -> dict[str, float] | None:
    if fit.get("status") != "ok":
        return None
    p = {k: v["value"] for k, v in fit["params"].items()}
    if any(v is None for v in p.values()):
        return None
    return p


def panel_metrics(doc: dict, metrics: Sequence[str] | None = None) -> list[str]:
    """Metrics to draw: ``metrics`` if given (in that order), else every fitted metric of the file.

    Raises:
        ValueError: a requested metric is not in the fit file.
    """
    have = list(dict.fromkeys(m for c in doc["curves"] for m in c["metrics"]))
    if not metrics:
        return have
    missing = [m for m in metrics if m not in have]
    if missing:
        raise ValueError(f"metric(s) {', '.join(missing)} not in the fit (it has {', '.join(have)})")
    return list(metrics)


def build_figure(doc: dict, metrics: Sequence[str] | None = None, families: Sequence[str] | None = None):
    """The matplotlib Figure of :func:`plot_report` (one visible axes per metric), not saved.

    Raises:
        ValueError: unknown metric, or nothing to draw.
    """
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas for PNG/PDF

    metrics = panel_metrics(doc, metrics)
    if not metrics:
        raise ValueError("nothing to plot: the fit has no curves")
    n = len(metrics)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(5.2 * cols, 4.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, metric in enumerate(metrics):
        ax = axes[k // cols][k % cols]
        measured: list[float] = []
        for ci, curve in enumerate(doc["curves"]):
            if metric not in curve["metrics"]:
                continue
            color = colors[ci % len(colors)]
            m = curve["metrics"][metric]
            w = np.asarray(m["points"], dtype=float)
            mean = np.asarray([np.nan if v is None else v for v in m["mean"]], dtype=float)
            se = np.asarray([0.0 if v is None else v for v in m["se"]], dtype=float)
            ok = np.isfinite(mean) & (mean > 0)
            measured.extend(mean[ok].tolist())
            lower = np.minimum(se[ok], mean[ok] * 0.999)  # keep the bar above zero on a log axis
            ax.errorbar(w[ok], mean[ok], yerr=[lower, se[ok]], fmt="o", ms=4, capsize=2, color=color,
                        label=f"{curve['label']} (mean ± se)")
            lo = max(float(w[ok].min()) if ok.any() else 1.0, 1.0)
            hi = float(w[ok].max()) if ok.any() else 2.0
            grid = np.geomspace(lo, hi, 200)
            for fit in doc["fits"]:
                if fit["curve"] != curve["index"] or fit["metric"] != metric:
                    continue
                if families and fit["family"] not in families:
                    continue
                params = _law_params(fit)
                if params is None:
                    continue
                with np.errstate(all="ignore"):
                    yv = law_value(fit["family"], params, grid)
                good = np.isfinite(yv) & (yv > 0)
                record = _FAMILIES.get(fit["family"])
                ax.plot(grid[good], yv[good], record.style if record else "-", color=color, lw=1.2,
                        label=f"{curve['label']} {fit['family']}: {record.label if record else ''}")
            fr = curve.get("fit_range")
            if fr:
                for x in fr:
                    ax.axvline(x, color=color, lw=0.6, alpha=0.4, ls="-.")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if measured:  # keep the data in view even where a law dives far below it
            ax.set_ylim(min(measured) / 4, max(measured) * 2)
        sweep = doc["curves"][0].get("sweep", "window")
        ax.set_xlabel(f"{sweep} {'k' if sweep == 'budget' else 'w'} (tokens)")  # k for budgets, w for windows
        ax.set_ylabel(axis_label(metric))
        ax.set_title(f"{metric}: D(w) and fitted laws")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=6.5, loc="lower left")
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.tight_layout()
    return fig


FIGURE_SUFFIXES = (".png", ".pdf")


def figure_paths(prefix: str | Path) -> list[Path]:
    """The two files a figure with output ``prefix`` is written to: ``<prefix>.png`` and
    ``<prefix>.pdf``. A prefix that already ends in ``.png`` or ``.pdf`` (``--out fig.png``) stands
    for its stem, so ``fig.png`` gives ``fig.png`` and ``fig.pdf`` (not ``fig.png.png``)."""
    prefix = Path(prefix)
    if prefix.suffix.lower() in FIGURE_SUFFIXES:
        prefix = prefix.with_suffix("")
    return [prefix.with_name(prefix.name + suffix) for suffix in FIGURE_SUFFIXES]


def plot_report(doc: dict, out_prefix: str | Path, metrics: Sequence[str] | None = None,
                families: Sequence[str] | None = None) -> list[Path]:
    """Draw D(w) per metric (one panel each) with se bars and fitted laws; save PNG and PDF.

    Args:
        doc: a fit file dict (:func:`truncsens.fits.fit_file.fit_document` or :func:`truncsens.fits.fit_file.read_fit_file`).
        out_prefix: output prefix; ``<prefix>.png`` and ``<prefix>.pdf`` are written (:func:`figure_paths`).
        metrics: panels to draw (default: all metrics in the file).
        families: laws to draw (default: every fitted family).

    Returns:
        [png path, pdf path].

    Raises:
        ValueError: unknown metric, or nothing to draw.
    """
    fig = build_figure(doc, metrics, families)
    paths = figure_paths(out_prefix)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    return paths


def plot_comparison(cmp: PolicyComparison, stem: str | Path, metric: str | None = None) -> list[Path]:
    """Log-log plot of the mean ``metric`` per budget of every policy, with intervals and power fits.

    Args:
        cmp: the comparison.
        stem: output prefix; ``<stem>.png`` and ``<stem>.pdf`` are written (:func:`figure_paths`).
        metric: which metric (default: the first of the comparison).

    Returns:
        The two paths written.
    """
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas for PNG/PDF

    metric = metric or cmp.metrics[0]
    if metric not in cmp.metrics:
        raise ValueError(f"metric {metric!r} is not in the comparison (it has {', '.join(cmp.metrics)})")
    k = np.asarray(cmp.budgets, dtype=float)
    fig = Figure(figsize=(5.5, 4.0))
    ax = fig.subplots()
    for i, p in enumerate(cmp.policies):
        mean, lo, hi = cmp.mean_curve(p, metric)
        ok = np.isfinite(mean) & (mean > 0)
        color = f"C{i}"
        ax.plot(k[ok], mean[ok], "o-", color=color, label=p, ms=4)
        band = ok & np.isfinite(lo) & np.isfinite(hi) & (lo > 0)
        if band.any():
            ax.fill_between(k[band], lo[band], hi[band], color=color, alpha=0.2, lw=0)
        fit = next((f for f in cmp.fits if f["policy"] == p and f["metric"] == metric and f["status"] == "ok"), None)
        if fit and fit["fit_points"]:
            x = np.geomspace(fit["fit_points"][0], fit["fit_points"][-1], 50)
            ax.plot(x, fit["C"] * x ** (-fit["alpha"]), "--", color=color, lw=1,
                    label=f"{p} fit: $\\alpha$={fit['alpha']:.2f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("budget k (kept tokens)")
    ax.set_ylabel(axis_label(metric))
    ax.set_title(f"{metric} at equal budget: mean and {fmt_level(cmp.level)} interval")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = figure_paths(stem)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for path in paths:
        fig.savefig(path, dpi=150)
    return paths
