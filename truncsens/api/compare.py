"""``truncsens.compare_policies``: retention policies at equal budget, side by side (one run, or
several runs of other policies on the same targets joined along ``policy``): means with bootstrap
intervals, the random / sink_recent ratio, power-law fits (:mod:`truncsens.report.policy_comparison`).
Keyword names are ``truncsens compare-policies``'s options in snake_case."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import xarray as xr

from truncsens.api.load import Results, datasets_of, load
from truncsens.fits.fit_file import check_new_files, write_json
from truncsens.fits.fitting import curve_labels, parse_range
from truncsens.report.plots import figure_paths, plot_comparison
from truncsens.report.policy_comparison import CompareConfig, PolicyComparison
from truncsens.report.policy_comparison import compare_policies as compare_dataset
from truncsens.metrics import DEFAULT_METRICS
from truncsens.results.join import join_policy_runs


def compare_policies(results: Results | Sequence[Results], *, metrics: str | Sequence[str] | None = None,
                     numerator: str | None = None, denominator: str | None = None, bootstrap: int = 1000,
                     seed: int = 0, fit_range: str | tuple[int, int] | None = None,
                     truncation: str | Path | xr.Dataset | None = None, paired_against: str | None = None,
                     json_out: str | Path | None = None, plot_out: str | Path | None = None,
                     overwrite: bool = False) -> PolicyComparison:
    """Compare the policies of budget sweeps (``truncsens measure --policy ...``).

    Args:
        results: a results file or Dataset of a budget sweep, or several of other policies on the
            same targets and settings (:func:`truncsens.results.join.join_policy_runs`).
        metrics: metrics to summarize and fit (default: :data:`truncsens.metrics.DEFAULT_METRICS`; the figure draws the first).
        numerator, denominator: policies of the ratio of means (default random / sink_recent).
        bootstrap: resamples over documents (0: no intervals); seed: their seed.
        fit_range: budgets ``(lo, hi)`` or ``"LO:HI"`` of the power-law fits (default: as :func:`truncsens.fit`).
        truncation: a window results file or Dataset whose power-law alpha is listed beside the policies'; each
            recency policy is also fitted against the recent span it keeps (k - S for sink_recent with S sinks, k
            for suffix) over the truncation fit's range, and the difference of the two exponents reported: paired,
            with a document-bootstrap interval and a verdict, when both runs measured the same targets
            (:attr:`~truncsens.report.policy_comparison.PolicyComparison.paired`).
        paired_against: a policy of the results (e.g. ``"sink_recent"``): every other policy's power-law
            exponent in k minus its, paired on the same targets, with a document-bootstrap interval and a
            verdict (faster / same / slower; :attr:`~truncsens.report.policy_comparison.PolicyComparison.against`).
        json_out: also write the comparison as JSON here; plot_out: draw the log-log figure to
            ``<plot_out>.png`` / ``.pdf``.
        overwrite: replace them; without it an existing one is refused before the bootstrap.

    Returns:
        the :class:`~truncsens.report.policy_comparison.PolicyComparison` (``.to_json()``; printed by
        :func:`truncsens.report.printed.format_comparison`).

    Raises:
        FileExistsError: an output exists and not ``overwrite``.
        ValueError: no metric, a bad range, an explicit ratio or ``paired_against`` policy the results lack.
        FileNotFoundError, truncsens.results.ResultsError: a missing or unreadable file, runs of other
            targets or settings, not a budget sweep.
        truncsens.fits.laws.FitError: bootstrap with fewer than 2 documents.
    """
    names = (tuple(v.strip() for v in metrics.split(",") if v.strip()) if isinstance(metrics, str) else tuple(metrics or ())) or DEFAULT_METRICS
    if isinstance(fit_range, str):
        fit_range = parse_range(fit_range, "fit_range (--fit-range)")
    cfg = CompareConfig(metrics=names, numerator=numerator, denominator=denominator, n_boot=bootstrap, seed=seed,
                        fit_range=tuple(fit_range) if fit_range else None, paired_against=paired_against)
    check_new_files([json_out, *(figure_paths(plot_out) if plot_out is not None else [])], overwrite)  # before the bootstrap
    datasets, sources = datasets_of(results)
    sources = [s or label for s, label in zip(sources, curve_labels(sources))]  # a Dataset in memory: "results"
    ds = join_policy_runs(datasets, sources)
    trunc = load(truncation) if isinstance(truncation, (str, Path)) else truncation
    cmp = compare_dataset(ds, cfg, trunc, source=", ".join(sources))
    if plot_out is not None:
        plot_comparison(cmp, plot_out, names[0])
    if json_out is not None:
        write_json(cmp.to_json(), json_out)
    return cmp
