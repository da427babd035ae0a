"""The exact and block protocols side by side, from the summaries ``benchmarks/protocol_efficiency.py``
writes (``OUT_DIR/summary.json``): one Markdown row per protocol run (targets, forward tokens, α_TV and
α_KL of the power law with their 95 % document-bootstrap intervals, rounded to 3 decimals), then each
summary's paired differences of the exponents (block − exact) and its design-width model
W² = a + b/m. A reading of finished runs, no measurement of its own: docs/protocols.md quotes it.

A results file several summaries read (``--exact-results``, ``--block-results``) is printed once,
under the first summary that holds it. Wall-clock seconds are left out: the runs share the machine with others, and the forward
tokens are the cost that does not depend on it.

Usage (seconds)::

    python benchmarks/protocol_table.py runs/pe8/summary.json runs/pe64/summary.json runs/pe32/summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RUNS = (("exact", "exact, {per} random targets / document"),
        ("exact_on_block_targets", "exact, on the block run's own targets"),
        ("block", "block, {blocks} / document"))
"""(summary key, row label) of the protocol runs a summary may hold."""


def per_document(row: dict) -> str:
    """Targets per document, as a whole number where it is one (``8``), else one decimal."""
    per = row["targets"] / row["docs"]
    return f"{per:.0f}" if per == int(per) else f"{per:.1f}"


def alpha(row: dict, metric: str) -> str:
    """``0.425 [0.389, 0.466]``: the exponent and its interval, 3 decimals."""
    lo, hi = row[f"alpha_{metric}_ci"]
    return f"{row[f'alpha_{metric}']:.3f} [{lo:.3f}, {hi:.3f}]"


def run_id(summary_dir: str, key: str, row: dict) -> str:
    """The results file a row was fitted from, as ``FOLDER/FILE``: the one it reused, else the summary's own."""
    path = Path(row["reused"]) if row.get("reused") else Path(summary_dir) / f"{key}.nc"
    return f"{path.parent.name}/{path.name}"


def table_rows(name: str, summary: dict, seen: set[str]) -> list[str]:
    """The Markdown rows of one summary's protocol runs whose results file is not in ``seen`` (added)."""
    rows = []
    for key, label in RUNS:
        row = summary.get(key)
        if row is None or run_id(name, key, row) in seen:
            continue
        seen.add(run_id(name, key, row))
        text = label.format(per=per_document(row), blocks=f"{per_document(row)} targets in blocks")
        rows.append(f"| {name}: {text} | {row['targets']:,} | {row['forward_tokens']:,} | {alpha(row, 'tv')} | "
                    f"{alpha(row, 'kl')} |")
    return rows


def differences(name: str, summary: dict) -> list[str]:
    """One line per paired difference of exponents in the summary, 3 decimals."""
    lines = []
    for key in sorted(k for k in summary if k.startswith("alpha_") and "difference" in k):
        d = summary[key]
        lo, hi = d["ci"]
        what = "on the same targets" if key.endswith("same_targets") else "on their own targets"
        metric = key.split("_")[1].upper()
        lines.append(f"{name}: α_{metric} block − exact {what}: {d['value']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                     f" ({'agree' if d['agree'] else 'differ'})")
    return lines


def width_models(name: str, summary: dict) -> list[str]:
    """The design-width model W² = a + b/m per metric, and the equal-width ratio it gives."""
    lines = []
    for metric in ("tv", "kl"):
        fixed = summary.get(f"fixed_documents_{metric}")
        if fixed:
            lines.append(f"{name}: α_{metric.upper()} widths: W² = {fixed['a']:.2g} + {fixed['b']:.3g}/m; exact needs "
                         f"m* = {fixed['m_star']:.1f} targets / document for the block's width, costing {fixed['ratio']:.1f}x "
                         f"the block's forward tokens")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="+", help="summary.json files of protocol_efficiency.py runs")
    args = ap.parse_args(argv)
    loaded = []
    for path in map(Path, args.summaries):
        if not path.is_file():
            sys.exit(f"error: {path}: no such summary (run benchmarks/protocol_efficiency.py first)")
        loaded.append((path.parent.name, json.loads(path.read_text())))
    print("| run: protocol | targets | forward tokens | α_TV (95 % CI) | α_KL (95 % CI) |")
    print("|---|---|---|---|---|")
    seen: set[str] = set()
    for name, summary in loaded:
        for row in table_rows(name, summary, seen):
            print(row)
    print()
    for name, summary in loaded:
        for line in differences(name, summary) + width_models(name, summary):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
