"""Compare retention policies measured at equal budgets (``truncsens compare-policies RESULTS``).

For a results file with a ``budget`` sweep (and a ``policy`` dim, or one policy named by the
``policy`` attr):

- per budget, the mean of each metric per policy with a percentile bootstrap interval, resampling
  **documents** (design.md; :mod:`truncsens.fitting` helpers, the same resamples for every policy,
  so policies are compared pairwise on the same documents);
- the ratio of means ``numerator / denominator`` (default ``random / sink_recent``, the comparison
  of arXiv 2605.25085: about two orders of magnitude) per budget, with its paired bootstrap interval;
- the power-law fit ``D(k) = C·k^-α`` of each policy (:func:`truncsens.fitting.fit_curve`, the
  ``truncsens fit`` code), optionally beside the α of a truncation (window) results file;
- a log-log plot of every policy (matplotlib, PNG and PDF).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import xarray as xr

from truncsens.fitting import (
    Curve, FitConfig, FitError, bootstrap_multiplicities, curves_of, fit_curve, percentile_ci, resampled_mean_se,
    sanitize,
)
from truncsens.results import ResultsError, sweep_dim


@dataclass(frozen=True)
class CompareConfig:
    """What :func:`compare_policies` computes.

    Attributes:
        metrics: metric names to summarize and fit.
        numerator, denominator: the policies of the ratio of means.
        n_boot: bootstrap resamples over documents (0: no intervals).
        seed: resampling seed.
        level: interval level.
        fit_range: (lo, hi) budgets of the power-law fit, inclusive (None: the ``fit`` default).
    """

    metrics: tuple[str, ...] = ("kl", "tv")
    numerator: str = "random"
    denominator: str = "sink_recent"
    n_boot: int = 1000
    seed: int = 0
    level: float = 0.95
    fit_range: tuple[int, int] | None = None


@dataclass
class PolicyComparison:
    """Result of :func:`compare_policies` (plain lists of dicts, JSON-ready with :meth:`to_json`).

    Attributes:
        policies: policy names in file order.
        budgets: [K] budgets in tokens.
        table: rows ``{"policy", "metric", "budget", "mean", "ci": [lo, hi], "n_docs"}``.
        ratios: rows ``{"metric", "budget", "numerator", "denominator", "value", "ci": [lo, hi]}``.
        fits: rows ``{"policy", "metric", "status", "reason", "alpha", "alpha_ci", "C", "C_ci", "fit_budgets"}``
            (``policy`` is ``"truncation"`` for the fit of a window results file).
        notes: warnings (e.g. a ratio policy missing).
        metrics: the metrics compared; level: the interval level.
    """

    policies: list[str]
    budgets: list[int]
    table: list[dict]
    ratios: list[dict]
    fits: list[dict]
    notes: list[str] = field(default_factory=list)
    metrics: tuple[str, ...] = ()
    level: float = 0.95

    def to_json(self) -> dict:
        """A JSON-safe dict (non-finite numbers become null)."""
        return sanitize({"policies": self.policies, "budgets": self.budgets, "metrics": list(self.metrics), "level": self.level,
                         "table": self.table, "ratios": self.ratios, "fits": self.fits, "notes": self.notes})

    def mean_curve(self, policy: str, metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean [K], lo [K], hi [K]) of one policy and metric, in budget order."""
        rows = {r["budget"]: r for r in self.table if r["policy"] == policy and r["metric"] == metric}
        mean = np.array([rows[k]["mean"] for k in self.budgets], dtype=float)
        lo = np.array([np.nan if rows[k]["ci"] is None else rows[k]["ci"][0] for k in self.budgets], dtype=float)
        hi = np.array([np.nan if rows[k]["ci"] is None else rows[k]["ci"][1] for k in self.budgets], dtype=float)
        return mean, lo, hi


