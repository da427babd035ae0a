"""The fit file (JSON): building it from a fit, reading (also schema 1), writing, default paths,
telling a fit file from a results file, and matching a fit file to results files.

Fit file, ``schema`` 2 (``x`` = a sweep point in tokens: a window w or a retention budget k, as
the curve's ``sweep`` says; every interval ``ci`` is a percentile bootstrap interval of level
``settings.ci_level``)::

    {
      "kind": "truncsens-fit", "schema": 2, "truncsens_version": str, "created": ISO 8601 UTC,
      "settings": {"metrics": [...], "families": [...], "bootstrap": int, "seed": int,
                   "ci_level": float, "fit_range": [lo, hi] | null, "holdout_range": [lo, hi] | null},
      "curves": [ {"index": i, "results_file": str, "label": str, "policy": str | null,
                   "sweep": "window" | "budget", "provenance": {every results attr},
                   "n_docs": int, "n_targets": int, "reference_context": int,
                   "fit_range": [lo, hi], "holdout_range": [lo, hi] | null, "notes": [str],
                   "metrics": {metric: {"points": [x...], "mean": [...], "se": [...],
                                        "excluded_points": [x...],
                                        "excluded": {"infinite", "no_values", "zero", "noise_floor": [x...],
                                                     "exact_zero_at": x | null, "noise_floor_value": float},
                                        "n_inf": [...], "n_nan": [...],
                                        "bootstrap_mean": [[...] per resample]   (n_boot > 0)}}} ],
      "fits": [ {"curve": i, "results_file", "label", "policy", "metric", "family",
                 "status": "ok" | "skipped" | "not_converged", "reason": str | null,
                 "converged": bool | null, "optimizer": str | null,
                 "params": {name: {"value": float, "ci": [lo, hi] | null}},
                 "fit_range": [lo, hi], "fit_points": [...], "holdout_range": [lo, hi] | null,
                 "holdout_points": [...], "excluded_points": [...],
                 "n_docs", "n_targets", "n_boot", "n_boot_failed",
                 "aic": float | null, "wrss": float | null,
                 "extrapolation_mae": {"value", "ci"} | null,
                 "provenance": {every results attr},
                 "bootstrap_samples": {"C": [...], "alpha": [...]}   (power family, n_boot > 0)} ],
      "comparisons": [ {"curve": i, "results_file", "label", "metric",
                        "basis": "extrapolation" | "aic" | null, "winner", "runner_up",
                        "factor": {"value", "ci"}, "power_vs_exponential": {"value", "ci", "undecided"} | null,
                        "undecided": bool | null   (the factor's interval contains 1),
                        "mae": {family: value}, "aic": {family: value}} ],
      "alpha_ratio_kl_tv": [ {"curve": i, "results_file", "label", "value", "ci"} ]
    }

Parameters: power {C, alpha}; exponential {C, tau, rate = 1/tau}; power_floor {C, alpha, D_inf};
C and D_inf in the metric's unit (:attr:`truncsens.metrics.Metric.unit`; TV: probability; KL, JS: nats). Non-finite numbers are written
as null (a mean of +inf is null with ``n_inf`` > 0 at that point). The keys ``excluded``,
``n_inf``, ``n_nan``, ``bootstrap_mean``, ``converged``, ``optimizer`` and ``undecided`` are absent
from older schema 2 files; readers treat an "ok" fit without ``converged`` as converged. Points
excluded from the fits: :mod:`truncsens.fits.points`; a "not_converged" fit is kept for
inspection but never compared or used for a recommendation. Schema 1 files (keys ``ci95``, ``window``, ``fit_windows``, ``holdout_windows``,
``excluded_windows``) are read and upgraded to schema 2 by :func:`read_fit_file`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import truncsens
from truncsens.fits.fit_checks import check_fit_doc
from truncsens.fits.laws import FitError
from truncsens.results.paths import check_creatable, write_atomic
from truncsens.results.schema import utc_now

FIT_KIND = "truncsens-fit"
SCHEMA = 2
_V1_KEYS = {"ci95": "ci", "window": "points", "fit_windows": "fit_points", "holdout_windows": "holdout_points",
            "excluded_windows": "excluded_points"}


def sanitize(obj: object) -> object:
    """A JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to None, tuples to lists."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [sanitize(v) for v in obj.tolist()]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def check_new_files(paths: Sequence[str | Path | None], overwrite: bool) -> None:
    """Refuse to replace files that exist unless ``overwrite`` (called before computing anything).

    Raises:
        IsADirectoryError: a path is a folder (``--overwrite`` would not help: give a file path).
        NotADirectoryError: a folder on the path is a file, so the output cannot be created.
        PermissionError: the folder the output would be created in is not writable.
        FileExistsError: one message naming every existing file and the ``--overwrite`` option.
    """
    for p in paths:
        if p is None:
            continue
        if Path(p).is_dir():
            raise IsADirectoryError(f"{p} is a folder; give a file path inside it")
        check_creatable(Path(p))
    if overwrite:
        return
    there = [str(p) for p in paths if p is not None and Path(p).exists()]
    if there:
        one = len(there) == 1
        raise FileExistsError(f"{', '.join(there)} already exist{'s' if one else ''}: pass --overwrite to replace "
                              f"{'it' if one else 'them'}, or choose another --out")


