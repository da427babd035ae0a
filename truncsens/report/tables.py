"""Plain-text tables and the number formats of every printed report (one renderer, used by the
``show``, ``fit``, ``recommend-window`` and ``compare-policies`` reports of :mod:`truncsens.report.printed`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Column:
    """One column: its header, alignment (``"<"`` left, ``">"`` right) and minimum width in characters."""

    header: str = ""
    align: str = "<"
    width: int = 0


_WIDTH: list[int | None] = [None]  # characters per line of the terminal, when the command line knows it


def set_width(width: int | None) -> None:
    """Split tables wider than ``width`` characters (:func:`render_table`); None (the default): never split.
    The command line sets it when it prints to a terminal of known width."""
    _WIDTH[0] = width if width and width > 0 else None


def render_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], sep: str = "  ", header: bool = True,
                 rule: bool = True, fit: bool = True) -> str:
    """Rows of cells as text lines joined by ``sep``; trailing spaces stripped.

    Args:
        columns: one :class:`Column` per cell of a row.
        rows: the cells, already formatted.
        sep: text between columns.
        header: print the headers as the first line.
        rule: underline the headers with dashes (``header`` only).
        fit: widen each column to its longest cell; False keeps the given widths and lets a longer
            cell overflow its column.

    A table with headers wider than the width of :func:`set_width` is printed as several tables, one
    under the other (a blank line between), each with the first column (the row's name) and as many
    of the next columns as fit; a column wider than the width alone stays whole.

    Raises:
        ValueError: a row has a different number of cells than there are columns.
    """
    table = ([[c.header for c in columns]] if header else []) + [list(r) for r in rows]
    for r in table:
        if len(r) != len(columns):
            raise ValueError(f"a row has {len(r)} cells for {len(columns)} columns: {r}")
    widths = [max([c.width] + [len(r[i]) for r in table]) if fit else c.width for i, c in enumerate(columns)]
    limit = _WIDTH[0]
    if limit and header and len(columns) > 2 and sum(widths) + len(sep) * (len(columns) - 1) > limit:
        return "\n\n".join(render_table([columns[i] for i in part], [[r[i] for i in part] for r in rows], sep, header, rule, fit)
                           for part in _parts(widths, len(sep), limit))
    lines = [sep.join(f"{cell:{c.align}{w}}" for cell, c, w in zip(r, columns, widths)).rstrip() for r in table]
    if header and rule:
        lines.insert(1, sep.join("-" * w for w in widths))
    return "\n".join(lines)


def _parts(widths: Sequence[int], sep: int, limit: int) -> list[list[int]]:
    """Column indices of the tables a wide table splits into: column 0 in each, then the next columns
    while the line stays within ``limit`` characters (at least one per table)."""
    parts: list[list[int]] = []
    for i in range(1, len(widths)):
        if parts and sum(widths[j] for j in parts[-1]) + sep * len(parts[-1]) + widths[i] <= limit:
            parts[-1].append(i)
        else:
            parts.append([0, i])
    return parts


def fmt_num(v: float | None, digits: int = 4) -> str:
    """``v`` with ``digits`` significant digits (``%g``); ``"inf"`` / ``"-inf"`` for infinities (never hidden:
    a mean over a set with +inf is inf); ``"-"`` for None or NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def fmt_interval(ci: Sequence[float | None] | None, digits: int = 4) -> str:
    """``" [lo, hi]"`` (with a leading space) or ``""`` when there is no interval or an end is None or not finite."""
    if not ci or any(c is None or not math.isfinite(c) for c in ci):
        return ""
    return f" [{fmt_num(ci[0], digits)}, {fmt_num(ci[1], digits)}]"


def fmt_estimate(stat: dict, digits: int = 3) -> str:
    """``"value [lo, hi]"`` of a ``{"value", "ci"}`` dict (:func:`fmt_num`, :func:`fmt_interval`)."""
    return fmt_num(stat["value"], digits) + fmt_interval(stat.get("ci"), digits)


def fmt_bytes(n: int | None) -> str:
    """A byte count in GiB/MiB/KiB with 3 significant digits (``"-"`` for None)."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def fmt_count(n: int, noun: str) -> str:
    """A count with its noun, singular for one: ``1 target``, ``376 targets``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def fmt_level(level: float) -> str:
    """A confidence level as a percentage: 0.95 -> ``"95%"``, 0.975 -> ``"97.5%"``."""
    return f"{100 * level:g}%"
