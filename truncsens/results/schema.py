"""The results file: an xarray Dataset saved as NetCDF (engine h5netcdf).

Schema (docs/results.md):

- dims: ``target`` and one sweep dim, ``window`` (suffix truncation) or ``budget`` (retention
  sweeps); per-layer window sweeps (``truncsens measure --per-layer``, attr ``per_layer``) add a
  leading ``layer`` dim (int64 coord: the layer that alone kept the window, every other layer its
  full cache); retention sweeps over several policies add a leading ``policy`` dim, and runs with
  ``--draws R`` (R > 1) a ``draw`` dim after it (coord 0..R-1: independent draws of the randomized
  policies; a deterministic policy holds the same values in every draw). Files without ``draw``
  are one draw. Readers average over draws per target first (:func:`mean_over_draws`).
- coords: the sweep dim (int64 tokens); per target ``doc`` (str id), ``position`` (int64, index of
  the target token in its document) and ``token_id`` (int64); ``policy`` (str) when present.
  String coords are numpy ``object`` arrays of Python ``str`` in memory and HDF5 variable-length
  UTF-8 strings on disk, so no id is ever cut to a fixed width. Any ``str`` round-trips exactly
  (empty, non-ASCII, NUL, the lone surrogates of a non-UTF-8 file name): a variable holding a value
  HDF5 cannot store is written with the reversible ``backslash-1`` escape of
  :mod:`truncsens.results.codec` (variable attr ``truncsens_escape``) and unescaped by :func:`load`.
- block-protocol window sweeps (attr ``protocol`` = "block") add the int32 coords ``actual_window``
  (target, window) and ``actual_context`` (target): the window and reference context each value
  was measured with (:mod:`truncsens.engine.block.runs`); without them actual = nominal.
- data vars: the metrics of :data:`truncsens.metrics.METRICS`, each in its record's dtype (float32;
  ``top1_agree`` int8), shape ([policy,] [draw,] target, window|budget). :func:`make_results`
  writes every metric; a file needs only at least one (a file written before a metric existed
  lacks it), and readers use the metrics the file holds (:func:`metrics_of`).
- attrs: :data:`REQUIRED_ATTRS` plus any provenance. Strings and numbers are plain NetCDF attrs;
  ``None``, ``bool``, lists, tuples, dicts, datetimes and paths are stored as JSON text named in
  the reserved attr ``truncsens_json_attrs`` and restored by :func:`load` as they went in
  (:mod:`truncsens.results.codec`); the required attrs have the types of
  :data:`truncsens.results.checks.ATTR_RULES` (``created``: ISO 8601 text, never a datetime). Log
  base e (attr ``log_base``). A model with sliding-window layers
  adds ``sliding_window_distance`` (:data:`SLIDING_WINDOW_DISTANCES`): a layer of window W read a kept
  key only when it lay within W of the query by ``original_position`` (kept sinks farther back are not
  seen: a deployed sliding layer holds no sinks) or by ``reindexed_position`` (the kept tokens
  consecutive, as in a fresh forward of them); files without it are of models without such layers,
  or from before the attr.
- targets: a (``doc``, ``position``) pair at most once along ``target``. :func:`validate` is the one
  check of all of this, run by ``save``, ``load`` and ``merge``; :func:`make_results` checks the
  schema part (:func:`check_schema`) of what it builds in memory.
"""

from __future__ import annotations

import datetime as _dt
from typing import Mapping, Sequence

import numpy as np
import xarray as xr

from truncsens import metrics as _metrics
from truncsens.results import checks, codec

SWEEP_DIMS = ("window", "budget")
# The vocabulary a results file may use; the engine's registry of semantics
# (truncsens.engine.semantics) is checked against it when it is built.
SEMANTICS = ("reencode", "streaming", "prefill_evict")
POSITIONS = checks.POSITIONS
SLIDING_WINDOW_DISTANCES = checks.SLIDING_WINDOW_DISTANCES
REQUIRED_ATTRS = (
    "truncsens_version", "model", "model_revision", "tokenizer", "dtype", "device", "semantics",
    "positions", "n_sink", "reference_context", "corpus", "corpus_sha256", "domain", "seed",
    "created", "command",
)


