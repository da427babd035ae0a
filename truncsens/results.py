"""The results file: an xarray Dataset saved as NetCDF (engine h5netcdf).

Schema (see ``design.md``):

- dims: ``target`` and one sweep dim, ``window`` (suffix truncation) or ``budget`` (retention
  sweeps); retention sweeps over several policies add a leading ``policy`` dim.
- coords: the sweep dim (int64 tokens); per target ``doc`` (str id), ``position`` (int64, index of
  the target token in its document) and ``token_id`` (int64); ``policy`` (str) when present.
- data vars: :data:`truncsens.divergences.METRICS`, float32 (``top1_agree`` int8), shape
  ([policy,] target, window|budget).
- attrs: :data:`REQUIRED_ATTRS`, all strings or numbers. Log base e (attr ``log_base``).
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import xarray as xr

from truncsens.divergences import METRICS

SWEEP_DIMS = ("window", "budget")
REQUIRED_ATTRS = (
    "truncsens_version", "model", "model_revision", "tokenizer", "dtype", "device", "semantics",
    "positions", "n_sink", "reference_context", "corpus", "corpus_sha256", "domain", "seed",
    "created", "command",
)
SEMANTICS = ("reencode", "streaming", "prefill_evict")
POSITIONS = ("original", "reindexed")


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
) -> xr.Dataset:
    """Build a results Dataset.

    Args:
        metrics: name -> array of shape [target, S] (or [policy, target, S] with ``policies``).
        sweep: "window" or "budget".
        sweep_values: the S windows / budgets, in tokens.
        doc, position, token_id: per-target coords, length ``target``.
        attrs: provenance; every key of :data:`REQUIRED_ATTRS` must be present.
        policies: policy names for a leading ``policy`` dim, or None.

    Raises:
        ResultsError: a shape, name or attr does not fit the schema.
    """
    if sweep not in SWEEP_DIMS:
        raise ResultsError(f"sweep dim must be one of {SWEEP_DIMS}, got {sweep!r}")
    dims = (("policy",) if policies is not None else ()) + ("target", sweep)
    data_vars = {}
    for name in METRICS:
        if name not in metrics:
            raise ResultsError(f"metric {name!r} missing")
        dtype = np.int8 if name == "top1_agree" else np.float32
        data_vars[name] = (dims, np.asarray(metrics[name]).astype(dtype))
    coords = {
        sweep: np.asarray(sweep_values, dtype=np.int64),
        "doc": ("target", np.asarray(list(doc), dtype=object).astype(str)),
        "position": ("target", np.asarray(position, dtype=np.int64)),
        "token_id": ("target", np.asarray(token_id, dtype=np.int64)),
    }
    if policies is not None:
        coords["policy"] = np.asarray(list(policies), dtype=str)
    ds = xr.Dataset(data_vars, coords=coords, attrs={k: _attr(v) for k, v in attrs.items()})
    ds.attrs.setdefault("log_base", "e")
    validate(ds)
    return ds


def _attr(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, float, str, np.integer, np.floating)):
        return value
    return str(value)


def sweep_dim(ds: xr.Dataset) -> str:
    """The sweep dim of a results dataset: "window" or "budget".

    Raises:
        ResultsError: neither dim is present.
    """
    for d in SWEEP_DIMS:
        if d in ds.dims:
            return d
    raise ResultsError("not a truncsens results file: it has neither a 'window' nor a 'budget' dim")


def validate(ds: xr.Dataset) -> None:
    """Check a dataset against the schema.

    Raises:
        ResultsError: naming the first thing that does not fit.
    """
    sweep = sweep_dim(ds)
    if "target" not in ds.dims:
        raise ResultsError("not a truncsens results file: no 'target' dim")
    missing = [m for m in METRICS if m not in ds.data_vars]
    if missing:
        raise ResultsError(f"not a truncsens results file: metrics missing: {', '.join(missing)}")
    for c in ("doc", "position", "token_id"):
        if c not in ds.coords:
            raise ResultsError(f"not a truncsens results file: coord {c!r} missing")
    absent = [a for a in REQUIRED_ATTRS if a not in ds.attrs]
    if absent:
        raise ResultsError(f"not a truncsens results file: attrs missing: {', '.join(absent)}")
    if ds.attrs["semantics"] not in SEMANTICS:
        raise ResultsError(f"attr semantics={ds.attrs['semantics']!r} is not one of {SEMANTICS}")
    values = ds[sweep].values
    if values.ndim != 1 or len(np.unique(values)) != len(values):
        raise ResultsError(f"{sweep} values must be unique, got {values.tolist()}")


def save(ds: xr.Dataset, path: str | Path) -> Path:
    """Validate and write ``ds`` to NetCDF at ``path`` (atomically: temp file, then rename).

    Raises:
        ResultsError: ``ds`` does not fit the schema (nothing is written).
        OSError: the path cannot be written.
    """
    validate(ds)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    ds.to_netcdf(tmp, engine="h5netcdf")
    tmp.replace(path)
    return path


def load(path: str | Path) -> xr.Dataset:
    """Read and validate a results file into memory.

    Raises:
        FileNotFoundError: no such file.
        ResultsError: the file is not NetCDF or not a truncsens results file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"results file not found: {path}")
    try:
        with xr.open_dataset(path, engine="h5netcdf") as ds:
            ds = ds.load()
    except Exception as exc:  # h5py / xarray raise many kinds for a non-NetCDF file
        raise ResultsError(f"{path} is not a NetCDF results file ({type(exc).__name__}: {exc})") from exc
    validate(ds)
    return ds


def merge(parts: Sequence[xr.Dataset]) -> xr.Dataset:
    """Concatenate shards of one run along ``target`` (attrs of the first shard are kept).

    Raises:
        ResultsError: no parts, or parts with different sweeps.
    """
    if not parts:
        raise ResultsError("nothing to merge: no shards")
    sweep = sweep_dim(parts[0])
    first = parts[0][sweep].values
    for p in parts[1:]:
        if sweep_dim(p) != sweep or not np.array_equal(p[sweep].values, first):
            raise ResultsError("shards have different windows/budgets and cannot be merged")
    out = xr.concat(list(parts), dim="target", combine_attrs="override")
    validate(out)
    return out