def policy_curves(ds: xr.Dataset, metrics: Sequence[str]) -> list[tuple[str, Curve]]:
    """(policy name, curve) pairs of a budget-sweep results dataset.

    Raises:
        ResultsError: not a budget sweep, or no policy named (no ``policy`` dim or attr).
    """
    if sweep_dim(ds) != "budget":
        raise ResultsError("compare-policies needs a policy results file (a 'budget' sweep from measure --policy); "
                           "this one sweeps windows: use truncsens fit on it, or pass it with --truncation")
    curves = curves_of(ds, list(metrics))
    if "policy" in ds.dims:
        return [(str(c.policy), c) for c in curves]
    name = str(ds.attrs.get("policy", "")).strip()
    if not name:
        raise ResultsError("the results file names no policy (no 'policy' dim or attr)")
    return [(name, curves[0])]


def compare_policies(ds: xr.Dataset, cfg: CompareConfig = CompareConfig(), truncation: xr.Dataset | None = None) -> PolicyComparison:
    """Per-budget means with intervals, the policy ratio, and power-law fits.

    Args:
        ds: a results dataset with a ``budget`` sweep.
        cfg: the configuration.
        truncation: optionally a window results dataset; its power-law α is fitted with the same
            settings and listed under policy ``"truncation"``.

    Returns:
        :class:`PolicyComparison`.

    Raises:
        ResultsError: not a policy results file, or an unknown metric.
        FitError: bootstrap asked with fewer than 2 documents.
    """
    named = policy_curves(ds, cfg.metrics)
    policies = [n for n, _ in named]
    budgets = [int(k) for k in named[0][1].windows]
    G = named[0][1].n_docs
    if cfg.n_boot > 0 and G < 2:
        raise FitError(f"bootstrap over documents needs at least 2 documents, the file has {G}; pass --bootstrap 0")
    mult = np.vstack([np.ones((1, G)), bootstrap_multiplicities(G, cfg.n_boot, cfg.seed) if cfg.n_boot else np.zeros((0, G))])
    means: dict[tuple[str, str], np.ndarray] = {}
    table, ratios, fits, notes = [], [], [], []
    for name, curve in named:
        for metric in cfg.metrics:
            m, _ = resampled_mean_se(mult, curve.sums[metric], curve.counts[metric])  # [1+B, K]
            means[(name, metric)] = m
            for j, k in enumerate(budgets):
                ci = list(percentile_ci(m[1:, j], cfg.level)) if cfg.n_boot else None
                table.append({"policy": name, "metric": metric, "budget": k, "mean": float(m[0, j]), "ci": ci, "n_docs": G})
    if cfg.numerator in policies and cfg.denominator in policies:
        for metric in cfg.metrics:
            with np.errstate(divide="ignore", invalid="ignore"):
                r = means[(cfg.numerator, metric)] / means[(cfg.denominator, metric)]  # [1+B, K]
            for j, k in enumerate(budgets):
                ratios.append({"metric": metric, "budget": k, "numerator": cfg.numerator, "denominator": cfg.denominator,
                               "value": float(r[0, j]), "ci": list(percentile_ci(r[1:, j], cfg.level)) if cfg.n_boot else None})
    else:
        missing = [p for p in (cfg.numerator, cfg.denominator) if p not in policies]
        notes.append(f"ratio {cfg.numerator}/{cfg.denominator} skipped: the file has no policy {', '.join(missing)} "
                     f"(it has {', '.join(policies)})")
    fit_cfg = FitConfig(metrics=tuple(cfg.metrics), families=("power",), fit_range=cfg.fit_range, n_boot=cfg.n_boot,
                        seed=cfg.seed, level=cfg.level)
    extra = []
    if truncation is not None:
        extra = [(f"truncation{'' if c.policy is None else '[' + c.policy + ']'}", c) for c in curves_of(truncation, list(cfg.metrics))]
    for name, curve in list(named) + extra:
        fits.extend(_power_fits(name, curve, fit_cfg))
    return PolicyComparison(policies, budgets, table, ratios, fits, notes, tuple(cfg.metrics), cfg.level)


