"""Checks of a results dataset's values against the metric records (:mod:`truncsens.metrics`): what
:func:`truncsens.results.schema.validate` runs on every dataset it is given (every save and every
load), so every command that reads a results file (``show``, ``fit``, ``plot``,
``compare-policies``, ``recommend-window``, the notebooks) refuses an impossible one with one line
naming the variable, the rule and the first offending value, and none is ever written.

Rules:

- ``dims``: every metric has the dims ``([layer,] [policy,] [draw,] target, window|budget)``, in that order.
- ``range``: every value of a metric lies in its record's ``[lower, upper]`` (``math.inf`` above:
  +inf allowed, counted by readers) within :data:`TOLERANCE` for rounding; NaN is refused (the
  engine never stores one: it stops on non-finite logits); ``top1_agree`` holds 0 or 1.
- ``coords``: windows and budgets are integers of at least 1 token and at most ``reference_context``;
  in a window sweep, ``n_sink`` plus the largest window is at most ``reference_context`` (the
  kept sinks and window lie inside the reference context, as the engine requires);
  ``position`` and ``token_id`` are integers >= 0; ``doc`` and ``policy`` hold strings.
- ``positions``: every target position is at least ``reference_context`` (a target is scored with
  the N tokens before it as its reference context).
- ``targets``: a (``doc``, ``position``) pair appears at most once along ``target`` (so once per
  layer, policy and draw: those dims share the targets); a repeated row would count one target twice
  in every mean.
- ``attrs``: :data:`ATTR_RULES` (``reference_context`` a whole number >= 1, ``n_sink`` >= 0, text
  where text belongs, ``created`` ISO 8601 text, ``positions`` one of :data:`~truncsens.results.schema.POSITIONS`,
  ``sliding_window_distance`` (when present) one of :data:`SLIDING_WINDOW_DISTANCES`, ...).
"""

from __future__ import annotations

import numbers
from collections import Counter
from typing import Callable, Sequence

import numpy as np
import xarray as xr

from truncsens import metrics as _metrics

POSITIONS = ("original", "reindexed")  # the ``positions`` attr's values (re-exported by the schema)
# the ``sliding_window_distance`` attr's values (re-exported by the schema): what a sliding-window layer of window W
# measures the query-key distance on (it reads a key only within W of the query)
SLIDING_WINDOW_DISTANCES = ("original_position", "reindexed_position")
TOLERANCE = 1e-6  # float32 rounding of values clamped into range in float64
TEXT_ATTRS = ("truncsens_version", "model", "model_revision", "tokenizer", "dtype", "device", "corpus",
              "corpus_sha256", "domain", "command")
SHOWN_DUPLICATES = 3  # duplicated (doc, position) pairs named in a message; the rest are counted


def _whole(value, least: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) and value >= least


ATTR_RULES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "reference_context": ("a whole number of tokens >= 1", lambda v: _whole(v, 1)),
    "n_sink": ("a whole number >= 0", lambda v: _whole(v, 0)),
    "seed": ("a whole number", lambda v: _whole(v, -(2**63))),
    "targets_per_doc": ("a whole number >= 0", lambda v: _whole(v, 0)),
    "max_context": ("a whole number of tokens >= 0 (0: the config states no limit)", lambda v: _whole(v, 0)),
    **{name: ("text", lambda v: isinstance(v, str)) for name in TEXT_ATTRS},
    # a datetime object is refused rather than turned into text, so what load returns is what was saved
    "created": ("ISO 8601 text (results.utc_now(), or a datetime's .isoformat())", lambda v: isinstance(v, str)),
}


class ValueCheckError(ValueError):
    """A value breaks a rule; the message names the variable, the rule and the first offending value."""


