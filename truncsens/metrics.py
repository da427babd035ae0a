"""One record per metric: what each value of a results file means, in one place.

A metric compares, at one target, the next-token distribution with the full reference context
(``p_ref``) and with the kept context (``p_kept``). :data:`METRICS` lists them in the order of a
results file (``tv, kl, kl_reverse, js, top1_agree, nll_ref, nll_kept``); the results schema, the
engine's storage, the fits and the reports read their facts here. Definitions: :mod:`truncsens.divergences` (Cover & Thomas, *Elements of
Information Theory*, 2nd ed., eqs. 2.26 and 11.137); log base e, so KL, JS and NLL are in nats.

Storage: float32 (``top1_agree`` int8), computed in float64 first (docs/precision.md).

Noise floors: the largest divergence measured between two float32 forward passes that are equal
in exact arithmetic (docs/precision.md, "Noise floor of the forward pass itself": CPU, random
Llama weights up to h=512, 4 layers, T=512; its record reproduce/results/noise-floor.txt),
rounded up with room for other CPUs: TV 1.3e-7 -> 1.5e-7, KL 5.9e-14 -> 1e-13 (also for reverse KL),
JS 1.4e-14 -> 2e-14. A mean at or below it is indistinguishable from
0 (:mod:`truncsens.fits.points`). The NLLs and top-1 agreement have none.

The records read three facts from :mod:`truncsens.divergences`, where the math lives: the names
and their order (:data:`truncsens.divergences.METRICS`, the keys of
:func:`~truncsens.divergences.all_metrics`), each range (:data:`truncsens.divergences.RANGES`) and
the function computing it. This module imports nothing else, and that only when a record is first
read: the records (:data:`METRICS`, :data:`NAMES`, :data:`DIVERGENCES`) are built on first access
(PEP 562), so reading :data:`DEFAULT_METRICS` (the command line's ``--help``) does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

LOWER_IS_BETTER = "lower_is_better"
HIGHER_IS_BETTER = "higher_is_better"
DIRECTIONS = (LOWER_IS_BETTER, HIGHER_IS_BETTER)


@dataclass(frozen=True)
class Metric:
    """The facts of one metric.

    Attributes:
        name: the data var of a results file.
        description: what it measures, in words.
        unit: "nats", "probability", or "" (an indicator).
        dtype: numpy dtype it is stored with in results files.
        lower, upper: the range of a value (``math.inf``: unbounded above), that of
            :data:`truncsens.divergences.RANGES`; values a hair outside from rounding are clamped
            by :func:`truncsens.divergences.all_metrics`.
        direction: :data:`LOWER_IS_BETTER` or :data:`HIGHER_IS_BETTER` (closer to the full context).
        divergence: a divergence D(p_ref, p_kept) between the two distributions, fitted as D(w) by
            ``truncsens fit`` by default.
        noise_floor: the float32 noise floor (module docstring), or None.
        function: the :mod:`truncsens.divergences` function computing it, called as ``computed_by`` says.
        computed_by: the call, e.g. ``kl(p_kept, p_ref)`` for ``kl_reverse``, ``nll(p_ref, y)``.

    Raises:
        ValueError: an unknown direction, or ``lower > upper``.
    """

    name: str
    description: str
    unit: str
    dtype: np.dtype
    lower: float
    upper: float
    direction: str
    divergence: bool
    noise_floor: float | None
    function: Callable
    computed_by: str

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"metric {self.name!r}: direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if not self.lower <= self.upper:
            raise ValueError(f"metric {self.name!r}: lower bound {self.lower} above upper bound {self.upper}")

    @property
    def higher_is_better(self) -> bool:
        """Whether larger values mean closer to the full context (``top1_agree``)."""
        return self.direction == HIGHER_IS_BETTER

    @property
    def best(self) -> float:
        """The best value it can take: ``upper`` if higher is better, else ``lower`` (0 for a divergence,
        1 for ``top1_agree``)."""
        return self.upper if self.higher_is_better else self.lower

    @property
    def bounded_above(self) -> bool:
        """Whether ``upper`` is finite."""
        return math.isfinite(self.upper)


def _records() -> tuple[Metric, ...]:
    """Every record, in results-file order; imports :mod:`truncsens.divergences` (and so torch)."""
    from truncsens import divergences as dv

    def _record(name: str, description: str, unit: str, dtype: type, direction: str, divergence: bool,
                noise_floor: float | None, function: Callable, computed_by: str) -> Metric:
        """A :class:`Metric` whose range is that of :data:`truncsens.divergences.RANGES`."""
        lower, upper = dv.RANGES[name]
        return Metric(name, description, unit, np.dtype(dtype), lower, upper, direction, divergence, noise_floor,
                      function, computed_by)

    return (
        _record("tv", "total variation distance 1/2 sum_x |p_ref(x) - p_kept(x)|", "probability", np.float32,
                LOWER_IS_BETTER, True, 1.5e-7, dv.tv, "tv(p_ref, p_kept)"),
        _record("kl", "KL(p_ref || p_kept) = sum_x p_ref(x) (log p_ref(x) - log p_kept(x)); +inf where p_kept = 0 < p_ref",
                "nats", np.float32, LOWER_IS_BETTER, True, 1e-13, dv.kl, "kl(p_ref, p_kept)"),
        _record("kl_reverse", "KL(p_kept || p_ref); +inf where p_ref = 0 < p_kept",
                "nats", np.float32, LOWER_IS_BETTER, True, 1e-13, dv.kl, "kl(p_kept, p_ref)"),
        _record("js", "Jensen-Shannon divergence 1/2 KL(p_ref || m) + 1/2 KL(p_kept || m), m = (p_ref + p_kept) / 2",
                "nats", np.float32, LOWER_IS_BETTER, True, 2e-14, dv.js, "js(p_ref, p_kept)"),
        _record("top1_agree", "1 where the most likely next token is the same under p_ref and p_kept, else 0",
                "", np.int8, HIGHER_IS_BETTER, False, None, dv.top1_agree, "top1_agree(p_ref, p_kept)"),
        _record("nll_ref", "-log p_ref(y): negative log-likelihood of the observed next token y with the full context",
                "nats", np.float32, LOWER_IS_BETTER, False, None, dv.nll, "nll(p_ref, y)"),
        _record("nll_kept", "-log p_kept(y): negative log-likelihood of the observed next token y with the kept context",
                "nats", np.float32, LOWER_IS_BETTER, False, None, dv.nll, "nll(p_kept, y)"),
    )


# what a policy comparison, its figure and measure's table show when no metric is named (the figure draws
# the first); a fit fits every divergence (DIVERGENCES)
DEFAULT_METRICS: tuple[str, ...] = ("kl", "tv")

if TYPE_CHECKING:
    METRICS: tuple[Metric, ...]
    NAMES: tuple[str, ...]
    DIVERGENCES: tuple[str, ...]  # fitted as D(w) by default
    _BY_NAME: dict[str, Metric]
_BUILT_ON_FIRST_USE = ("METRICS", "NAMES", "DIVERGENCES", "_BY_NAME")


def _built() -> None:
    """Define :data:`METRICS` and the names derived from it, once (a value set since, e.g. by a test's
    monkeypatch, stays)."""
    g = globals()
    if "METRICS" in g:
        return
    metrics = _records()
    g.update(METRICS=metrics, NAMES=tuple(m.name for m in metrics),
             DIVERGENCES=tuple(m.name for m in metrics if m.divergence), _BY_NAME={m.name: m for m in metrics})


def __getattr__(name: str) -> Any:  # PEP 562: the records on first use
    if name in _BUILT_ON_FIRST_USE:
        _built()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def find(name: str) -> Metric | None:
    """The record of ``name``, or None for a name that is no metric (e.g. ``kept_tokens``)."""
    _built()
    return _BY_NAME.get(name)


def metric(name: str) -> Metric:
    """The record of ``name``.

    Raises:
        KeyError: ``name`` is not a metric of :data:`METRICS`.
    """
    _built()
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; the metrics are {', '.join(NAMES)}") from None


def bounded_divergences() -> dict[str, float]:
    """Divergence -> its finite upper bound, for the divergences of :data:`METRICS` bounded above
    (``{"tv": 1.0, "js": log 2}``): a distortion target above it can never be crossed. Read at call time,
    so a record added to :data:`METRICS` counts without a second list."""
    _built()
    return {m.name: m.upper for m in METRICS if m.divergence and m.bounded_above}


def present(names: Iterable[str]) -> tuple[str, ...]:
    """The metrics among ``names`` (e.g. a dataset's ``data_vars``), in the order of :data:`METRICS`."""
    _built()
    have = set(names)
    return tuple(n for n in NAMES if n in have)


def divergences_in(names: Iterable[str]) -> tuple[str, ...]:
    """The divergences (:data:`DIVERGENCES`) among ``names``, in the order of :data:`METRICS`: what a fit
    of a results file holding ``names`` fits by default."""
    _built()
    have = set(names)
    return tuple(n for n in DIVERGENCES if n in have)
