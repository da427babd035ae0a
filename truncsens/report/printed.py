"""The printed reports of ``show``, ``fit``, ``recommend-window`` and ``compare-policies``, all
drawn with :func:`truncsens.report.tables.render_table`. Input: plain rows and dicts (a fit file dict,
:class:`truncsens.budget.recommend.Recommendation` objects, a
:class:`truncsens.report.policy_comparison.PolicyComparison`); output: text. No file access.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Sequence

from truncsens.budget.windows import format_tokens, format_tokens_short
from truncsens.corpora.local import skipped_files_note
from truncsens.report.exponents_against import format_exponents_against
from truncsens.report.tables import (
    Column, fmt_bytes, fmt_count, fmt_estimate, fmt_interval, fmt_level, fmt_num, render_table,
)

if TYPE_CHECKING:  # type hints only
    from truncsens.report.policy_comparison import PolicyComparison
    from truncsens.budget.recommend import Recommendation


# ----------------------------------------------------------------------------- show


def format_results_header(file: str, attrs: dict, n_targets: int, contexts: tuple[int, int] | None = None) -> str:
    """The first line of ``show``: model, corpus, semantics, positions, sinks, N, number of targets, the
    protocol when it is not the exact one (block: the longest block, K fraction and cap, and the
    file's ``contexts``, its shortest and longest actual reference context, when given), and how
    sliding-window layers applied their windows (:func:`sliding_window_note`) when the model has some."""
    a = attrs
    return (f"{file}: model {a['model']}, corpus {a['corpus']} ({a['domain']}), semantics {a['semantics']}, "
            f"positions {a['positions']}, sinks {a['n_sink']}, reference context {a['reference_context']}, "
            f"{fmt_count(n_targets, 'target')}" + protocol_note(a, contexts) + sliding_window_note(a))


def not_measured_note(attrs: dict) -> str:
    """``show``'s second line: ``"not measured: 3 corpus files skipped (3 empty), 3 of 67 documents too
    short for N=64"`` from the attrs ``files_skipped``, ``n_docs_skipped_short`` and
    ``n_docs_checked``; ``""`` when nothing was left out (or the file predates those attrs)."""
    parts = [skipped_files_note(attrs.get("files_skipped"))]
    short, checked = attrs.get("n_docs_skipped_short"), attrs.get("n_docs_checked")
    if isinstance(short, numbers.Integral) and short > 0:
        parts.append(f"{short} of {checked} documents too short for N={attrs.get('reference_context')}")
    parts = [p for p in parts if p]
    return "not measured: " + ", ".join(parts) if parts else ""


def sliding_window_note(attrs: dict) -> str:
    """``""`` for a model without sliding-window layers (no ``sliding_window_distance`` attr, also files
    from before it); else how their windows were applied, and what that means for kept sinks."""
    distance = attrs.get("sliding_window_distance")
    if distance is None:
        return ""
    sinks = int(attrs.get("n_sink", 0) or 0)
    if distance == "original_position":
        return ("; sliding-window layers apply their window W by original-position distance"
                + (f" (the {sinks} sinks are seen only within W of the query)" if sinks else ""))
    return "; sliding-window layers apply their window W by reindexed-position distance (as a fresh forward of the kept tokens)"


def protocol_note(attrs: dict, contexts: tuple[int, int] | None = None) -> str:
    """``""`` for the exact protocol (also files from before the attr); for the block protocol
    ``"; protocol block (...)"`` with its parameters (:mod:`truncsens.engine.block.runs`): windows per
    pass for a re-encode sweep, the shared stream or prefill for a streaming / prefill_evict policy
    sweep; the file's own shortest and longest reference contexts ``contexts`` (none for a file without
    targets)."""
    if attrs.get("protocol", "exact") == "exact":
        return ""
    B = attrs.get("block_length")
    span = f"{contexts[0]}..{contexts[1]}" if contexts else "none"
    blocks = f"blocks of up to {B if B is not None else '?'} consecutive targets"
    from truncsens.engine.semantics import SEMANTICS  # the semantics named in the file (imported only for block files)

    passes = getattr(SEMANTICS.get(attrs.get("semantics", "")), "block_passes", None)
    if passes:  # a policy sweep: budgets are exact, one pass serves the whole block
        return f"; protocol {attrs['protocol']} ({blocks}, {passes}; reference contexts {span})"
    return (f"; protocol {attrs['protocol']} ({blocks}, "
            f"K = max(1, min({attrs.get('block_size', '?')}, floor({attrs.get('block_fraction', '?')} w))) per pass; "
            f"actual windows w..w+K-1, reference contexts {span})")


def format_summary(rows: list[dict], sweep: str) -> str:
    """Rows of :func:`truncsens.report.summary.summarize` as text, one block per ([layer,] [policy,] metric).

    A block whose rows hold infinite or NaN values gets the columns ``n_inf`` and ``n_nan`` beside
    ``n`` and a note under it: a mean over a set with +inf is printed as ``inf``, never as the
    mean of the finite values alone.
    """
    base = [Column(sweep, ">", 8), Column("n", ">", 6)]
    stats = [Column("mean", ">", 11), Column("± se(doc)", ">", 10), Column("median", ">", 11), Column("p90", ">", 11),
             Column("p99", ">", 11)]
    blocks: list[tuple[str, list[dict]]] = []
    key = None
    for r in rows:
        k = (r.get("layer"), r.get("policy"), r["metric"])
        if k != key:
            key = k
            where = ", ".join(f"{d} {r[d]}" for d in ("layer", "policy") if r.get(d) is not None)
            blocks.append((r["metric"] + (f"  ({where})" if where else ""), []))
        blocks[-1][1].append(r)
    out = []
    for title, block in blocks:
        nonfinite = any(r.get("n_inf", 0) or r.get("n_nan", 0) for r in block)
        columns = base + ([Column("n_inf", ">", 6), Column("n_nan", ">", 6)] if nonfinite else []) + stats
        cells = []
        for r in block:
            counts = [str(r.get("n_inf", 0)), str(r.get("n_nan", 0))] if nonfinite else []
            cells.append([str(r[sweep]), str(r["n"]), *counts, f"{r['mean']:.5g}", f"{r['se']:.2g}", f"{r['median']:.5g}",
                          f"{r['p90']:.5g}", f"{r['p99']:.5g}"])
        text = f"{title}\n" + render_table(columns, cells, sep=" ", rule=False, fit=False)
        if nonfinite:
            text += ("\nnote: n counts the values that are not NaN, n_inf of them infinite (KL = inf where q = 0 < p): "
                     "the mean of a set with +inf is inf; NaN values (n_nan) are left out")
        out.append(text)
    return "\n\n".join(out)


def format_results_summary(summary: Any) -> str:
    """What ``show`` prints for a :class:`truncsens.report.summary.ResultsSummary` (typed loosely: summary imports
    this module): :func:`format_results_header`, then :func:`format_summary`."""
    skipped = not_measured_note(summary.attrs)
    return (format_results_header(summary.file, summary.attrs, summary.n_targets, summary.contexts) + "\n"
            + (f"{skipped}\n" if skipped else "")
            + format_summary(summary.rows, summary.sweep))


# ----------------------------------------------------------------------------- fit


def _fit_row(f: dict) -> list[str]:
    if f["status"] == "not_converged":
        shown = "  ".join(f"{k}={fmt_num(v['value'])}" for k, v in f["params"].items() if k != "rate")
        params, mae = f"NOT CONVERGED (not used): {shown}; {f.get('optimizer') or f['reason']}", ""
    elif f["status"] != "ok":
        params, mae = f"skipped: {f['reason']}", ""
    else:
        params = "  ".join(f"{k}={fmt_num(v['value'])}{fmt_interval(v['ci'], 3)}" for k, v in f["params"].items() if k != "rate")
        m = f["extrapolation_mae"]
        mae = "-" if m is None else fmt_estimate(m)
    return [f["label"], f["metric"], f["family"], params, mae, fmt_num(f.get("aic"), 5)]


def _comparison_line(c: dict) -> str:
    head = f"{c['label']} {c['metric']}"
    if c["winner"] is None:
        return (f"{head}: no comparison (no held-out windows, and fewer than two families "
                "with residual degrees of freedom for AIC)")
    fac = c["factor"]
    if c["basis"] != "extrapolation":
        return (f"{head}: no held-out windows; {c['winner']} has the lower AIC "
                f"(relative likelihood of {c['runner_up']}: 1/{fmt_num(fac['value'], 3)})")
    if c.get("undecided"):  # the ratio's interval contains 1: the data do not tell the two apart
        text = (f"{head}: undecided between {c['winner']} and {c['runner_up']} in held-out extrapolation "
                f"(error ratio {fmt_num(fac['value'], 3)}{fmt_interval(fac['ci'], 3)} contains 1)")
    elif fac["value"] is not None and fac["value"] < 1.005:  # e.g. power_floor with a zero floor = power
        text = (f"{head}: {c['winner']} and {c['runner_up']} tie in held-out extrapolation "
                f"(error ratio {fmt_num(fac['value'], 3)}{fmt_interval(fac['ci'], 3)})")
    else:
        text = (f"{head}: {c['winner']} wins held-out extrapolation; {c['runner_up']}'s log error is "
                f"{fmt_num(fac['value'], 3)}x larger{fmt_interval(fac['ci'], 3)}")
    pve = c.get("power_vs_exponential")
    if pve and {c["winner"], c["runner_up"]} != {"power", "exponential"}:
        text += f"; exponential/power error ratio {fmt_num(pve['value'], 3)}{fmt_interval(pve['ci'], 3)}"
        if pve.get("undecided"):
            text += " (undecided: contains 1)"
    return text


def _curve_line(c: dict) -> str:
    hold = c["holdout_range"]
    excl = {m: v["excluded_points"] for m, v in c["metrics"].items() if v["excluded_points"]}  # reasons: the curve's notes
    points = next(iter(c["metrics"].values()), {}).get("points", [])
    held = hold and any(hold[0] <= p <= hold[1] for p in points)
    return (f"{c['label']}: model {c['provenance'].get('model', '?')}, N={c['reference_context']}, {fmt_count(c['n_docs'], 'document')}, "
            f"{fmt_count(c['n_targets'], 'target')}; fit {c['sweep']}s {c['fit_range'][0]}..{c['fit_range'][1]}, held out "
            + (f"{hold[0]}..{hold[1]}" if held else f"none (no {c['sweep']} in {hold[0]}..{hold[1]})" if hold else "none")
            + (f"; excluded (zero, noise floor, infinite or no mean): {excl}" if excl else "")
            + _protocol_words(c))


def _protocol_words(c: dict) -> str:
    """How a block-protocol curve was fitted: at the mean actual window (budget) of each bin when
    the file records actual windows; budgets of a streaming / prefill_evict policy sweep are exact."""
    protocol = c["provenance"].get("protocol", "exact")
    if protocol == "exact":
        return ""
    if any("fit_x" in m for m in c["metrics"].values()):
        return f"; protocol {protocol}, fitted at the mean actual {c['sweep']} of each bin"
    return f"; protocol {protocol} (exact {c['sweep']}s)"


def format_fit_report(doc: dict) -> str:
    """A readable report of a fit file dict (:func:`truncsens.fits.fit_file.fit_document`), several files side by side:
    the table of fits, the family comparisons, alpha_kl / alpha_tv, and the curves' settings."""
    s = doc["settings"]
    pct = fmt_level(s["ci_level"])
    columns = [Column("curve"), Column("metric"), Column("family"), Column(f"parameters ({pct} CI)"),
               Column(f"held-out log MAE ({pct} CI)"), Column("AIC")]
    lines = [render_table(columns, [_fit_row(f) for f in doc["fits"]]), ""]
    lines += [_comparison_line(c) for c in doc["comparisons"]]
    lines += [f"{r['label']}: alpha_kl / alpha_tv = {fmt_num(r['value'], 4)}{fmt_interval(r['ci'], 4)}"
              for r in doc.get("alpha_ratio_kl_tv", [])]
    lines.append("")
    for c in doc["curves"]:
        lines.append(_curve_line(c))
        lines += [f"  note: {c['label']}: {n}" for n in c.get("notes", [])]  # the CLI prints notes on stderr
    lines.append(f"intervals: {pct} percentile bootstrap over documents, {s['bootstrap']} resamples, seed {s['seed']}"
                 if s["bootstrap"] else "intervals: none (--bootstrap 0)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- recommend-window


def _raw_interval(ci: Sequence[float] | None) -> str:
    """`` [lo, hi]`` with 4 significant digits, infinities and NaN printed as they are (w(eps) may be inf)."""
    return "" if ci is None else f" [{ci[0]:.4g}, {ci[1]:.4g}]"


def _law_cell(r: Recommendation) -> str:
    if r.law_status == "ok":
        return f"{r.w_law:.4g}{_raw_interval(r.w_law_ci)}"
    return {"not_reachable": "inf (eps not reachable with this law)", "not_converged": "- (law not converged)",
            "not_fitted": "- (no law fitted)"}.get(r.law_status, "-")


def _token_interval(ci: Sequence[float] | None) -> str:
    """`` [27.9k, 167k]``: a window interval with 3 significant digits (:func:`format_tokens_short`)."""
    return "" if ci is None else f" [{format_tokens_short(ci[0])}, {format_tokens_short(ci[1])}]"


def _window_cell(r: Recommendation) -> str:
    """The recommended window with its interval and basis; a window (+ sinks) beyond the context it
    could be measured in is no recommendation: ``> N = 1024 (law extrapolates 66,662 [27.9k, 167k])``."""
    if r.window is None:
        return "inf (not reachable)" if r.basis == "law" else "- (not measured)"
    shown = f"{format_tokens(r.window)}{_token_interval(r.window_ci)}"
    if r.within_context:
        return f"{shown} {r.basis}"
    sinks = f" + {r.n_sink} sinks" if r.n_sink else ""
    return f"> N = {r.context_limit} ({'law extrapolates' if r.basis == 'law' else r.basis} {shown}{sinks})"


def format_recommendations(recs: Sequence[Recommendation]) -> str:
    """A readable table of w(eps) recommendations, then their warnings and notes.

    Columns: the power law's w(eps) with its interval ("inf" when eps is not reachable with the
    law), the recommended window with its interval and basis ("measured" inside the measured
    range, "law" outside it; ``> N = ...`` with the law's value beside it for a window beyond the
    reference context N, which is no recommendation), the measured window and crossing with its
    interval, and the KV bytes of the recommended window ("-" beyond N). Windows print in full
    below 10^9 tokens and in scientific notation above (:func:`format_tokens`).
    """
    pct = fmt_level(recs[0].level) if recs else "95%"
    columns = [Column("curve"), Column("metric"), Column("eps"), Column(f"w(eps) law [{pct} CI]"),
               Column(f"window [{pct} CI] basis"), Column("measured (crossing [CI])"), Column(f"KV bytes/seq [{pct} CI]")]
    rows = []
    for r in recs:
        meas = "-" if r.measured_window is None else str(r.measured_window)
        if r.measured_crossing is not None:
            meas += f" ({r.measured_crossing:.4g}{_raw_interval(r.measured_crossing_ci)})"
        kv = fmt_bytes(r.kv_bytes if r.within_context else None)  # no memory figure for a window that is no answer
        if r.kv_bytes_ci is not None and r.within_context:
            kv += f" [{fmt_bytes(r.kv_bytes_ci[0])}, {fmt_bytes(r.kv_bytes_ci[1]) if r.kv_bytes_ci[1] is not None else 'inf'}]"
        rows.append([r.label, r.metric, f"{r.eps:g}", _law_cell(r), _window_cell(r), meas, kv])
    lines = [render_table(columns, rows)]
    seen = set()
    for r in recs:
        lines += [f"warning: {r.label} {r.metric} eps={r.eps:g}: {w}" for w in r.warnings]
        for n in r.notes:
            if n.startswith(("eps is outside", "recommended from")):
                lines.append(f"note: {r.label} {r.metric} eps={r.eps:g}: {n}")
            elif (r.label, n) not in seen:
                seen.add((r.label, n))
                lines.append(f"note: {r.label}: {n}")
    lines.append("window: the measured crossing inside the measured range (interval: document bootstrap of the mean curve), "
                 "else w(eps) = (C/eps)^(1/alpha) from the power law (arXiv 2605.25085; interval: document bootstrap of the fit); "
                 "> N: beyond the reference context N no window is measured, so none is recommended")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- compare-policies


def format_comparison(cmp: PolicyComparison) -> str:
    """A readable report of a :class:`truncsens.report.policy_comparison.PolicyComparison`: per metric the mean per
    budget and policy with its interval, the ratio of means, then the power-law fits."""
    pct = fmt_level(cmp.level)
    columns = [Column("budget", ">", 8)] + [Column(p, ">", 30) for p in cmp.policies]
    lines = []
    for metric in cmp.metrics:
        lines.append(f"{metric}: mean per budget ({pct} bootstrap interval over documents)")
        cells = {(r["policy"], r["budget"]): f"{fmt_num(r['mean'])}{fmt_interval(r['ci'], 3)}"
                 + (f" (n_inf {r['n_inf']})" if r.get("n_inf") else "") for r in cmp.table if r["metric"] == metric}
        lines.append(render_table(columns, [[str(k)] + [cells[(p, k)] for p in cmp.policies] for k in cmp.budgets],
                                  rule=False, fit=False))
        rs = [r for r in cmp.ratios if r["metric"] == metric]
        if rs:
            lines.append(f"ratio {rs[0]['numerator']} / {rs[0]['denominator']} of mean {metric}:")
            lines.append(render_table([Column("", ">", 8), Column()], [[str(r["budget"]), fmt_num(r["value"]) + fmt_interval(r["ci"], 3)]
                                                                       for r in rs], header=False, fit=False))
        lines.append("")
    lines.append(f"power-law fits D(k) = C k^-alpha ({pct} interval)")
    for f in cmp.fits:
        if f["status"] == "ok":
            lines.append(f"  {f['policy']:>20} {f['metric']:>6}  alpha = {fmt_num(f['alpha'])}{fmt_interval(f['alpha_ci'], 3)}"
                         f"  C = {fmt_num(f['C'])}  ({f['sweep']}s {f['fit_points'][0]}..{f['fit_points'][-1]})")
        else:
            lines.append(f"  {f['policy']:>20} {f['metric']:>6}  skipped: {f['reason']}")
    if cmp.paired:
        lines += ["", format_span_exponents(cmp)]
    if cmp.against:
        lines += ["", format_exponents_against(cmp.against, cmp.level)]
    lines += [f"note: {n}" for n in cmp.notes]
    return "\n".join(lines)


def span_verdict(row: dict) -> str:
    """The verdict of a paired exponent row in words: ``"recovered (the interval contains 0)"``, ``"differs:
    steeper by 0.29 (+31%)"`` (or shallower), ``"-"`` for no verdict."""
    if row.get("verdict") == "recovered":
        return "recovered (the interval contains 0)"
    if row.get("verdict") == "differs":
        d = row["difference"]
        share = f" ({100 * row['relative']:+.0f}%)" if row.get("relative") is not None else ""
        return f"differs: {'steeper' if d > 0 else 'shallower'} by {fmt_num(abs(d), 3)}{share}"
    return "-"


def format_span_exponents(cmp: PolicyComparison) -> str:
    """The exponents of the recency policies against their recent span beside the truncation exponent
    (:attr:`PolicyComparison.paired`): the span rule of each policy, then per policy and metric both
    exponents, their difference with its paired interval, and the verdict."""
    rows = cmp.paired
    pct = fmt_level(cmp.level)
    paired = all(r["paired"] for r in rows)
    lines = [f"power-law exponent against the recent span s, beside truncation ({pct} interval; "
             + ("paired: the same targets, both refitted on each document resample)" if paired else "not paired)")]
    seen = []
    for r in rows:
        if r["policy"] not in seen:
            seen.append(r["policy"])
            lines.append(f"  {r['policy']}: {r['span_rule']}; the truncation run keeps {r['truncation_sinks']} sinks "
                         "before its windows w")
    ranges = {tuple(r["fit_range"]) for r in rows if r.get("fit_range")}
    if len(ranges) == 1:
        lo, hi = ranges.pop()
        lines.append(f"  both fitted over {lo}..{hi} tokens of the recent past (s, w): the truncation fit's range")
    columns = [Column("policy", ">", 20), Column("metric", ">", 6), Column("alpha(span)", "<", 0), Column("alpha(truncation)"),
               Column("alpha - alpha(truncation)"), Column("verdict")]
    cells, skipped = [], []
    for r in rows:
        name = r["policy"] if r["truncation"] == "truncation" else f"{r['policy']} / {r['truncation']}"
        if r["status"] != "ok":
            skipped.append(f"  {name:>20} {r['metric']:>6}  skipped: {r['reason']}")
            continue
        span = f"{fmt_num(r['alpha'], 4)}{fmt_interval(r['alpha_ci'], 3)} (s {r['fit_points'][0]}..{r['fit_points'][-1]})"
        trunc = (f"{fmt_num(r['truncation_alpha'], 4)}{fmt_interval(r['truncation_alpha_ci'], 3)} "
                 f"(w {r['truncation_fit_points'][0]}..{r['truncation_fit_points'][-1]})")
        diff = f"{r['difference']:+.3g}" + (fmt_interval(r["difference_ci"], 3) if r["paired"] else " (not paired)")
        cells.append([name, r["metric"], span, trunc, diff, span_verdict(r)])
    if cells:
        lines.append(render_table(columns, cells, rule=False))
    return "\n".join(lines + skipped)


def format_draw_spread(cmp: PolicyComparison) -> str:
    """The spread between draws as text, one block per metric (budget rows, policy columns ``sd [min, max]``);
    empty for one draw."""
    if not cmp.spread:
        return ""
    lines = []
    for metric in cmp.metrics:
        lines.append(f"{metric}: spread between {cmp.draws} draws of the mean over targets (sd [min, max])")
        cells = {(r["policy"], r["budget"]): f"{fmt_num(r['sd'], 3)} [{fmt_num(r['min'], 4)}, {fmt_num(r['max'], 4)}]"
                 for r in cmp.spread if r["metric"] == metric}
        columns = [Column("budget", ">", 8)] + [Column(p, ">", 30) for p in cmp.policies]
        lines.append(render_table(columns, [[str(k)] + [cells[(p, k)] for p in cmp.policies] for k in cmp.budgets],
                                  rule=False, fit=False))
    return "\n".join(lines)