class ResultsError(ValueError):
    """A file or dataset is not a valid truncsens results file."""


def utc_now() -> str:
    """Current time, ISO 8601 in UTC (the ``created`` attr)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def make_results(
    metrics: Mapping[str, np.ndarray],
    sweep: str,
    sweep_values: Sequence[int],
    doc: Sequence[str],
    position: Sequence[int],
    token_id: Sequence[int],
    attrs: Mapping[str, object],
    policies: Sequence[str] | None = None,
    draws: int | None = None,
    layers: Sequence[int] | None = None,
) -> xr.Dataset:
    """Build a results Dataset.

    Args:
        metrics: name -> array of shape [target, S], with a leading [policy] with ``policies`` and a
            [draw] before target with ``draws``: [policy, draw, target, S].
        sweep: "window" or "budget".
        sweep_values: the S windows / budgets, in tokens.
        doc, position, token_id: per-target coords, length ``target``.
        attrs: provenance; every key of :data:`REQUIRED_ATTRS` must be present. Values are kept
            as given (``None`` stays ``None``, ``True`` stays ``True``); they must be storable, see
            :mod:`truncsens.results.codec`.
        policies: policy names for a leading ``policy`` dim, or None.
        draws: R for a ``draw`` dim (coord 0..R-1), or None (one draw, no dim).
        layers: layer indices for a leading ``layer`` dim (per-layer window sweeps: [layer, target,
            window]), or None.

    Raises:
        ResultsError: a shape, name or attr does not fit the schema, or an attr value cannot be stored
            (:func:`check_schema`; the values are checked by :func:`validate` when saved).
    """
    if sweep not in SWEEP_DIMS:
        raise ResultsError(f"sweep dim must be one of {SWEEP_DIMS}, got {sweep!r}")
    if draws is not None and draws < 1:
        raise ResultsError(f"draws must be at least 1, got {draws}")
    if layers is not None and (policies is not None or draws is not None or sweep != "window"):
        raise ResultsError("a layer dim belongs to per-layer window sweeps only (no policy or draw dim)")
    dims = ((("layer",) if layers is not None else ()) + (("policy",) if policies is not None else ())
            + (("draw",) if draws is not None else ()) + ("target", sweep))
    data_vars = {}
    for m in _metrics.METRICS:
        if m.name not in metrics:
            raise ResultsError(f"metric {m.name!r} missing")
        data_vars[m.name] = (dims, np.asarray(metrics[m.name]).astype(m.dtype))
    coords = {
        sweep: np.asarray(sweep_values, dtype=np.int64),
        "doc": ("target", _strings(doc, "doc")),
        "position": ("target", np.asarray(position, dtype=np.int64)),
        "token_id": ("target", np.asarray(token_id, dtype=np.int64)),
    }
    if policies is not None:
        coords["policy"] = _strings(policies, "policy")
    if draws is not None:
        coords["draw"] = np.arange(draws, dtype=np.int64)
    if layers is not None:
        coords["layer"] = np.asarray(layers, dtype=np.int64)
    ds = xr.Dataset(data_vars, coords=coords, attrs=dict(attrs))
    ds.attrs.setdefault("log_base", "e")
    if (layers is not None) != ("per_layer" in ds.attrs):
        raise ResultsError("a layer dim and the per_layer attr (what a layer kept) go together")
    check_schema(ds)
    return ds


def _strings(values: Sequence[str], name: str) -> np.ndarray:
    """A 1-D object array of Python ``str`` (no fixed width: nothing is ever cut)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        if isinstance(v, np.str_):
            v = str(v)
        if not isinstance(v, str):
            raise ResultsError(f"coord {name!r} must hold strings, got {type(v).__name__} {v!r} at index {i}")
        out[i] = v
    return out


