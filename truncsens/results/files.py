"""Reading and writing results files: NetCDF (engine h5netcdf) with the exact codecs of
:mod:`truncsens.results.codec`. The schema itself (building, validating, reading a Dataset in memory)
is :mod:`truncsens.results.schema`; this module is the only one that touches a results file's bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import xarray as xr

from truncsens.results import codec, fingerprint
from truncsens.results.paths import write_atomic
from truncsens.results.schema import (
    ResultsError, is_text_variable, rebuild_variables, text_values, utc_now, validate,
)


def save(ds: xr.Dataset, path: str | Path) -> Path:
    """Validate and write ``ds`` to NetCDF at ``path`` atomically. The file is built in memory
    (:func:`_netcdf_bytes`), so HDF5 never writes to disk; its bytes are then written by
    :func:`truncsens.results.paths.write_atomic` (free space checked first, a temporary file of this
    process, then a rename; the temporary file is removed if writing fails).

    What is checked is what :func:`load` will check: ``ds`` encoded for the file and decoded again,
    through the same :func:`~truncsens.results.schema.validate`, so ``save`` refuses exactly the
    files ``load`` would refuse, with load's message and `` (nothing written)`` after it. The file
    carries the fingerprint of its attrs (:mod:`truncsens.results.fingerprint`), which ``load``
    checks; ``ds`` itself is not changed.

    Raises:
        ResultsError: ``ds`` does not fit the schema or an attr cannot be stored (nothing is written).
        NoSpaceError: the disk is full (an ``OSError``; the message names the path; nothing is written).
        OSError: the path cannot be written.
    """
    path = Path(path)
    try:
        encoded = _encode(ds.assign_attrs(fingerprint.stamped(ds.attrs)))
    except ResultsError as exc:
        raise ResultsError(f"{_named(path, exc)} (nothing written)") from None
    try:
        validate(_decode(encoded))  # as load will see it
    except ResultsError as exc:
        raise ResultsError(f"{_named(path, exc)} (nothing written)") from None
    return write_atomic(path, _netcdf_bytes(encoded))


def _netcdf_bytes(encoded: xr.Dataset) -> bytes:
    """The NetCDF-4 file (engine h5netcdf) of an encoded Dataset, built in memory. HDF5 writing to a
    disk that fills up fails inside its close and leaves a handle whose clean-up at exit crashes the
    interpreter (SIGSEGV); in memory it never meets the disk, and the bytes are written by plain
    Python I/O, whose failures are ordinary ``OSError``.

    xarray >= 2025.8 returns the bytes from ``to_netcdf()``; older versions make bytes only through
    scipy (netCDF3), so the file is written there through xarray's h5netcdf store on an in-memory file.
    """
    try:
        return bytes(encoded.to_netcdf(engine="h5netcdf"))
    except ValueError as exc:
        if "invalid engine for creating bytes" not in str(exc):
            raise
    return _netcdf_bytes_through_store(encoded)


def _netcdf_bytes_through_store(encoded: xr.Dataset) -> bytes:
    """:func:`_netcdf_bytes` for xarray < 2025.8: ``Dataset.dump_to_store`` into an
    ``H5NetCDFStore`` of an ``h5netcdf.File`` on a ``BytesIO``."""
    import io

    import h5netcdf

    buffer = io.BytesIO()
    with h5netcdf.File(buffer, "w") as f:
        encoded.dump_to_store(xr.backends.H5NetCDFStore(f))
    return buffer.getvalue()


def _encode(ds: xr.Dataset) -> xr.Dataset:
    """A copy ready for NetCDF: string variables as variable-length strings (escaped where a value
    cannot be stored), attrs through :func:`truncsens.results.codec.encode_attrs`."""

    def one(name: str, var: xr.Variable) -> xr.Variable:
        attrs = codec.encode_attrs(var.attrs)
        values = var.data
        if is_text_variable(var):
            values = text_values(var, name)
            if not all(codec.storable(v) for v in values.ravel()):
                values = _map(codec.escape, values)
                attrs[codec.ESCAPE_ATTR] = codec.ESCAPE_SCHEME
        new = xr.Variable(var.dims, values, attrs, dict(var.encoding))
        if is_text_variable(var):
            new.encoding = {"dtype": str}  # variable-length: never the width of some earlier shard
        return new

    try:
        return rebuild_variables(ds, one, codec.encode_attrs(ds.attrs))
    except codec.AttrEncodingError as exc:
        raise ResultsError(str(exc)) from exc


def _decode(ds: xr.Dataset) -> xr.Dataset:
    """Undo :func:`_encode` on a dataset read from a file."""

    def one(name: str, var: xr.Variable) -> xr.Variable:
        attrs = dict(var.attrs)
        scheme = attrs.pop(codec.ESCAPE_ATTR, None)
        values = var.data
        encoding = dict(var.encoding)
        if is_text_variable(var):
            values = text_values(var, name)
            if scheme is not None:
                if scheme != codec.ESCAPE_SCHEME:
                    raise ResultsError(f"variable {name!r} has an unknown string escape {scheme!r}")
                values = _map(codec.unescape, values)
            encoding.pop("dtype", None)  # a fixed width read from a file must not bind later saves
        return xr.Variable(var.dims, values, codec.decode_attrs(attrs), encoding)

    return rebuild_variables(ds, one, codec.decode_attrs(ds.attrs))


def _map(fn, values: np.ndarray) -> np.ndarray:
    out = np.empty(values.shape, dtype=object)
    out.ravel()[:] = [fn(v) for v in values.ravel()]
    return out


def load(path: str | Path) -> xr.Dataset:
    """Read and validate a results file into memory.

    The attrs are checked against the fingerprint the file was written with
    (:mod:`truncsens.results.fingerprint`; a file written before fingerprints has none and is
    checked by the value rules alone); the fingerprint attr itself is not returned, so
    ``load(save(ds))`` equals ``ds``.

    Raises:
        FileNotFoundError: no such file.
        ResultsError: the file is not NetCDF or not a truncsens results file (schema, then values:
            :mod:`truncsens.results.checks`; the message names the file, variable, rule and first bad value),
            its attrs were changed after it was written (naming each attr, what it was and is), or another process
            holds it open for writing (HDF5's file lock; the message says how to read it anyway).
    """
    ds = _read(Path(path))
    try:
        fingerprint.check(ds.attrs)
        validate(_without_fingerprint(ds))
    except ResultsError as exc:
        raise ResultsError(_named(Path(path), exc)) from None
    return _without_fingerprint(ds)


def _without_fingerprint(ds: xr.Dataset) -> xr.Dataset:
    attrs = {k: v for k, v in ds.attrs.items() if k != fingerprint.FINGERPRINT_ATTR}
    if len(attrs) == len(ds.attrs):
        return ds
    out = ds.copy(deep=False)
    out.attrs = attrs
    return out


def _read(path: Path) -> xr.Dataset:
    """A results file's Dataset, decoded, not yet checked (its fingerprint attr still in its attrs).

    Raises:
        FileNotFoundError, ResultsError: as :func:`load`, before its checks.
    """
    if not path.is_file():
        raise FileNotFoundError(f"results file not found: {path}")
    try:
        with xr.open_dataset(path, engine="h5netcdf") as ds:
            ds = ds.load()
    except Exception as exc:  # h5py / xarray raise many kinds for a non-NetCDF file
        if "unable to lock file" in str(exc):
            raise ResultsError(
                f"{path} is locked by another process that has it open for writing (HDF5 file lock); wait for it "
                "to finish, or read it anyway (on a file system without locking, or accepting a partial read) "
                "with the environment variable HDF5_USE_FILE_LOCKING=FALSE") from exc
        raise ResultsError(f"{path} is not a NetCDF results file ({type(exc).__name__}: {exc})") from exc
    try:
        ds = _decode(ds)
    except ValueError as exc:  # bad JSON or escape: a damaged or foreign file
        raise ResultsError(f"{path}: cannot decode its strings or attrs ({exc})") from exc
    return ds


def _named(path: Path, exc: ResultsError) -> str:
    """The message of a refused file, the same from :func:`save` and :func:`load`: ``<path>: <what>``."""
    return f"{path}: {exc}"



def relabel(path: str | Path, reason: str, changes: Mapping[str, object] | None = None,
            out: str | Path | None = None) -> Path:
    """Change attrs of a results file deliberately (the documented way; an attr edited by other means
    is refused by :func:`load`): set each attr of ``changes``, adopt any attr already edited in the
    file since it was written, record what changed in the attr ``relabels`` (a list, one entry per
    re-label: ``{"at": UTC time, "reason": reason, "changed": {name: {"from": was, "to": is}}}``,
    values as fingerprint entries), and write the file with a fresh fingerprint. The values and every
    other attr are kept; the value rules (:mod:`truncsens.results.checks`: targets at positions >=
    ``reference_context``, windows and budgets within it, ...) must hold for the new attrs.

    Args:
        path: the results file.
        reason: why (text, recorded; not empty).
        changes: attr name -> new value (any storable value); none: only adopt edits already made.
        out: where to write (default: ``path`` itself, replaced atomically).

    Returns:
        The path written.

    Raises:
        ValueError: ``reason`` empty; ``changes`` names the fingerprint or ``relabels`` attr; nothing
            would change (no ``changes`` and no edit).
        FileNotFoundError, ResultsError: as :func:`load` (its fingerprint aside) and :func:`save`.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"relabel: reason must be a non-empty text saying why the attrs change, got {reason!r}")
    changes = dict(changes or {})
    reserved = sorted(set(changes) & {fingerprint.FINGERPRINT_ATTR, fingerprint.RELABELS_ATTR})
    if reserved:
        raise ValueError(f"relabel: changes may not set {', '.join(reserved)} (written by relabel itself)")
    path = Path(path)
    ds = _read(path)
    try:
        edited = fingerprint.changes(ds.attrs)
        before = fingerprint.fingerprint(ds.attrs)
        attrs = {**{k: v for k, v in ds.attrs.items() if k != fingerprint.FINGERPRINT_ATTR}, **changes}
        after = fingerprint.fingerprint(attrs)
    except ResultsError as exc:
        raise ResultsError(_named(path, exc)) from None
    changed = {name: {"from": was, "to": now} for name, (was, now) in edited.items()}
    for name in changes:
        if before.get(name) != after.get(name):
            changed[name] = {"from": edited[name][0] if name in edited else before.get(name), "to": after.get(name)}
    if not changed:
        raise ValueError(f"relabel: nothing to re-label in {path}: changes={changes!r} equal the attrs, and no attr "
                         "was edited since the file was written")
    record = {"at": utc_now(), "reason": reason, "changed": dict(sorted(changed.items()))}
    attrs[fingerprint.RELABELS_ATTR] = list(attrs.get(fingerprint.RELABELS_ATTR) or []) + [record]
    out_ds = ds.copy(deep=False)
    out_ds.attrs = attrs
    return save(out_ds, path if out is None else out)
