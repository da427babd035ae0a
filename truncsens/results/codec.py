"""Reversible encodings that let any string and any provenance value round-trip through NetCDF.

HDF5 variable-length strings (what ``h5netcdf`` writes) are UTF-8 and end at the first NUL, so a
Python ``str`` holding ``"\\x00"`` or a lone surrogate (``"\\udce9"``: how Python spells a file-name
byte that is not UTF-8, PEP 383 ``surrogateescape``) cannot be stored as-is; and NetCDF attributes
hold only strings, numbers and numeric arrays. Two documented, reversible encodings close the gap
(:mod:`truncsens.results` applies them in ``save`` and undoes them in ``load``):

**String escape** ``backslash-1`` (:func:`escape` / :func:`unescape`), applied to a whole string
variable (every element) only when one of its values cannot be stored, and recorded in that
variable's attr :data:`ESCAPE_ATTR` ``= "backslash-1"``:

- ``\\`` becomes ``\\\\``;
- NUL (U+0000) becomes ``\\x00``;
- a surrogate code point U+D800..U+DFFF becomes ``\\u`` and 4 lowercase hex digits (``\\udce9``).

These are Python string-literal escapes, so the stored text reads like a ``repr``; variables that
need no escape are stored verbatim (and have no :data:`ESCAPE_ATTR`).

**Attribute encoding** (:func:`encode_attrs` / :func:`decode_attrs`): an attr that is a ``str``
NetCDF can store, an ``int`` within int64, a ``float``, a numpy number or a numeric numpy array is
stored natively (plain NetCDF readers see it as is). Any other value (``None``, ``bool``,
``list``, ``tuple``, ``dict``, ``datetime.datetime`` / ``date`` / ``time`` / ``timedelta``,
``pathlib.Path``, a larger ``int``, a ``str`` with NUL or a lone surrogate) is stored as JSON text
(``ensure_ascii``: NUL and surrogates as ``\\uXXXX`` escapes) and its name is listed in the
reserved attr :data:`JSON_ATTRS` (a JSON list of names, sorted). Inside the JSON, values JSON has no
type for are tagged objects ``{"$type": T, "value": V}`` with T one of ``tuple``, ``datetime``,
``date``, ``time``, ``timedelta`` (V = ``[days, seconds, microseconds]``), ``path``, ``dict`` (a
dict whose keys are not all strings, or that has a ``"$type"`` key; V = list of ``[key, value]``
pairs). numpy scalars inside containers are stored as the Python numbers they equal.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path, PurePath
from typing import Mapping

import numpy as np

ESCAPE_ATTR = "truncsens_escape"
ESCAPE_SCHEME = "backslash-1"
JSON_ATTRS = "truncsens_json_attrs"
RESERVED_ATTRS = (ESCAPE_ATTR, JSON_ATTRS)

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_TO_ESCAPE = re.compile("[\\\\\x00\ud800-\udfff]")
_ESCAPED = re.compile(r"\\(\\|x00|u[0-9a-f]{4})?")
_INT64 = (-(2**63), 2**63 - 1)
_TAG = "$type"


class AttrEncodingError(ValueError):
    """A value has a type that cannot be stored reversibly."""


def storable(text: str) -> bool:
    """True when ``text`` can be written as an HDF5 UTF-8 string as is (no NUL, no surrogate)."""
    return _UNSTORABLE.search(text) is None


def escape(text: str) -> str:
    """Escape ``\\``, NUL and surrogates (scheme ``backslash-1``, see the module docstring)."""

    def one(m: re.Match) -> str:
        c = m.group(0)
        if c == "\\":
            return "\\\\"
        if c == "\x00":
            return "\\x00"
        return f"\\u{ord(c):04x}"

    return _TO_ESCAPE.sub(one, text)


def unescape(text: str) -> str:
    """Inverse of :func:`escape`: ``unescape(escape(s)) == s`` for every ``str`` s.

    Raises:
        ValueError: a backslash that no escape of the scheme starts.
    """

    def one(m: re.Match) -> str:
        body = m.group(1)
        if body is None:
            raise ValueError(f"not a {ESCAPE_SCHEME} escaped string (a lone backslash): {text!r}")
        if body == "\\":
            return "\\"
        if body == "x00":
            return "\x00"
        return chr(int(body[1:], 16))

    return _ESCAPED.sub(one, text)


# ---------------------------------------------------------------- attrs


def _native(value: object) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, int):
        return _INT64[0] <= value <= _INT64[1]
    if isinstance(value, (float, np.integer, np.floating)):
        return True
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.dtype.kind in "iuf" and value.size > 0
    return False


def _to_json(value: object, where: str) -> object:
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if isinstance(value, np.bool_):  # a numpy bool comes back a numpy bool, not a Python bool
        return {_TAG: "numpy.bool_", "value": bool(value)}
    if isinstance(value, np.generic):
        return _to_json(value.item(), where)
    if isinstance(value, np.ndarray) and value.dtype == np.bool_:
        return {_TAG: "numpy.bool_array", "value": [_to_json(v, where) for v in value.tolist()]}
    if isinstance(value, list):
        return [_to_json(v, where) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "value": [_to_json(v, where) for v in value]}
    if isinstance(value, np.ndarray):
        return [_to_json(v, where) for v in value.tolist()]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _to_json(v, where) for k, v in value.items()}
        return {_TAG: "dict", "value": [[_to_json(k, where), _to_json(v, where)] for k, v in value.items()]}
    if isinstance(value, _dt.datetime):
        return {_TAG: "datetime", "value": value.isoformat()}
    if isinstance(value, _dt.date):
        return {_TAG: "date", "value": value.isoformat()}
    if isinstance(value, _dt.time):
        return {_TAG: "time", "value": value.isoformat()}
    if isinstance(value, _dt.timedelta):
        return {_TAG: "timedelta", "value": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, PurePath):
        return {_TAG: "path", "value": str(value)}
    raise AttrEncodingError(
        f"attr {where!r} holds a {type(value).__name__}, which a results file cannot store; give a str, number, bool, "
        "None, list, tuple, dict, datetime/date/time/timedelta or pathlib.Path")


def _hook(obj: dict) -> object:
    if set(obj) != {_TAG, "value"}:
        return obj
    kind, v = obj[_TAG], obj["value"]
    if kind == "tuple":
        return tuple(v)
    if kind == "dict":
        return {_hashable(k): val for k, val in v}
    if kind == "datetime":
        return _dt.datetime.fromisoformat(v)
    if kind == "date":
        return _dt.date.fromisoformat(v)
    if kind == "time":
        return _dt.time.fromisoformat(v)
    if kind == "timedelta":
        return _dt.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
    if kind == "path":
        return Path(v)
    if kind == "numpy.bool_":
        return np.bool_(v)
    if kind == "numpy.bool_array":
        return np.array(v, dtype=np.bool_)
    return obj


def _hashable(key: object) -> object:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def canonical(value: object, where: str = "value") -> str:
    """One JSON text per attr value, the same for a value in memory and for that value read back from
    a file (numpy numbers as the Python numbers they equal, a one-element numeric array as its element,
    keys sorted): what :mod:`truncsens.results.fingerprint` compares.

    Raises:
        AttrEncodingError: a value of a type that cannot be stored (naming ``where``).
    """
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iuf":
        value = value.reshape(-1)[0]
    return json.dumps(_to_json(value, where), sort_keys=True, ensure_ascii=True)


def check_attr(name: str, value: object) -> None:
    """Raise :class:`AttrEncodingError` if ``value`` cannot be stored (names the attr)."""
    if name in RESERVED_ATTRS:
        raise AttrEncodingError(f"attr name {name!r} is reserved by the results file format")
    if not _native(value):
        _to_json(value, name)


def encode_attrs(attrs: Mapping[str, object]) -> dict[str, object]:
    """Attrs as NetCDF can store them (see the module docstring); inverse :func:`decode_attrs`.

    Raises:
        AttrEncodingError: a reserved name, or a value of a type that cannot be stored.
    """
    out: dict[str, object] = {}
    encoded = []
    for name, value in attrs.items():
        check_attr(name, value)
        if _native(value):
            out[name] = value
        else:
            out[name] = json.dumps(_to_json(value, name), ensure_ascii=True)
            encoded.append(name)
    if encoded:
        out[JSON_ATTRS] = json.dumps(sorted(encoded), ensure_ascii=True)
    return out


def decode_attrs(attrs: Mapping[str, object]) -> dict[str, object]:
    """Undo :func:`encode_attrs` on attrs read from a file (files without :data:`JSON_ATTRS` pass as is).

    Raises:
        ValueError: :data:`JSON_ATTRS` or a value it lists is not valid JSON.
    """
    out = dict(attrs)
    listed = out.pop(JSON_ATTRS, None)
    if listed is None:
        return out
    for name in json.loads(str(listed)):
        if name in out:
            out[name] = json.loads(str(out[name]), object_hook=_hook)
    return out
