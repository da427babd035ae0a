"""What a run sweeps, resolved once the reference context N is known.

A window sweep is a policy sweep in disguise: window w with S sinks is ``sink_recent`` (``suffix``
when S = 0) at budget k = S + w under ``reencode`` (the kept tokens x[t-N : t-N+S] and x[t-w : t];
arXiv 2605.25085). The results keep the window as the sweep coordinate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.semantics import Semantics, semantics_for
from truncsens.policies import Policy, PolicyError, make_policy


@dataclass
class Sweep:
    """A resolved sweep.

    Attributes:
        dim: "window" or "budget", the results' sweep dimension.
        values: the sweep coordinate (windows or budgets), sorted, unique.
        budgets: kept keys per target query for each value (for windows: sinks + window).
        policies: the policies run (one for a window sweep).
        semantics: the semantics object.
    """

    dim: str
    values: list[int]
    budgets: list[int]
    policies: list[Policy]
    semantics: Semantics

    @property
    def is_window_sweep(self) -> bool:
        return self.dim == "window"


def default_windows(reference_context: int) -> list[int]:
    """Powers of two from 1 up to reference_context / 2."""
    return [2**i for i in range(int(math.log2(max(1, reference_context // 2))) + 1)]


def default_budgets(reference_context: int, smallest: int) -> list[int]:
    """Powers of two from max(16, smallest) up to N/2 (or the smallest power of two that fits, up to N)."""
    lo = max(16, smallest)
    out = [2**i for i in range(4, 31) if lo <= 2**i <= reference_context // 2]
    return out or [2**i for i in range(0, 31) if smallest <= 2**i <= reference_context][:1]


def check_windows(windows: list[int], reference_context: int, n_sink: int) -> list[int]:
    """Sorted unique windows, each w < N with w + sinks <= N (w >= 1 is checked earlier, by
    :class:`~truncsens.engine.config.MeasureConfig`, before any output or model is looked at).

    Raises:
        MeasureError: empty list or a window at or beyond the reference context.
    """
    if not windows:
        raise MeasureError("no windows given")
    for w in windows:
        if w >= reference_context:
            raise MeasureError(
                f"window {w} >= reference context {reference_context}: the kept context would be the whole reference "
                "context; use windows below it")
        if n_sink + w > reference_context:
            raise MeasureError(
                f"window {w} + {n_sink} sinks exceeds the reference context of {reference_context} tokens; "
                "use windows below the reference context (minus sinks)")
    return sorted(set(int(w) for w in windows))


def check_budgets(budgets: list[int], policies: list[Policy], reference_context: int) -> list[int]:
    """Sorted unique budgets that every policy accepts for a context of N tokens.

    Raises:
        PolicyError: empty list, a budget above N, or below a policy's minimum.
    """
    if not budgets:
        raise PolicyError("no budgets given")
    for k in budgets:
        for p in policies:
            p.check(int(k), reference_context)
    return sorted(set(int(k) for k in budgets))


def resolve_sweep(cfg: MeasureConfig, reference_context: int) -> Sweep:
    """The sweep of ``cfg`` for a reference context of N tokens.

    Raises:
        MeasureError: a bad window; PolicyError: a bad budget.
    """
    N = reference_context
    semantics = semantics_for(cfg.semantics)
    if cfg.policies is None:
        windows = check_windows(cfg.windows or default_windows(N), N, cfg.n_sink)
        policy = make_policy("sink_recent", n_sink=cfg.n_sink) if cfg.n_sink else make_policy("suffix")
        return Sweep("window", windows, [cfg.n_sink + w for w in windows], [policy], semantics)
    policies = cfg.build_policies()
    budgets = check_budgets(cfg.budgets or default_budgets(N, max(p.min_budget() for p in policies)), policies, N)
    return Sweep("budget", budgets, budgets, policies, semantics)


def check_sweep_before_loading(cfg: MeasureConfig) -> None:
    """The windows and budgets of ``cfg`` checked before a model loads: against N when
    ``--reference-context`` gives it (a window or budget at or above N, a bad sink count,
    :func:`resolve_sweep`), and below 1 token in any case (N then comes from the model).

    Raises:
        MeasureError: a bad window or reference context; PolicyError: a bad budget.
    """
    if cfg.reference_context:
        if cfg.reference_context < 2:
            raise MeasureError(f"reference_context (--reference-context) must be at least 2 tokens, got {cfg.reference_context}")
        resolve_sweep(cfg, cfg.reference_context)
        return
    bad = [b for b in cfg.budgets or [] if b < 1]
    if bad:
        raise PolicyError(f"budgets (--budgets) must be at least 1 token each, got {', '.join(map(str, bad))}")