def _plain(value):
    """A numpy scalar as the Python value it holds; anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _first(mask: np.ndarray, var: xr.DataArray) -> str:
    """``value v at dim=coord, ...`` of the first True of ``mask`` (same shape as ``var``)."""
    index = np.unravel_index(int(np.flatnonzero(mask.ravel())[0]), mask.shape)
    where = ", ".join(f"{d}={_plain(var[d].values[i]) if d in var.coords else i}" for d, i in zip(var.dims, index))
    return f"{_plain(np.asarray(var.values)[index])!r} at {where}"


def check_metric(ds: xr.Dataset, name: str, sweep: str) -> None:
    """Dims and range of metric ``name`` (module docstring). Raises :class:`ValueCheckError`."""
    record = _metrics.metric(name)
    var = ds[name]
    want = (("layer",) if "per_layer" in ds.attrs else ()) + tuple(d for d in ("policy", "draw") if d in ds.dims) + ("target", sweep)
    if var.dims != want:
        raise ValueCheckError(f"variable {name!r}: rule dims: it must have dims {want}, has {var.dims}")
    values = np.asarray(var.values, dtype=np.float64)
    if np.isnan(values).any():
        raise ValueCheckError(f"variable {name!r}: rule range: NaN is not a value of {name}: first "
                              f"{_first(np.isnan(values), var)}")
    low, high = record.lower - TOLERANCE, record.upper + TOLERANCE
    bad = (values < low) | (values > high)
    if bad.any():
        upper = "inf" if np.isinf(record.upper) else f"{record.upper:g}"
        raise ValueCheckError(f"variable {name!r}: rule range: values must lie in [{record.lower:g}, {upper}] "
                              f"(within {TOLERANCE:g}); first bad value {_first(bad, var)}")
    if record.dtype.kind in "iu":
        off = values != np.round(values)
        if off.any():
            raise ValueCheckError(f"variable {name!r}: rule range: values must be whole numbers; first bad value "
                                  f"{_first(off, var)}")


def check_coords(ds: xr.Dataset, sweep: str) -> None:
    """Sweep, position and token-id coords, sinks against the windows, target positions against the
    reference context (module docstring). Raises :class:`ValueCheckError`."""
    values = ds[sweep].values
    if values.dtype.kind not in "iu":
        raise ValueCheckError(f"coord {sweep!r}: rule coords: {sweep}s must be whole numbers of tokens, got dtype "
                              f"{values.dtype}")
    n = ds.attrs.get("reference_context")
    top = n if _whole(n, 1) else None
    bad = (values < 1) | ((values > top) if top is not None else False)
    if bad.any():
        limit = f"[1, reference_context = {top}]" if top is not None else "at least 1"
        raise ValueCheckError(f"coord {sweep!r}: rule coords: {sweep}s must lie in {limit} tokens; first bad value "
                              f"{values[bad][0].item()}")
    sinks = ds.attrs.get("n_sink")
    if sweep == "window" and top is not None and _whole(sinks, 0) and len(values) and sinks + values.max() > top:
        raise ValueCheckError(f"attr 'n_sink': rule coords: n_sink + the largest window must be at most reference_context "
                              f"= {top} tokens (the sinks and the window are kept inside the reference context); "
                              f"got n_sink {sinks} + window {values.max().item()}")
    for name in ("position", "token_id"):
        v = ds[name].values
        if v.dtype.kind not in "iu" or (v < 0).any():
            shown = v[v < 0][0].item() if v.dtype.kind in "iu" else v.dtype
            raise ValueCheckError(f"coord {name!r}: rule coords: must be whole numbers >= 0; first bad value {shown}")
    position = ds["position"].values
    early = position < top if top is not None else np.zeros(position.shape, bool)
    if early.any():
        i = int(np.flatnonzero(early)[0])
        raise ValueCheckError(f"coord 'position': rule positions: every target position must be at least "
                              f"reference_context = {top} (a target is scored with the {top} tokens before it); "
                              f"{int(early.sum())} of {len(position)} are not, first {position[i].item()} at target={i}")


def duplicated_targets(doc: Sequence[str], position: Sequence[int]) -> list[tuple[str, int, list[int]]]:
    """Every (doc, position) pair that occurs more than once, as ``(doc, position, rows)`` with the
    target indices holding it (increasing), in the order of first occurrence; empty when all are distinct.

    Args:
        doc: [n] document ids; position: [n] positions in tokens.
    """
    pairs = [(str(d), int(p)) for d, p in zip(doc, position)]
    counts = Counter(pairs)
    if len(counts) == len(pairs):
        return []
    rows: dict[tuple[str, int], list[int]] = {}
    for i, pair in enumerate(pairs):
        if counts[pair] > 1:
            rows.setdefault(pair, []).append(i)
    return [(d, p, r) for (d, p), r in rows.items()]


def describe_duplicates(dups: list[tuple[str, int, list[int]]], where: Callable[[list[int]], str]) -> str:
    """``"2 (doc, position) pairs appear more than once (5 rows in all): doc 'a' position 64 (<where>), ..."``:
    the first :data:`SHOWN_DUPLICATES` pairs of :func:`duplicated_targets` named, the others counted;
    ``where(rows)`` says where one pair's rows are. One line (ids are shown with ``repr``)."""
    shown = "; ".join(f"doc {d!r} position {p} ({where(rows)})" for d, p, rows in dups[:SHOWN_DUPLICATES])
    more = f"; and {len(dups) - SHOWN_DUPLICATES} more" if len(dups) > SHOWN_DUPLICATES else ""
    n_rows = sum(len(rows) for _, _, rows in dups)
    pairs = "1 (doc, position) pair appears" if len(dups) == 1 else f"{len(dups)} (doc, position) pairs appear"
    return f"{pairs} more than once ({n_rows} rows in all): {shown}{more}"