def is_text_variable(var: xr.Variable) -> bool:
    return var.dtype.kind in "UO"


def text_values(var: xr.Variable, name: str) -> np.ndarray:
    """The values of a string variable as an object array of ``str`` (same shape)."""
    flat = [str(v) if isinstance(v, np.str_) else v for v in np.asarray(var.values, dtype=object).ravel()]
    bad = next((v for v in flat if not isinstance(v, str)), None)
    if bad is not None:
        raise ResultsError(f"variable {name!r} must hold strings only, got {type(bad).__name__} {bad!r}")
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(var.shape)


def sweep_dim(ds: xr.Dataset) -> str:
    """The sweep dim of a results dataset: "window" or "budget".

    Raises:
        ResultsError: neither dim is present.
    """
    for d in SWEEP_DIMS:
        if d in ds.dims:
            return d
    raise ResultsError("not a truncsens results file: it has neither a 'window' nor a 'budget' dim")


def metrics_of(ds: xr.Dataset) -> tuple[str, ...]:
    """The metrics a results dataset holds, in the order of :data:`truncsens.metrics.METRICS`."""
    return _metrics.present(ds.data_vars)


def validate(ds: xr.Dataset) -> None:
    """The one check of a results file: its schema (:func:`check_schema`), then its values against the
    metric records (:func:`truncsens.results.checks.check_values`: attrs, coords, unique targets, dims
    and ranges). :func:`truncsens.results.save` runs it on what it is about to write (as
    :func:`truncsens.results.load` will read it back), :func:`truncsens.results.load` on what it read
    and :func:`merge` on what it joined, so a file truncsens writes is one it reads.

    Raises:
        ResultsError: naming the first thing that does not fit.
    """
    held = check_schema(ds)
    try:
        checks.check_values(ds, sweep_dim(ds), held)
    except checks.ValueCheckError as exc:
        raise ResultsError(str(exc)) from None


def check_schema(ds: xr.Dataset) -> tuple[str, ...]:
    """The schema part of :func:`validate` (dims, metrics present and numeric, coords, attrs storable and
    present): what :func:`make_results` checks of a dataset in memory, whose values are checked when
    it is saved.

    Returns:
        The metrics ``ds`` holds (:func:`metrics_of`).

    Raises:
        ResultsError: naming the first thing that does not fit.
    """
    sweep = sweep_dim(ds)
    if "target" not in ds.dims:
        raise ResultsError("not a truncsens results file: no 'target' dim")
    held = metrics_of(ds)
    if not held:
        raise ResultsError(f"not a truncsens results file: no metric (it needs at least one of "
                           f"{', '.join(_metrics.NAMES)})")
    for name in held:
        if ds[name].dtype.kind not in "biuf":
            raise ResultsError(f"metric {name!r} must hold numbers, got dtype {ds[name].dtype}")
    for c in ("doc", "position", "token_id"):
        if c not in ds.coords:
            raise ResultsError(f"not a truncsens results file: coord {c!r} missing")
    for name, value in ds.attrs.items():
        try:
            codec.check_attr(name, value)
        except codec.AttrEncodingError as exc:
            raise ResultsError(str(exc)) from exc
    absent = [a for a in REQUIRED_ATTRS if a not in ds.attrs]
    if absent:
        raise ResultsError(f"not a truncsens results file: attrs missing: {', '.join(absent)}")
    if ds.attrs["semantics"] not in SEMANTICS:
        raise ResultsError(f"attr semantics={ds.attrs['semantics']!r} is not one of {SEMANTICS}")
    values = ds[sweep].values
    if values.ndim != 1 or len(np.unique(values)) != len(values):
        raise ResultsError(f"{sweep} values must be unique, got {values.tolist()}")
    if "layer" in ds.coords:
        layer = ds["layer"].values
        if layer.dtype.kind not in "iu" or (layer < 0).any() or len(np.unique(layer)) != len(layer):
            raise ResultsError("the layer coord must hold unique layer indices >= 0")
    if "draw" in ds.dims and ("draw" not in ds.coords or ds["draw"].values.tolist() != list(range(ds.sizes["draw"]))):
        raise ResultsError("the draw coord must be 0..R-1")
    return held


