"""Checks of a fit file's contents (docs/results.md, "What a file must hold"), run by
:func:`truncsens.fits.fit_file.read_fit_file` on every fit file read (``recommend-window``, ``plot
--fit``, ``fit --use-fits``), so an edited or damaged file is refused with one line naming the
entry, the rule and the first offending value instead of being used.

Rules: ``curves`` and ``fits`` are lists; a curve's ``reference_context`` is a whole number >= 1;
its points are whole numbers of tokens in [1, reference_context]; its means lie in the metric's
range (:mod:`truncsens.metrics`, within :data:`truncsens.results.checks.TOLERANCE`) or are null; a
fit names a known metric, a known family (:data:`truncsens.fits.laws.FAMILIES`) and a known status;
every parameter value is a finite number or null; a fitted (status ``ok``) power law has C > 0.
"""

from __future__ import annotations

import math
import numbers

from truncsens import metrics as _metrics
from truncsens.fits.laws import FAMILIES, FitError

STATUSES = ("ok", "skipped", "not_converged")
TOLERANCE = 1e-6


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _whole(v, least: int) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= least


def check_curve(i: int, curve) -> None:
    """Rules of one entry of ``curves``. Raises :class:`FitError`."""
    where = f"curves[{i}]"
    if not isinstance(curve, dict):
        raise FitError(f"fit file: {where}: rule curves: it must be an object, got {curve!r}")
    n = curve.get("reference_context")
    if n is not None and not _whole(n, 1):
        raise FitError(f"fit file: {where}: rule curves: reference_context must be a whole number >= 1, got {n!r}")
    for name, entry in (curve.get("metrics") or {}).items():
        record = _metrics.find(name)
        if record is None:
            raise FitError(f"fit file: {where}: rule curves: unknown metric {name!r}")
        for x in entry.get("points", []):
            if not _whole(x, 1) or (n is not None and x > n):
                raise FitError(f"fit file: {where} ({name}): rule points: points must be whole numbers of tokens in "
                               f"[1, {n if n is not None else 'N'}], first bad value {x!r}")
        for v in entry.get("mean", []):
            if v is not None and (not _number(v) or math.isnan(v) or not
                                  record.lower - TOLERANCE <= v <= record.upper + TOLERANCE):
                raise FitError(f"fit file: {where} ({name}): rule range: means must lie in [{record.lower:g}, "
                               f"{record.upper:g}], first bad value {v!r}")


def check_fit(i: int, fit) -> None:
    """Rules of one entry of ``fits``. Raises :class:`FitError`."""
    where = f"fits[{i}]"
    if not isinstance(fit, dict):
        raise FitError(f"fit file: {where}: rule fits: it must be an object, got {fit!r}")
    for key, known in (("metric", _metrics.NAMES), ("family", FAMILIES), ("status", STATUSES)):
        if fit.get(key) not in known:
            raise FitError(f"fit file: {where}: rule fits: {key} must be one of {known}, got {fit.get(key)!r}")
    for name, param in (fit.get("params") or {}).items():
        value = param.get("value") if isinstance(param, dict) else param
        ci = param.get("ci") if isinstance(param, dict) else None
        for v in [value] + list(ci or []):
            if v is not None and (not _number(v) or not math.isfinite(v)):
                raise FitError(f"fit file: {where} ({fit['family']}, {fit['metric']}): rule params: {name} must be a "
                               f"finite number or null, got {v!r}")
    if fit["status"] == "ok" and fit["family"] == "power":
        c = (fit.get("params") or {}).get("C", {})
        c = c.get("value") if isinstance(c, dict) else c
        if c is None or c <= 0:
            raise FitError(f"fit file: {where} (power, {fit['metric']}): rule params: C must be > 0, got {c!r}")


def check_fit_doc(doc: dict) -> None:
    """Every rule of the module docstring, curves first.

    Raises:
        FitError: the first rule broken.
    """
    for key in ("curves", "fits"):
        if not isinstance(doc.get(key, []), list):
            raise FitError(f"fit file: rule {key}: {key!r} must be a list, got {type(doc.get(key)).__name__}")
    for i, curve in enumerate(doc.get("curves", [])):
        check_curve(i, curve)
    for i, fit in enumerate(doc.get("fits", [])):
        check_fit(i, fit)
