"""The printed table of :attr:`truncsens.report.policy_comparison.PolicyComparison.against`: each policy's
power-law exponent in the budget k beside that of one policy of the same targets (``compare-policies
--paired-against``), their paired difference and the verdict."""

from __future__ import annotations

from truncsens.report.tables import Column, fmt_interval, fmt_level, fmt_num, render_table

VERDICTS = {"faster": "faster decay (the interval lies above 0)", "slower": "slower decay (the interval lies below 0)",
            "same": "same decay (the interval contains 0)"}


def format_exponents_against(rows: list[dict], level: float) -> str:
    """Per policy and metric: alpha, alpha of the policy paired against, the difference with its paired
    interval, and the verdict in words (:data:`VERDICTS`; ``-`` without an interval)."""
    against = rows[0]["against"]
    lines = [f"power-law exponent in k against {against} ({fmt_level(level)} interval; paired: the same targets, both "
             "refitted on each document resample)"]
    ranges = {tuple(r["fit_range"]) for r in rows if r.get("fit_range")}
    if len(ranges) == 1:
        lo, hi = ranges.pop()
        lines.append(f"  both fitted over budgets {lo}..{hi}: the {against} fit's range")
    columns = [Column("policy", ">", 20), Column("metric", ">", 6), Column("alpha", "<", 0), Column(f"alpha({against})"),
               Column(f"alpha - alpha({against})"), Column("verdict")]
    cells, skipped = [], []
    for r in rows:
        if r["status"] != "ok":
            skipped.append(f"  {r['policy']:>20} {r['metric']:>6}  skipped: {r['reason']}")
            continue
        cells.append([r["policy"], r["metric"], f"{fmt_num(r['alpha'], 4)}{fmt_interval(r['alpha_ci'], 3)}",
                      f"{fmt_num(r['against_alpha'], 4)}{fmt_interval(r['against_alpha_ci'], 3)}",
                      f"{r['difference']:+.3g}{fmt_interval(r['difference_ci'], 3)}", VERDICTS.get(r["verdict"], "-")])
    if cells:
        lines.append(render_table(columns, cells, rule=False))
    return "\n".join(lines + skipped)