def is_per_layer(ds: xr.Dataset) -> bool:
    """Whether ``ds`` is a per-layer window sweep (attr ``per_layer``; its metrics have a ``layer`` dim).
    Other files may have ``layer`` dims on other variables (``truncsens certify`` records)."""
    return "per_layer" in ds.attrs and "layer" in ds.dims


def groups(ds: xr.Dataset) -> list[dict]:
    """The curves a results dataset holds, as ``sel`` keyword dicts: one per (layer, policy) present
    (``{}`` for a plain window or one-policy file); every reader that splits a file into curves
    (``show``, ``fit``) goes through this."""
    out = [{}]
    for dim in ("layer", "policy"):
        if dim in ds.dims and (dim != "layer" or is_per_layer(ds)):
            values = [int(v) if dim == "layer" else str(v) for v in ds[dim].values]
            out = [{**g, dim: v} for g in out for v in values]
    return out


def group_label(group: dict) -> str:
    """``"layer 3, policy h2o"``-style text of a :func:`groups` entry (empty for ``{}``)."""
    return ", ".join(f"{dim} {value}" for dim, value in group.items())


def mean_over_draws(ds: xr.Dataset) -> xr.Dataset:
    """Per target, the mean of every data var over the ``draw`` dim (a dataset without one is returned
    as is): what every reader (curves, fits, ``show``, ``compare-policies``) works on.

    The mean keeps non-finite values (``skipna=False``): a target with KL = +inf in one draw has mean
    +inf, counted downstream as infinite, never dropped; NaN stays NaN. Every var becomes a float64
    mean (for ``top1_agree``: the share of draws that agree). The attr
    ``draws_averaged`` records R.
    """
    if "draw" not in ds.dims:
        return ds
    R = int(ds.sizes["draw"])
    out = ds.astype(np.float64).mean("draw", skipna=False, keep_attrs=True)  # float64 sums of float32 values
    for name in ds.data_vars:
        out[name].attrs = dict(ds[name].attrs)
    out.attrs["draws_averaged"] = R
    return out


def rebuild_variables(ds: xr.Dataset, fn, attrs: dict) -> xr.Dataset:
    """A dataset with ``fn(name, variable)`` in place of every variable (coords stay coords)."""
    coords = {n: fn(n, v) for n, v in ds.coords.variables.items()}
    data_vars = {n: fn(n, ds[n].variable) for n in ds.data_vars}
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


# What may differ between the shards of one run: when, where, by which command (``--resume`` added) and
# truncsens version each was written, its place and its own count of clamped values. Every other attr is
# the run's; shards the engine wrote are compared on their configuration hash ``run_fingerprint`` alone.
PER_SHARD_ATTRS = ("shard_index", "n_clamped", "created", "command", "device", "truncsens_version")
RUN_FINGERPRINT = "run_fingerprint"