def check_targets(ds: xr.Dataset) -> None:
    """Each (doc, position) pair once along ``target`` (module docstring). Raises :class:`ValueCheckError`."""
    dups = duplicated_targets(ds["doc"].values, ds["position"].values)
    if dups:
        raise ValueCheckError("rule targets: a (doc, position) pair may appear only once per layer, policy and draw; "
                              + describe_duplicates(dups, lambda rows: f"{len(rows)} times, at target="
                                                    + _indices(rows)))


def _indices(rows: list[int], shown: int = 5) -> str:
    """``"0,48,49"``; past ``shown`` indices, ``"0,1,2,3,4,..."``."""
    return ",".join(map(str, rows[:shown])) + (",..." if len(rows) > shown else "")


def check_attrs(ds: xr.Dataset) -> None:
    """:data:`ATTR_RULES` on the attrs present. Raises :class:`ValueCheckError`."""
    for name, (rule, ok) in ATTR_RULES.items():
        if name in ds.attrs and not ok(ds.attrs[name]):
            raise ValueCheckError(f"attr {name!r}: rule attrs: it must be {rule}, got {ds.attrs[name]!r}")
    if "positions" in ds.attrs and ds.attrs["positions"] not in POSITIONS:
        raise ValueCheckError(f"attr 'positions': rule attrs: it must be one of {POSITIONS}, got {ds.attrs['positions']!r}")
    distance = ds.attrs.get("sliding_window_distance")
    if distance is not None and distance not in SLIDING_WINDOW_DISTANCES:
        raise ValueCheckError(f"attr 'sliding_window_distance': rule attrs: it must be one of {SLIDING_WINDOW_DISTANCES}, "
                              f"got {distance!r}")


def check_values(ds: xr.Dataset, sweep: str, metrics: tuple[str, ...]) -> None:
    """Every rule of the module docstring, in the order attrs, coords, targets, metrics.

    Raises:
        ValueCheckError: the first rule broken.
    """
    check_attrs(ds)
    check_coords(ds, sweep)
    check_targets(ds)
    for name in metrics:
        check_metric(ds, name, sweep)