def write_json(doc: dict, path: str | Path) -> Path:
    """Write a JSON-safe dict (``indent=1``) atomically (:func:`truncsens.results.paths.write_atomic`:
    free space checked, temporary file, then rename); create parent folders.

    Raises:
        NoSpaceError: the disk is full (nothing is written); OSError: the path cannot be written.
    """
    return write_atomic(path, json.dumps(doc, indent=1, allow_nan=False).encode())


def fit_document(report: Any) -> dict:
    """The fit file dict of a :class:`truncsens.fits.fitting.FitReport` (schema in the module docstring).

    ``report`` is typed loosely because :mod:`truncsens.fits.fitting` imports this module (no import cycle).
    """
    curves, fits, comps, ratios = [], [], [], []
    for i, cf in enumerate(report.results):
        c = cf.curve
        curves.append({"index": i, "results_file": c.results_file, "label": c.label, "policy": c.policy,
                       "sweep": c.sweep, "provenance": c.attrs, "n_docs": c.n_docs, "n_targets": c.n_targets,
                       "reference_context": c.reference_context, "fit_range": list(cf.fit_range),
                       "holdout_range": list(cf.holdout_range) if cf.holdout_range else None,
                       "metrics": cf.metrics, "notes": cf.notes})
        fits.extend({**f, "curve": i, "provenance": c.attrs} for f in cf.fits)
        comps.extend({**cmp_, "curve": i} for cmp_ in cf.comparisons)
        if cf.alpha_ratio is not None:
            ratios.append({**cf.alpha_ratio, "curve": i})
    cfg = report.config
    doc = {
        "kind": FIT_KIND, "schema": SCHEMA, "truncsens_version": truncsens.__version__, "created": report.created or utc_now(),
        "settings": {"metrics": list(cfg.metrics), "families": list(cfg.families), "bootstrap": cfg.n_boot,
                     "seed": cfg.seed, "ci_level": cfg.level,
                     "fit_range": list(cfg.fit_range) if cfg.fit_range else None,
                     "holdout_range": list(cfg.holdout_range) if cfg.holdout_range else None},
        "curves": curves, "fits": fits, "comparisons": comps, "alpha_ratio_kl_tv": ratios,
    }
    return sanitize(doc)


def _rename_v1(obj: object, in_provenance: bool = False) -> object:
    if isinstance(obj, list):
        return [_rename_v1(v) for v in obj]
    if not isinstance(obj, dict) or in_provenance:
        return obj
    return {_V1_KEYS.get(k, k): _rename_v1(v, k == "provenance") for k, v in obj.items()}


def upgrade_fit_doc(doc: dict) -> dict:
    """A fit file dict in schema 2: schema 1 keys renamed (``ci95`` -> ``ci``, ``window`` -> ``points``,
    ``*_windows`` -> ``*_points``), provenance left as is; a schema 2 dict is returned unchanged."""
    if doc.get("schema", 1) >= SCHEMA:
        return doc
    return {**_rename_v1(doc), "schema": SCHEMA}