def _power_fits(name: str, curve: Curve, cfg: FitConfig) -> list[dict]:
    try:
        cf = fit_curve(curve, cfg)
    except FitError as exc:
        return [{"policy": name, "metric": m, "status": "skipped", "reason": str(exc), "alpha": None, "alpha_ci": None,
                 "C": None, "C_ci": None, "fit_budgets": []} for m in cfg.metrics]
    rows = []
    for f in cf.fits:
        ok = f["status"] == "ok"
        rows.append({"policy": name, "metric": f["metric"], "status": f["status"], "reason": f["reason"],
                     "alpha": f["params"]["alpha"]["value"] if ok else None,
                     "alpha_ci": f["params"]["alpha"]["ci95"] if ok else None,
                     "C": f["params"]["C"]["value"] if ok else None, "C_ci": f["params"]["C"]["ci95"] if ok else None,
                     "fit_budgets": f["fit_windows"]})
    return rows


def _num(v: float | None, digits: int = 4) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.{digits}g}"


def _ci(ci: list | None) -> str:
    if not ci or ci[0] is None or not all(math.isfinite(c) for c in ci):
        return ""
    return f" [{_num(ci[0], 3)}, {_num(ci[1], 3)}]"


def format_comparison(cmp: PolicyComparison) -> str:
    """A readable text report of a :class:`PolicyComparison`."""
    pct = f"{round(100 * cmp.level)}%"
    lines = []
    for metric in cmp.metrics:
        lines.append(f"{metric}: mean per budget ({pct} bootstrap interval over documents)")
        lines.append(f"{'budget':>8}  " + "  ".join(f"{p:>30}" for p in cmp.policies))
        for k in cmp.budgets:
            cells = []
            for p in cmp.policies:
                row = next(r for r in cmp.table if r["policy"] == p and r["metric"] == metric and r["budget"] == k)
                cells.append(f"{_num(row['mean']) + _ci(row['ci']):>30}")
            lines.append(f"{k:>8}  " + "  ".join(cells))
        rs = [r for r in cmp.ratios if r["metric"] == metric]
        if rs:
            lines.append(f"ratio {rs[0]['numerator']} / {rs[0]['denominator']} of mean {metric}:")
            for r in rs:
                lines.append(f"{r['budget']:>8}  {_num(r['value']) + _ci(r['ci'])}")
        lines.append("")
    lines.append(f"power-law fits D(k) = C k^-alpha ({pct} interval)")
    for f in cmp.fits:
        if f["status"] == "ok":
            lines.append(f"  {f['policy']:>20} {f['metric']:>6}  alpha = {_num(f['alpha'])}{_ci(f['alpha_ci'])}"
                         f"  C = {_num(f['C'])}  (budgets {f['fit_budgets'][0]}..{f['fit_budgets'][-1]})")
        else:
            lines.append(f"  {f['policy']:>20} {f['metric']:>6}  skipped: {f['reason']}")
    lines += [f"note: {n}" for n in cmp.notes]
    return "\n".join(lines)


def plot_comparison(cmp: PolicyComparison, stem: str | Path, metric: str | None = None) -> list[Path]:
    """Log-log plot of the mean ``metric`` per budget of every policy, with intervals and power fits.

    Args:
        cmp: the comparison.
        stem: output path without suffix; ``.png`` and ``.pdf`` are written.
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
        if fit and fit["fit_budgets"]:
            x = np.geomspace(fit["fit_budgets"][0], fit["fit_budgets"][-1], 50)
            ax.plot(x, fit["C"] * x ** (-fit["alpha"]), "--", color=color, lw=1,
                    label=f"{p} fit: $\\alpha$={fit['alpha']:.2f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("budget k (kept tokens)")
    ax.set_ylabel(f"mean {metric} (nats)" if metric in ("kl", "kl_reverse", "js", "nll_ref", "nll_kept") else f"mean {metric}")
    ax.set_title(f"{metric} at equal budget: mean and {round(100 * cmp.level)}% interval")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    for path in paths:
        fig.savefig(path, dpi=150)
    return paths
