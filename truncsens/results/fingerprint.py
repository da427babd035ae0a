"""The fingerprint of a results file's attrs: written by :func:`truncsens.results.save`, checked by
:func:`truncsens.results.load`, so an attr edited after the file was written (by hand, or by a script
that writes NetCDF without truncsens) is refused, naming what changed, instead of silently changing
what ``fit``, ``show``, ``recommend-window`` or ``compare-policies`` compute from the file.

The fingerprint is the attr :data:`FINGERPRINT_ATTR`: a dict from each attr name (all attrs but
:data:`UNFINGERPRINTED`: when, by which command and truncsens version the file was written) to the
canonical JSON text of its value (:func:`truncsens.results.codec.canonical`), or, for a text longer
than :data:`SHOWN_CHARS` characters, ``sha256:`` and the first 16 hex digits of that text's SHA-256.
So a refusal can say ``reference_context was 64, is 48``. A file written before the fingerprint
existed has none and is checked by the value rules alone (:mod:`truncsens.results.checks`).

A deliberate re-label goes through :func:`truncsens.results.relabel`, which rewrites the attrs,
records the change in the attr :data:`RELABELS_ATTR` and writes a fresh fingerprint.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

from truncsens.results import codec
from truncsens.results.schema import ResultsError

FINGERPRINT_ATTR = "attrs_fingerprint"
RELABELS_ATTR = "relabels"
# when, by which command and by which truncsens version a file was written: rewritten by every merge and
# save, never part of what was measured
UNFINGERPRINTED = ("created", "command", "truncsens_version", FINGERPRINT_ATTR)
SHOWN_CHARS = 80  # a canonical value longer than this is fingerprinted by its hash
RELABEL_HOW = "to re-label it deliberately, use truncsens.results.relabel(path, reason=...) (docs/results.md)"


def entry(value: object, name: str = "value") -> str:
    """The fingerprint entry of one attr value: its canonical JSON text, or ``sha256:<16 hex>`` of a long one."""
    text = codec.canonical(value, name)
    if len(text) <= SHOWN_CHARS:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(attrs: Mapping[str, object]) -> dict[str, str]:
    """``{name: entry}`` of every attr but :data:`UNFINGERPRINTED`, sorted by name.

    Raises:
        ResultsError: an attr value that a results file cannot store (names it).
    """
    try:
        return {name: entry(attrs[name], name) for name in sorted(attrs) if name not in UNFINGERPRINTED}
    except codec.AttrEncodingError as exc:
        raise ResultsError(str(exc)) from exc


def stamped(attrs: Mapping[str, object]) -> dict[str, object]:
    """``attrs`` with a fresh :data:`FINGERPRINT_ATTR` (what :func:`truncsens.results.save` writes)."""
    out = {k: v for k, v in attrs.items() if k != FINGERPRINT_ATTR}
    out[FINGERPRINT_ATTR] = fingerprint(out)
    return out


def recorded(attrs: Mapping[str, object]) -> dict[str, str] | None:
    """The fingerprint a file carries, or None for a file written before fingerprints existed.

    Raises:
        ResultsError: the attr is there but is not a dict of text (damaged).
    """
    held = attrs.get(FINGERPRINT_ATTR)
    if held is None:
        return None
    if not isinstance(held, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in held.items()):
        raise ResultsError(f"attr {FINGERPRINT_ATTR!r} is damaged: it must be a dict of text, got {held!r}"[:300])
    return held


def changes(attrs: Mapping[str, object]) -> dict[str, tuple[str | None, str | None]]:
    """The attrs whose value differs from the file's fingerprint: ``{name: (was, is)}`` (entries of
    :func:`entry`; None where the attr was absent / is absent now). Empty when the attrs match or the
    file has no fingerprint.

    Raises:
        ResultsError: a damaged fingerprint attr.
    """
    held = recorded(attrs)
    if held is None:
        return {}
    now = fingerprint(attrs)
    return {name: (held.get(name), now.get(name)) for name in sorted(set(held) | set(now))
            if held.get(name) != now.get(name)}


def describe(diff: Mapping[str, tuple[str | None, str | None]]) -> str:
    """``reference_context was 64, is 48; n_sink added (4)`` of :func:`changes`."""
    parts = []
    for name, (was, now) in diff.items():
        if was is None:
            parts.append(f"{name} added ({now})")
        elif now is None:
            parts.append(f"{name} removed (was {was})")
        else:
            parts.append(f"{name} was {was}, is {now}")
    return "; ".join(parts)


def check(attrs: Mapping[str, object]) -> None:
    """Refuse attrs that differ from the fingerprint written with them (files without one pass).

    Raises:
        ResultsError: naming each changed attr with its recorded and present value, and how to
            re-label a file deliberately.
    """
    diff = changes(attrs)
    if diff:
        raise ResultsError(f"attrs were changed after the file was written ({describe(diff)}): they no longer "
                           f"describe the measurement its values come from (attr {FINGERPRINT_ATTR!r}); {RELABEL_HOW}")