def write_fit_file(report: Any, path: str | Path) -> Path:
    """Write the fit JSON (a dict, or a :class:`truncsens.fits.fitting.FitReport`) atomically and return its path."""
    return write_json(report if isinstance(report, dict) else report.to_json(), path)


def read_fit_file(path: str | Path) -> dict:
    """Read a fit JSON written by :func:`write_fit_file` (schema 1 is upgraded, :func:`upgrade_fit_doc`).

    Raises:
        FileNotFoundError: no such file.
        FitError: not JSON, not a truncsens fit file, or contents that break a rule of
            :mod:`truncsens.fits.fit_checks` (the message names the entry, rule and first bad value).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"fit file not found: {path}")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FitError(f"{path} is not a truncsens fit file (not JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != FIT_KIND:
        raise FitError(f"{path} is not a truncsens fit file (no \"kind\": \"{FIT_KIND}\")")
    doc = upgrade_fit_doc(doc)
    try:
        check_fit_doc(doc)
    except FitError as exc:
        raise FitError(f"{path}: {exc}") from None
    return doc


def is_fit_file(path: str | Path) -> bool:
    """Whether ``path`` looks like a JSON document (a fit file) rather than a results file (NetCDF/HDF5).

    Raises:
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    with open(path, "rb") as fh:
        head = fh.read(8)
    return head.lstrip()[:1] == b"{"


def default_fit_path(paths: Sequence[str | Path]) -> Path:
    """Where ``fit`` writes by default: next to the first results file, ``<stem>.fit.json``
    (``<stem>+<k>more.fit.json`` for several files)."""
    first = Path(paths[0])
    extra = f"+{len(paths) - 1}more" if len(paths) > 1 else ""
    return first.with_name(f"{first.stem}{extra}.fit.json")


def plot_prefix(fit_path: str | Path) -> Path:
    """Prefix of the figures drawn beside a fit file: ``x.fit.json`` -> ``x.fit`` (then ``.png``, ``.pdf``)."""
    path = Path(fit_path)
    return path.with_name(path.name[: -len(".json")] if path.name.endswith(".json") else path.name)


_IDENTITY_KEYS = ("model", "created", "corpus_sha256", "command", "seed", "domain", "reference_context", "n_sink", "positions")


def same_curve(a: dict, b: dict) -> bool:
    """Whether two fit-file curves come from the same measurement: same provenance identity
    (:data:`_IDENTITY_KEYS`), policy, and measured means (relative tolerance 1e-9)."""
    ident = [tuple(str(c["provenance"].get(k, "")) for k in _IDENTITY_KEYS) for c in (a, b)]
    if ident[0] != ident[1] or a.get("policy") != b.get("policy"):
        return False
    for m, v in a["metrics"].items():
        if m in b["metrics"]:
            x = np.array([np.nan if t is None else t for t in v["mean"]], dtype=float)
            y = np.array([np.nan if t is None else t for t in b["metrics"][m]["mean"]], dtype=float)
            if x.shape != y.shape or not np.allclose(x, y, rtol=1e-9, atol=0, equal_nan=True):
                return False
    return True


def use_fits_from(doc: dict, fitted: dict, fit_path: str | Path) -> dict:
    """``doc`` (a fit of results files) with its laws and fit ranges replaced by those of ``fitted``,
    a fit file made from the same results files (:func:`same_curve`).

    Raises:
        ValueError: a curve of ``doc`` has no match in ``fitted``.
    """
    fits, curves = [], []
    for c in doc["curves"]:
        match = next((f for f in fitted["curves"] if same_curve(c, f)), None)
        if match is None:
            raise ValueError(f"{fit_path} was not made from {c['results_file']} (provenance or curve differs); "
                             "refit it or drop --fit")
        fits.extend({**f, "curve": c["index"]} for f in fitted["fits"] if f["curve"] == match["index"])
        curves.append({**c, "fit_range": match["fit_range"]})
    return {**doc, "curves": curves, "fits": fits}