def merge(parts: Sequence[xr.Dataset], sources: Sequence[str] | None = None) -> xr.Dataset:
    """Concatenate shards of one run along ``target`` (attrs of the first shard are kept).

    String coords are concatenated as variable-length strings: a long id of a later shard is
    never cut to the width of the first shard's ids.

    Args:
        parts: the shards, in order.
        sources: their names for messages (default ``shard 0``, ``shard 1``, ...).

    Raises:
        ResultsError: no parts; parts of different runs (another ``run_fingerprint``, or without
            one, another attr outside :data:`PER_SHARD_ATTRS`); different sweeps or other coords of
            the policy, draw or layer dims; or a (doc, position) pair in more than one row, naming
            the pairs and the shards holding them.
    """
    if not parts:
        raise ResultsError("nothing to merge: no shards")
    names = list(sources) if sources is not None else [f"shard {i}" for i in range(len(parts))]
    sweep = sweep_dim(parts[0])
    first = parts[0][sweep].values
    for p, name in zip(parts[1:], names[1:]):
        if sweep_dim(p) != sweep or not np.array_equal(p[sweep].values, first):
            raise ResultsError("shards have different windows/budgets and cannot be merged")
        _check_one_run(parts[0], p, names[0], name)
    _check_distinct_targets(parts, names)
    out = xr.concat(list(parts), dim="target", combine_attrs="override")

    def plain(name: str, var: xr.Variable) -> xr.Variable:
        if not is_text_variable(var):
            return var
        encoding = {k: v for k, v in var.encoding.items() if k != "dtype"}  # no fixed width from shard 0
        return xr.Variable(var.dims, text_values(var, name), var.attrs, encoding)

    out = rebuild_variables(out, plain, dict(out.attrs))
    validate(out)
    return out


def _check_one_run(a: xr.Dataset, b: xr.Dataset, name_a: str, name_b: str) -> None:
    """Raise :class:`ResultsError` unless ``b`` is a shard of the run of ``a`` (see :func:`merge`)."""
    refuse = f"refusing to merge {name_b} with {name_a}: they are shards of different runs"
    fa, fb = a.attrs.get(RUN_FINGERPRINT), b.attrs.get(RUN_FINGERPRINT)
    if fa is not None or fb is not None:
        if fa != fb:
            raise ResultsError(f"{refuse} (run_fingerprint {fb!r} there, {fa!r} here)")
        return
    for key in sorted((set(a.attrs) | set(b.attrs)) - set(PER_SHARD_ATTRS)):
        if key not in a.attrs or key not in b.attrs:
            raise ResultsError(f"{refuse} (attr {key!r} is in {name_a if key in a.attrs else name_b} only)")
        if not _same_value(a.attrs[key], b.attrs[key]):
            raise ResultsError(f"{refuse} (attr {key!r} is {b.attrs[key]!r} there, {a.attrs[key]!r} here)")
    for dim in ("layer", "policy", "draw"):
        if (dim in a.dims) != (dim in b.dims) or (
                dim in a.dims and not np.array_equal(np.asarray(a[dim].values), np.asarray(b[dim].values))):
            raise ResultsError(f"refusing to merge {name_b} with {name_a}: their {dim} coords differ")


def _same_value(x: object, y: object) -> bool:
    """Attr equality for :func:`_check_one_run`: arrays element-wise, NaN equal to NaN, else ``==``."""
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.shape(x) == np.shape(y) and bool(np.array_equal(x, y, equal_nan=np.asarray(x).dtype.kind == "f"))
    if isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y):
        return True
    try:
        return bool(x == y)
    except (TypeError, ValueError):  # a container holding arrays
        return repr(x) == repr(y)


def _check_distinct_targets(parts: Sequence[xr.Dataset], names: Sequence[str]) -> None:
    """Raise :class:`ResultsError` naming the pairs when a (doc, position) pair is in two rows of the
    concatenated ``parts`` (in one shard or in several)."""
    sizes = [int(p.sizes["target"]) for p in parts]
    starts = np.cumsum([0] + sizes)  # [len(parts) + 1] first row of each part in the concatenation
    doc = [d for p in parts for d in p["doc"].values]
    position = np.concatenate([np.asarray(p["position"].values) for p in parts])
    dups = checks.duplicated_targets(doc, position)
    if dups:
        def where(rows: list[int]) -> str:
            held = [names[int(np.searchsorted(starts, r, side="right")) - 1] for r in rows]
            return f"{len(rows)} times, in " + ", ".join(dict.fromkeys(held))
        raise ResultsError("refusing to merge: " + checks.describe_duplicates(dups, where)
                           + "; a target belongs to one shard of one run")
