"""Compare retention policies measured at equal budgets (``truncsens compare-policies RESULTS``).

For a results file with a ``budget`` sweep (and a ``policy`` dim, or one policy named by the
``policy`` attr):

- per budget, the mean of each metric per policy with a percentile bootstrap interval, resampling
  **documents** (:mod:`truncsens.stats`; the same resamples for every policy, so policies are
  compared pairwise on the same documents);
- the ratio of means ``numerator / denominator`` (default ``random / sink_recent``, the comparison
  of arXiv 2605.25085: about two orders of magnitude) per budget, with its paired bootstrap interval;
- the power-law fit ``D(k) = C·k^-α`` of each policy (:func:`truncsens.fits.fitting.fit_curve`, the
  ``truncsens fit`` code), optionally beside the α of a truncation (window) results file;
- with a truncation file, the exponent of each recency policy against the span of the recent past it
  keeps (:meth:`truncsens.policies.base.Policy.recent_span`: k for ``suffix``, k − S for ``sink_recent``
  with S sinks) over the truncation fit's range, and its difference from the truncation exponent
  (:func:`truncsens.fits.paired.paired_exponents`): paired, with a document-bootstrap interval and a
  verdict, when both runs measured the same targets (:func:`pairing_gap`), else the bare difference;
- with ``paired_against`` P, each other policy's exponent in k minus P's, paired on the same targets
  (:func:`truncsens.fits.paired.exponents_against`), with an interval and a verdict;
- for a file with R > 1 draws (``measure --draws R``): everything above on the per-target means
  over draws (:func:`truncsens.results.mean_over_draws`), and the spread between draws
  (:func:`draw_spread`): the mean over targets of each draw, their standard deviation (ddof 1) and
  range. The interval over documents and the spread between draws answer different questions: the
  first how the mean would vary with other documents, the second how much one draw of the policy's
  randomness moves it.

The log-log figure is :func:`truncsens.report.plots.plot_comparison`; the text report
:func:`truncsens.report.printed.format_comparison`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import xarray as xr

from truncsens.fits.curves import Curve, curves_of
from truncsens.fits.fit_file import sanitize
from truncsens.fits.fitting import FitConfig, check_resampling, fit_curve
from truncsens.fits.laws import FitError
from truncsens.fits.paired import exponents_against, paired_exponents, power_fit_rows, skipped_row, span_curve
from truncsens.metrics import DEFAULT_METRICS
from truncsens.policies import Policy, PolicyError, make_policy
from truncsens.results import ResultsError, is_per_layer, load, sweep_dim
from truncsens.results.join import SAME_SOURCE, attr_differences, check_same_weights, policy_names, target_difference
from truncsens.stats import interval_or_none, mean_with_inf, resample_weights, resampled_mean_se

DEFAULT_NUMERATOR, DEFAULT_DENOMINATOR = "random", "sink_recent"


@dataclass(frozen=True)
class CompareConfig:
    """What :func:`compare_policies` computes; validated once, on construction.

    Attributes:
        metrics: metric names to summarize and fit (at least one).
        numerator, denominator: the policies of the ratio of means; None = ``random`` / ``sink_recent``,
            skipped with a note when the file lacks them (a policy given explicitly must be in the file).
        n_boot: bootstrap resamples over documents (0: no intervals).
        seed: resampling seed.
        level: interval level, in (0, 1).
        fit_range: (lo, hi) budgets of the power-law fit, inclusive (None: the ``fit`` default).
        paired_against: a policy of the file whose exponent in k every other policy's is paired with
            (:func:`truncsens.fits.paired.exponents_against`), or None.

    Raises:
        ValueError: no metric, n_boot < 0 or level outside (0, 1).
    """

    metrics: tuple[str, ...] = DEFAULT_METRICS
    numerator: str | None = None
    denominator: str | None = None
    n_boot: int = 1000
    seed: int = 0
    level: float = 0.95
    fit_range: tuple[int, int] | None = None
    paired_against: str | None = None

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ValueError("metrics (--metrics) is empty")
        check_resampling(self.n_boot, self.seed, self.level)

    @property
    def ratio(self) -> tuple[str, str]:
        """(numerator, denominator) policy names, defaults filled in."""
        return self.numerator or DEFAULT_NUMERATOR, self.denominator or DEFAULT_DENOMINATOR


@dataclass
class PolicyComparison:
    """Result of :func:`compare_policies` (plain lists of dicts, JSON-ready with :meth:`to_json`).

    Attributes:
        policies: policy names in file order.
        budgets: [K] budgets in tokens.
        table: rows ``{"policy", "metric", "budget", "mean", "ci": [lo, hi], "n_docs", "n_inf"}`` (``n_inf``
            targets with an infinite value: the mean is then inf, :func:`truncsens.stats.mean_with_inf`).
        ratios: rows ``{"metric", "budget", "numerator", "denominator", "value", "ci": [lo, hi]}``.
        fits: rows ``{"policy", "metric", "status", "reason", "alpha", "alpha_ci", "C", "C_ci", "sweep",
            "fit_points"}`` (``policy`` is ``"truncation"`` for the fit of a window results file, whose
            ``sweep`` is ``"window"``).
        notes: warnings (e.g. a ratio policy missing).
        metrics: the metrics compared; level: the interval level.
        draws: R, draws per target averaged (1: the file has no ``draw`` dim).
        spread: with R > 1, rows ``{"policy", "metric", "budget", "draw_means": [R], "sd", "min", "max"}``
            (:func:`draw_spread`); empty otherwise.
        paired: with a truncation file, rows of :func:`truncsens.fits.paired.paired_exponents` for each
            recency policy and metric, plus ``"policy"``, ``"truncation"`` (its label), ``"span_rule"``
            (:meth:`~truncsens.policies.base.Policy.recent_span_rule`), ``"sinks"`` (the policy's first
            tokens kept) and ``"truncation_sinks"`` (the truncation run's ``n_sink``); empty otherwise.
        against: with ``paired_against``, rows of :func:`truncsens.fits.paired.exponents_against` for
            every other policy and metric, plus ``"policy"`` and ``"against"``; empty otherwise.
    """

    policies: list[str]
    budgets: list[int]
    table: list[dict]
    ratios: list[dict]
    fits: list[dict]
    notes: list[str] = field(default_factory=list)
    metrics: tuple[str, ...] = ()
    level: float = 0.95
    draws: int = 1
    spread: list[dict] = field(default_factory=list)
    paired: list[dict] = field(default_factory=list)
    against: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        """A JSON-safe dict (non-finite numbers become null; ``against`` only when asked)."""
        return sanitize({"policies": self.policies, "budgets": self.budgets, "metrics": list(self.metrics), "level": self.level,
                         "table": self.table, "ratios": self.ratios, "fits": self.fits, "notes": self.notes,
                         "draws": self.draws, "spread": self.spread, "paired": self.paired}
                        | ({"against": self.against} if self.against else {}))

    def mean_curve(self, policy: str, metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean [K], lo [K], hi [K]) of one policy and metric, in budget order."""
        rows = {r["budget"]: r for r in self.table if r["policy"] == policy and r["metric"] == metric}
        mean = np.array([rows[k]["mean"] for k in self.budgets], dtype=float)
        lo = np.array([np.nan if rows[k]["ci"] is None else rows[k]["ci"][0] for k in self.budgets], dtype=float)
        hi = np.array([np.nan if rows[k]["ci"] is None else rows[k]["ci"][1] for k in self.budgets], dtype=float)
        return mean, lo, hi


def policy_curves(ds: xr.Dataset, metrics: Sequence[str], source: str = "") -> list[tuple[str, Curve]]:
    """(policy name, curve) pairs of a budget-sweep results dataset (``source``: how errors name it).

    Raises:
        ResultsError: not a budget sweep, or no policy named (no ``policy`` dim or attr).
    """
    if sweep_dim(ds) != "budget":
        raise ResultsError("compare-policies needs a policy results file (a 'budget' sweep from measure --policy); "
                           "this one sweeps windows: use truncsens fit on it, or pass it with --truncation")
    curves = curves_of(ds, list(metrics), results_file=source, label="results")  # labels as without a source
    if "policy" in ds.dims:
        return [(str(c.policy), c) for c in curves]
    name = str(ds.attrs.get("policy", "")).strip()
    if not name:
        raise ResultsError("the results file names no policy (no 'policy' dim or attr)")
    return [(name, curves[0])]


def draw_spread(ds: xr.Dataset, metrics: Sequence[str]) -> list[dict]:
    """The spread between draws of a results dataset with a ``draw`` dim.

    For each policy, metric and budget: ``draw_means`` [R], the mean over targets of each draw r
    (``mean_t D_{t,r}``, the pooled mean of :func:`compare_policies`; +inf when a target is +inf, NaN
    values left out), their sample standard deviation ``sd`` (ddof 1; NaN for R = 1; inf or NaN when a
    draw mean is infinite) and their ``min`` and ``max``. A deterministic policy has sd 0.

    Args:
        ds: results dataset, dims ([policy,] draw, target, budget).
        metrics: metric names (present in ``ds``).

    Returns:
        Rows ``{"policy", "metric", "budget", "draw_means", "sd", "min", "max"}``; empty without a ``draw`` dim.
    """
    if "draw" not in ds.dims:
        return []
    rows = []
    for name in policy_names(ds):
        sub = ds.sel(policy=name) if "policy" in ds.dims else ds
        for metric in metrics:
            values = np.asarray(sub[metric].transpose("draw", "target", "budget").values, dtype=np.float64)  # [R, n, K]
            with np.errstate(invalid="ignore"):
                per_draw = np.nanmean(values, axis=1) if values.shape[1] else np.full(values.shape[::2], np.nan)  # [R, K]
                sd = np.std(per_draw, axis=0, ddof=1) if per_draw.shape[0] > 1 else np.full(per_draw.shape[1], np.nan)
            for j, k in enumerate(ds["budget"].values):
                rows.append({"policy": name, "metric": metric, "budget": int(k), "draw_means": per_draw[:, j].tolist(),
                             "sd": float(sd[j]), "min": float(per_draw[:, j].min()), "max": float(per_draw[:, j].max())})
    return rows


def compare_policies(ds: xr.Dataset, cfg: CompareConfig = CompareConfig(), truncation: xr.Dataset | None = None,
                     source: str = "the results file") -> PolicyComparison:
    """Per-budget means with intervals, the policy ratio, and power-law fits.

    Args:
        ds: a results dataset with a ``budget`` sweep.
        cfg: the configuration.
        truncation: optionally a window results dataset; its power-law α is fitted with the same
            settings and listed under policy ``"truncation"``.
        source: how errors name ``ds`` (its path).

    Returns:
        :class:`PolicyComparison`.

    Raises:
        ResultsError: not a policy results file, an unknown metric, or a per-layer ``truncation`` file.
        ValueError: an explicit numerator, denominator or ``paired_against`` that is not a policy of the file.
        FitError: bootstrap asked with fewer than 2 documents.
    """
    in_file = policy_names(ds)
    for option, given in (("numerator (--numerator)", cfg.numerator), ("denominator (--denominator)", cfg.denominator),
                          ("paired_against (--paired-against)", cfg.paired_against)):
        if given is not None and given not in in_file:  # the defaults may be absent: that is only a note
            raise ValueError(f"{option} {given!r} is not a policy of {source} (it has {', '.join(in_file)})")
    named = policy_curves(ds, cfg.metrics, source)  # per-target means over draws
    spread = draw_spread(ds, cfg.metrics) if sweep_dim(ds) == "budget" else []
    R = int(ds.sizes.get("draw", 1))
    policies = [n for n, _ in named]
    budgets = [int(k) for k in named[0][1].points]
    G = named[0][1].n_docs
    if cfg.n_boot > 0 and G < 2:
        raise FitError(f"bootstrap over documents needs at least 2 documents, the file has {G}; pass bootstrap=0 (--bootstrap 0)")
    mult = resample_weights(G, cfg.n_boot, cfg.seed)  # [1+B, G]
    means: dict[tuple[str, str], np.ndarray] = {}
    table, ratios, fits, notes = [], [], [], []
    for name, curve in named:
        for metric in cfg.metrics:
            m, _ = resampled_mean_se(mult, curve.sums[metric], curve.counts[metric])  # [1+B, K]
            pos, neg = curve.inf_counts(metric)
            m = mean_with_inf(m, pos, neg)  # a budget with a +inf target has mean inf, never the finite mean alone
            means[(name, metric)] = m
            for j, k in enumerate(budgets):
                table.append({"policy": name, "metric": metric, "budget": k, "mean": float(m[0, j]),
                              "ci": interval_or_none(m[1:, j], cfg.level), "n_docs": G, "n_inf": int(pos[j] + neg[j])})
    num, den = cfg.ratio
    if num in policies and den in policies:
        for metric in cfg.metrics:
            with np.errstate(divide="ignore", invalid="ignore"):
                r = means[(num, metric)] / means[(den, metric)]  # [1+B, K]
            for j, k in enumerate(budgets):
                ratios.append({"metric": metric, "budget": k, "numerator": num, "denominator": den,
                               "value": float(r[0, j]), "ci": interval_or_none(r[1:, j], cfg.level)})
    else:
        missing = [p for p in (num, den) if p not in policies]
        notes.append(f"ratio {num}/{den} skipped: the file has no policy {', '.join(missing)} (it has {', '.join(policies)})")
    fit_cfg = FitConfig(metrics=tuple(cfg.metrics), families=("power",), fit_range=cfg.fit_range, n_boot=cfg.n_boot,
                        seed=cfg.seed, level=cfg.level)
    extra, paired = [], []
    if truncation is not None:
        if is_per_layer(truncation):
            raise ResultsError("the --truncation file is a per-layer sweep (measure --per-layer): its curves window one "
                               "layer at a time, no yardstick for a policy that evicts in every layer; pass a window sweep")
        check_same_weights(ds, truncation, "the policy run", "the truncation run")
        notes += truncation_mismatch(ds, truncation)
        extra = [(f"truncation{'' if c.policy is None else '[' + c.policy + ']'}", c) for c in curves_of(truncation, list(cfg.metrics))]
    for name, curve in list(named) + extra:
        fits.extend(power_fit_rows(name, curve, fit_cfg))
    if truncation is not None:
        paired, span_notes = span_exponents(ds, named, extra, fit_cfg, truncation)
        notes += span_notes
    ref = dict(named).get(cfg.paired_against)
    against = [{"policy": n, "against": cfg.paired_against, **row} for n, c in named if ref is not None and c is not ref
               for row in exponents_against(c, ref, fit_cfg)]
    if R > 1:
        notes.append(f"every target's value is its mean over {R} draws of the randomized policies (deterministic "
                     "policies: the same value in every draw); the spread between draws is listed below")
    return PolicyComparison(policies, budgets, table, ratios, fits, notes, tuple(cfg.metrics), cfg.level, R, spread, paired,
                            against)


# what makes two runs' targets the same, so that their exponents are paired: the target coords, and the documents
# (corpus, its hash and split) and reference context they were drawn from
PAIRED_TARGETS = ("doc", "position", "token_id")
PAIRED_SOURCE = ("corpus", "corpus_sha256", "split", "reference_context")


def pairing_gap(ds: xr.Dataset, truncation: xr.Dataset) -> str | None:
    """Why a policy run and a truncation run are not paired (their targets are not the same documents and
    positions of the same corpus and N), in words, or None when they are."""
    differ = attr_differences(ds, truncation, PAIRED_SOURCE)
    if differ:
        key, a, b = differ[0]
        return f"the truncation run has {key} {b}, the policy run {a}"
    coord = target_difference(ds, truncation, PAIRED_TARGETS)
    if coord is not None:
        n, m = truncation.sizes["target"], ds.sizes["target"]
        return f"other targets: {coord} differs" + (f", {n} against {m}" if n != m else "")
    return None


def recency_policy(ds: xr.Dataset, name: str) -> Policy | None:
    """The policy ``name`` of a budget sweep rebuilt from its ``policy_params`` attr (a file without it:
    the defaults, sinks from ``n_sink``), when it keeps a recent span
    (:meth:`~truncsens.policies.base.Policy.recent_span`); None otherwise, or when it cannot be built
    (e.g. a kvpress press without kvpress installed)."""
    given = ds.attrs.get("policy_params") or {}
    try:
        given = json.loads(given) if isinstance(given, str) else dict(given)
    except ValueError:
        given = {}
    params = given.get(name) or {"n_sink": int(ds.attrs.get("n_sink", 0) or 0)}
    try:
        policy = make_policy(name, **params)
    except (PolicyError, TypeError, ValueError):
        return None
    return policy if policy.recent_kept_first() is not None else None


def span_exponents(ds: xr.Dataset, named: list[tuple[str, Curve]], truncation_curves: list[tuple[str, Curve]],
                   cfg: FitConfig, truncation: xr.Dataset) -> tuple[list[dict], list[str]]:
    """Rows of :attr:`PolicyComparison.paired` and their notes: each recency policy of ``named`` fitted against
    its recent span beside each truncation curve (:func:`truncsens.fits.paired.paired_exponents`), paired when
    :func:`pairing_gap` finds nothing."""
    gap = pairing_gap(ds, truncation)
    t_sinks = int(truncation.attrs.get("n_sink", 0) or 0)
    rows, notes, unmatched, without = [], [], [], []
    for name, curve in named:
        policy = recency_policy(ds, name)
        if policy is None:
            without.append(name)
            continue
        first = int(policy.recent_kept_first())
        extra = {"policy": name, "span_rule": policy.recent_span_rule(), "sinks": first, "truncation_sinks": t_sinks}
        if first != t_sinks:
            unmatched.append((name, first))
        try:
            span = span_curve(curve, first)
        except FitError as exc:
            rows += [{**extra, "truncation": t, **skipped_row(m, str(exc), gap is None, None)}
                     for t, _ in truncation_curves for m in cfg.metrics]
            continue
        for t_name, t_curve in truncation_curves:
            rows += [{**extra, "truncation": t_name, **row} for row in paired_exponents(span, t_curve, cfg, gap is None)]
    if rows and gap is not None:
        notes.append(f"the exponent differences are not paired ({gap}): no interval and no verdict; measure both on "
                     "the same targets (the same --domain, --reference-context, --max-docs, --targets-per-doc, --seed)")
    for name, first in unmatched:
        notes.append(f"{name} keeps {first} first tokens, the truncation run {t_sinks} in front of its windows: the matched "
                     f"comparison is a truncation run with measure --sinks {first}")
    if rows and without:
        notes.append(f"{', '.join(without)}: no exponent against a recent span (the policy keeps no recent window)")
    return rows, notes


def truncation_mismatch(ds: xr.Dataset, truncation: xr.Dataset) -> list[str]:
    """Notes on how a ``--truncation`` window run differs from the policy run it is set beside: an attr
    of :data:`~truncsens.results.join.SAME_SOURCE` (model and revision, tokenizer, dtype, N, corpus,
    split, seed, ...), or other targets (doc, position). Empty when they agree; the comparison still
    runs (a note, not an error: a truncation α from another run is a legitimate, if looser, yardstick),
    except for other weights, which the caller refuses first (:func:`~truncsens.results.join.check_same_weights`)."""
    notes = [f"the truncation run has {key} {b}, the policy run {a}"
             for key, a, b in attr_differences(ds, truncation, SAME_SOURCE)]
    if target_difference(ds, truncation, ("doc", "position")) is not None:
        n, m = truncation.sizes["target"], ds.sizes["target"]
        which = f"{n} against {m}" if n != m else f"other positions, {n} each"
        notes.append(f"the truncation run measured other targets ({which}): its alpha is not paired with the policies'")
    return notes


def default_plot_stem(results_file: str | Path) -> Path:
    """Where ``compare-policies`` draws by default: ``<results stem>-policies`` next to the results file."""
    path = Path(results_file)
    return path.with_name(path.stem + "-policies")


def compare_policies_file(results_file: str | Path | Sequence[str | Path], cfg: CompareConfig = CompareConfig(),
                          truncation_file: str | Path | None = None) -> PolicyComparison:
    """:func:`compare_policies` of a results file, or of several runs of other policies on the same
    targets (joined along ``policy`` by :func:`truncsens.results.join.join_policy_runs`), optionally
    beside a truncation results file.

    Raises:
        FileNotFoundError, ResultsError: a path is missing or not a results file, or the runs are not
            of the same targets and settings; see :func:`compare_policies`.
    """
    from truncsens.results.join import join_policy_runs

    files = [results_file] if isinstance(results_file, (str, Path)) else list(results_file)
    ds = join_policy_runs([load(f) for f in files], [str(f) for f in files])
    trunc = load(truncation_file) if truncation_file else None
    return compare_policies(ds, cfg, trunc, source=", ".join(str(f) for f in files))
