"""The certify summary: statistics of a results file beside the paper's figures, as a dict (for
``--json``), as printed text (one renderer, :func:`truncsens.report.tables.render_table`), and two figures
(reliability: coverage against nominal 1 − δ; scatter: certificate against true error).

Paper figures (P. Xie, arXiv 2607.21475): coverage 96.9 / 97.2 / 97.7 % at budgets of 12.5 / 25 /
50 % of the context (nominal 95 %), Spearman(certificate, error) > 0.94, no accuracy cost against
deterministic eviction at equal budget. Two statements, each with its own coverage over every
record with a random tail, records at the floor included (and counted apart)
(:mod:`truncsens.certificates.arithmetic`): the statistical radius r_EB at δ (``"statements"
"statistical"``: per δ, budget and layer, Wilson intervals), and the emitted certificate
``radius_certificate`` = r_EB + τ·‖ô‖ with its tolerance τ (``"emitted"``, the verdict's coverage, and
its coverage as a function of τ, :data:`~truncsens.certificates.statistics.TOLERANCES`); calibration
gives both at nominal 80 / 90 / 95 / 99 % per budget. Verdicts are fixed rules, set before looking at any result:
coverage holds when the Wilson interval reaches 1 − δ; Spearman holds when the estimate exceeds
0.94; "no accuracy cost" holds when the document-clustered mean of KL(poisson) − KL(topk) is not
above 0 by more than two standard errors.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from truncsens.certificates.arithmetic import bound_relative_of, certificate_records
from truncsens.certificates.draw_report import draws_summary, format_draws
from truncsens.certificates.statistics import (
    TOLERANCES, coverage, coverage_by_tail_mass, mean_by_documents, reliability, spearman_by_documents, tightness, tolerance_curve,
    variance_check,
)
from truncsens.report.tables import Column, fmt_count, fmt_estimate, fmt_num, render_table

PAPER_COVERAGE = {12.5: 0.969, 25.0: 0.972, 50.0: 0.977}
PAPER_SPEARMAN = 0.94


def _records(ds, policy: str, budget: int | None = None) -> dict[str, np.ndarray]:
    return certificate_records(ds, policy, budget)


STATISTICAL = ("||o^ - o|| <= r_EB(delta) with probability >= 1 - delta over the Poisson draw (exact arithmetic); "
               "coverage of r_EB alone")
EMITTED = ("||o^ - o|| <= r_EB(delta) + tau ||o^||: the statistical radius plus a declared tolerance tau relative to "
           "||o^|| (not a bound on the rounding of o^: the error checked is the float64 one)")


def _calibration(r: dict, taus=None, by_layer: bool = False) -> list[dict]:
    """:func:`reliability` of the poisson records ``r`` (JSON-ready: one dict per nominal level)."""
    return reliability({k: r[k] for k in ("attn_error", "attn_variance", "value_range", "n_random", "has_tail",
                                          "arith_bound", "o_hat_norm")}, taus=taus, by_layer=by_layer)


def _statements(budgets: list[dict], pooled: list[dict], tau: float) -> dict:
    """The two statements of the module docstring, each with its coverage per δ (pooled over budgets
    and per budget), r_EB's per layer, and the emitted certificate's over τ (at every δ)."""
    def per_delta(name: str) -> list[dict]:
        return [{"delta": p["delta"], "nominal": p["nominal"], "coverage": p[name],
                 "by_budget": [{"budget": b["budget"], "coverage": b["calibration"][i][name],
                                "by_layer": b["calibration"][i][f"{name}_by_layer"]} for b in budgets]}
                for i, p in enumerate(pooled)]

    return {"statistical": {"says": STATISTICAL, "radius": "radius_eb", "by_delta": per_delta("eb")},
            "emitted": {"says": EMITTED, "radius": "radius_certificate", "tolerance_relative": tau,
                        "tolerance_is": "a declared tolerance (64 eps of the run's dtype), not a rounding bound",
                        "by_delta": per_delta("certificate"),
                        "tolerance_curve_by_delta": [{"delta": p["delta"], "curve": p["tolerance_curve"]} for p in pooled]}}


def summarize(ds, n_boot: int = 200, seed: int = 0) -> dict:
    """The summary of a certify results Dataset (see the module docstring for the verdict rules)."""
    delta = float(ds.attrs["delta"])
    N = int(ds.attrs["reference_context"])
    doc = np.asarray(ds["doc"].values, dtype=str)
    policies = [str(p) for p in ds["policy"].values]
    budgets = []
    oracle_norm = False
    tau = bound_relative_of(ds)
    taus = (*TOLERANCES, tau)
    for k in (int(b) for b in ds["budget"].values):
        r = _records(ds, "poisson", k)
        oracle_norm = r["oracle_norm"]
        tail = r["has_tail"] > 0  # [target, layer, head]
        floor = r["arith_bound"]  # b·||o^||, the arithmetic bound of each record
        eb, normal = np.where(tail, r["radius_eb"], np.nan), np.where(tail, r["radius_normal"], np.nan)
        cert = np.where(tail, r["radius_certificate"], np.nan)
        row = {"budget": k, "percent": 100 * k / N,
               "coverage_certificate": coverage(r["attn_error"], cert, 0.95, floor, doc, n_boot, seed, statistical=eb),
               "coverage_eb": coverage(r["attn_error"], eb, 0.95, floor, doc, n_boot, seed),
               "coverage_normal": coverage(r["attn_error"], normal, 0.95, floor, doc, n_boot, seed),
               "coverage_certificate_by_layer": [coverage(r["attn_error"][:, l], cert[:, l], 0.95, floor[:, l])
                                                 for l in range(eb.shape[1])],
               "coverage_eb_by_layer": [coverage(r["attn_error"][:, l], eb[:, l], 0.95, floor[:, l])
                                        for l in range(eb.shape[1])],
               "tolerance_curve": tolerance_curve(r["attn_error"], eb, r["o_hat_norm"], taus),
               "tightness_certificate": tightness(cert, r["attn_error"]),
               "calibration": _calibration(r, taus, by_layer=True),
               "variance_check": variance_check(r),
               "coverage_eb_by_tail_mass": coverage_by_tail_mass(r, eb),
               "spearman_eb": spearman_by_documents(r["radius_eb"], r["attn_error"], doc, n_boot, seed),
               "median_relative_error": {}, "kl": {}}
        for p in policies:
            q = _records(ds, p, k)
            row["median_relative_error"][p] = float(np.nanmedian(q["attn_error"] / q["attn_norm"]))
            row["kl"][p] = mean_by_documents(ds["kl"].sel(policy=p, budget=k).values, doc)
        if "topk" in policies:
            diff = ds["kl"].sel(policy="poisson", budget=k).values - ds["kl"].sel(policy="topk", budget=k).values
            row["kl_poisson_minus_topk"] = mean_by_documents(diff, doc)
        if (draws := draws_summary(ds, k)) is not None:  # --draws D >= 2 or a corrected --variance
            row["draws"] = draws
        paper = PAPER_COVERAGE.get(round(row["percent"], 1))
        row["paper_coverage"] = paper
        cov = row["coverage_certificate"]
        row["verdict_coverage"] = "holds" if cov["ci"][1] >= 1 - delta else "fails (below nominal)"
        d = row.get("kl_poisson_minus_topk")
        row["verdict_no_accuracy_cost"] = None if d is None else (
            "holds" if not (d["mean"] - 2 * (d["se"] if math.isfinite(d["se"]) else 0) > 0) else "fails (poisson worse)")
        budgets.append(row)
    pooled = _records(ds, "poisson")
    spearman = spearman_by_documents(np.moveaxis(pooled["radius_eb"], 0, 0), pooled["attn_error"], doc, n_boot, seed)
    measured = ds["attn_floor_error"].values if "attn_floor_error" in ds else None
    bound = tau
    reliability_pooled = _calibration(pooled, taus)
    measured_max = float(np.nanmax(measured)) if measured is not None else None
    return {
        "model": ds.attrs.get("model"), "corpus": ds.attrs.get("corpus"), "reference_context": N, "delta": delta,
        "process": ds.attrs.get("certified_process"),  # None: a file from before streaming certificates (prefill-evict)
        "design": ds.attrs.get("design", "one design shared by every layer and head (a file from before per-head designs)"),
        "floor": {"declared_relative": bound,
                  "relative_to": "||o||, oracle (computed on load: this file has no ||o^||)" if oracle_norm else "||o^||",
                  "measured_relative_median": float(np.nanmedian(measured)) if measured is not None else None,
                  "measured_relative_max": measured_max,
                  "measured_above_declared": None if measured_max is None else bool(measured_max > bound)},
        "n_targets": int(ds.sizes["target"]), "n_docs": len(set(doc)), "budgets": budgets,
        "auc": failure_aucs(ds, n_boot, seed),
        "spearman_eb_pooled": spearman,
        "verdict_spearman": "holds" if spearman["rho"] > PAPER_SPEARMAN else f"fails (paper: > {PAPER_SPEARMAN})",
        "reliability": reliability_pooled,
        "statements": _statements(budgets, reliability_pooled, tau),
        "not_measured": ["attribution on a task set built to be lost by eviction (copy and key-value recall) and "
                         "gated recomputation: see truncsens certify-attribution",
                         "time-uniform validity on a generated trajectory: truncsens certify-attribution --trajectory N"],
    }


def failure_aucs(ds, n_boot: int = 200, seed: int = 0) -> dict | None:
    """AUCs of the certificate and of output confidence on this run's own targets (pooled over budgets,
    poisson; bootstrap over documents): for predicting failure, and for telling eviction-caused from
    inherent failures (:mod:`truncsens.certificates.attribution`: failure = wrong top-1 or NLL above
    :data:`~truncsens.certificates.attribution.FAILURE_NLL`; certificate = mean over layers and heads of
    r_EB/||o||). None for files without the output records (written before they existed).

    Returns:
        {"failure": {"certificate", "confidence"}, "attribution": {...}, "n_failures", "n_eviction_caused",
        "n_inherent"}, each AUC as {"value", "ci"}.
    """
    from truncsens.certificates.attribution import by_documents, target_records

    needed = ("argmax_ref", "argmax_kept", "confidence_kept", "confidence_ref")
    if not all(name in ds for name in needed):
        return None
    a = target_records(ds)  # poisson, all budgets stacked (the file has no failure_nll attr: FAILURE_NLL)
    stats = by_documents(a["cert"], a["conf_kept"], a["conf_ref"], a["fail_kept"], a["fail_ref"], a["doc"], n_boot, seed)
    return {"failure": {"certificate": stats["auc_failure_certificate"], "confidence": stats["auc_failure_confidence"]},
            "attribution": {"certificate": stats["auc_attribution_certificate"],
                            "confidence": stats["auc_attribution_confidence"]},
            "n_failures": int(a["fail_kept"].sum()), "n_eviction_caused": int((a["fail_kept"] & ~a["fail_ref"]).sum()),
            "n_inherent": int((a["fail_kept"] & a["fail_ref"]).sum())}


def _pct(c: dict) -> str:
    return f"{100 * c['rate']:.1f}% [{100 * c['ci'][0]:.1f}, {100 * c['ci'][1]:.1f}]" if c["n"] else "-"


def _median(values: list) -> str:
    v = np.asarray(values, float)
    return fmt_num(float(np.nanmedian(v)), 3) if np.isfinite(v).any() else "-"


def _ratio(t: dict) -> str:
    return fmt_num(t["median_ratio"], 3) if t["n"] else "-"


def format_summary(s: dict) -> str:
    """Printed tables of :func:`summarize`."""
    fl = s["floor"]
    measured = ("" if fl["measured_relative_median"] is None else
                f"; measured full-cache difference from float64: median {fmt_num(fl['measured_relative_median'], 2)}, "
                f"max {fmt_num(fl['measured_relative_max'], 2)}")
    lines = [f"certify: {s['model']} on {s['corpus']}, N = {s['reference_context']}, {fmt_count(s['n_targets'], 'target')} from "
             f"{fmt_count(s['n_docs'], 'document')}, delta = {s['delta']:g} (nominal coverage {100 * (1 - s['delta']):.1f}%)",
             *([f"process: {s['process']}"] if s.get("process") else []),
             f"design: {s['design']}",
             f"statement 1, statistical: ||o^ - o|| <= r_EB(delta) with probability >= 1 - delta over the Poisson draw "
             f"(exact arithmetic); its coverage: column 'r_EB alone'",
             f"statement 2, emitted certificate: r_EB + tau ||o^||, tau = {fmt_num(fl['declared_relative'], 3)} relative to "
             f"{fl['relative_to']}, a declared tolerance (64 eps of the dtype), not a bound on the rounding of o^ (the "
             f"error checked is the float64 one); its coverage: column 'certificate', and over tau below; coverage "
             f"counts every record, those with ||o^-o|| <= tau ||o^|| (at the floor) included{measured}"]
    if fl["measured_above_declared"]:
        lines.append("warning: the measured full-cache difference from float64 exceeds the declared arithmetic bound")
    lines.append("")
    cols = [Column("budget", ">"), Column("% of N", ">"), Column("certificate [Wilson]", ">"), Column("[doc bootstrap]", ">"),
            Column("paper", ">"), Column("verdict"), Column("r_EB alone", ">"), Column("coverage normal", ">"),
            Column("Spearman EB [doc CI]", ">"), Column("records", ">"), Column("at floor", ">"),
            Column("at floor, r_EB misses", ">"), Column("radius/error", ">")]
    rows = []
    for b in s["budgets"]:
        sp, cov = b["spearman_eb"], b["coverage_certificate"]
        doc_ci = f"[{100 * cov['doc_ci'][0]:.1f}, {100 * cov['doc_ci'][1]:.1f}]" if math.isfinite(cov["doc_ci"][0]) else "-"
        rows.append([str(b["budget"]), f"{b['percent']:.1f}", _pct(cov), doc_ci,
                     f"{100 * b['paper_coverage']:.1f}%" if b["paper_coverage"] else "-", b["verdict_coverage"],
                     _pct(b["coverage_eb"]), _pct(b["coverage_normal"]),
                     f"{fmt_num(sp['rho'], 3)} [{fmt_num(sp['ci'][0], 3)}, {fmt_num(sp['ci'][1], 3)}]",
                     str(cov["n"]), str(cov["n_at_floor"]), str(cov["n_at_floor_missed_statistical"]),
                     _ratio(b["tightness_certificate"])])
    lines.append(render_table(cols, rows))
    if s["budgets"]:
        levels = [c["nominal"] for c in s["budgets"][0]["calibration"]]
        cols = [Column("budget", ">")] + [Column(f"nominal {100 * q:g}%", ">") for q in levels] + \
               [Column(f"radius/error {100 * q:g}%", ">") for q in levels]
        rows = [[str(b["budget"])] + [_pct(c["certificate"]) for c in b["calibration"]]
                + [_ratio(c["tightness"]) for c in b["calibration"]] for b in s["budgets"]]
        lines += ["", "calibration of statement 2: coverage of the emitted certificate at nominal 1 - delta [Wilson], every record; "
                      "radius/error: median over records with error > 0", render_table(cols, rows)]
        cols = [Column("budget", ">")] + [Column(f"nominal {100 * q:g}%", ">") for q in levels]
        rows = [[str(b["budget"])] + [_pct(c["eb"]) for c in b["calibration"]] for b in s["budgets"]]
        lines += ["", "calibration of statement 1: coverage of r_EB alone at nominal 1 - delta [Wilson], every record",
                  render_table(cols, rows)]
        taus = [t["tau"] for t in s["budgets"][0]["tolerance_curve"]]
        cols = [Column("budget", ">")] + [Column(f"tau {fmt_num(t, 3)}", ">") for t in taus]
        rows = [[str(b["budget"])] + [_pct(t["coverage"]) for t in b["tolerance_curve"]] for b in s["budgets"]]
        lines += ["", f"coverage of r_EB + tau ||o^|| against the tolerance tau (delta = {s['delta']:g}; tau 0: "
                      f"statement 1, tau {fmt_num(fl['declared_relative'], 3)}: the emitted certificate) [Wilson]",
                  render_table(cols, rows)]
        cols = [Column("budget", ">")] + [Column(f"nominal {100 * q:g}%", ">") for q in levels] + [Column("records", ">")]
        rows = [[str(b["budget"])] + [_pct(c["certificate_above_floor"]) for c in b["calibration"]]
                + [str(b["calibration"][0]["certificate_above_floor"]["n"])] for b in s["budgets"]]
        lines += ["", "calibration over the records above the floor (||o^-o|| > tau ||o^||: the statistical part decides)",
                  render_table(cols, rows)]
        n_layers = len(s["budgets"][0]["coverage_certificate_by_layer"])
        cols = [Column("budget", ">")] + [Column(f"layer {l}", ">") for l in range(n_layers)]
        rows = [[str(b["budget"])] + [f"{100 * c['rate']:.1f}%" if c["n"] else "-" for c in b["coverage_certificate_by_layer"]]
                for b in s["budgets"]]
        lines += ["", "coverage of the certificate by layer (every record)", render_table(cols, rows)]
        rows = [[str(b["budget"])] + [f"{100 * c['rate']:.1f}%" if c["n"] else "-" for c in b["coverage_eb_by_layer"]]
                for b in s["budgets"]]
        lines += ["", "coverage of r_EB alone by layer (every record)", render_table(cols, rows)]
        cols = [Column("budget", ">"), Column("measure", "<")] + [Column(f"layer {l}", ">") for l in range(n_layers)]
        rows = []
        for b in s["budgets"]:
            h = b["variance_check"]["by_head"]
            rows.append([str(b["budget"]), "E[V^]/MSE"] + [_median(x) for x in h["variance_over_mse"]])
            rows.append(["", f"share n < {b['variance_check']['few_tail_keys']}"] + [_median(x) for x in h["share_few_tail_keys"]])
            if "median_tail_mass" in h:
                rows.append(["", "tail mass"] + [_median(x) for x in h["median_tail_mass"]])
                rows.append(["", f"share mass < {fmt_num(b['variance_check']['negligible_tail_mass'], 2)}"]
                            + [_median(x) for x in h["share_negligible_tail_mass"]])
        lines += ["", "variance check, median over heads (E[V^]/MSE: mean V^ over mean ||o^-o||^2, pooled over targets; "
                      "below 1 the variance understates the error; n: kept random keys; tail mass: median share of the "
                      "full-cache attention on the keys drawn at random); per head in --json",
                  render_table(cols, rows)]
    if s["budgets"] and s["budgets"][0].get("coverage_eb_by_tail_mass"):
        t0 = s["budgets"][0]["coverage_eb_by_tail_mass"]["threshold"]
        cols = [Column("budget", ">")] + [Column(f"{h}{w}", ">") for w in (f" < {fmt_num(t0, 2)}", f" >= {fmt_num(t0, 2)}")
                                          for h in ("r_EB alone, mass", "records", "E[V^]/MSE")]
        rows = []
        for b in s["budgets"]:
            c = b["coverage_eb_by_tail_mass"]
            rows.append([str(b["budget"])] + [x for part in ("negligible", "with_mass") for x in (
                _pct(c[part]["coverage"]), str(c[part]["coverage"]["n"]), fmt_num(c[part]["variance_over_mse"], 3))])
        lines += ["", "statement 1 by the tail's attention mass (the share of the full-cache attention on the keys drawn "
                      "at random) [Wilson]", render_table(cols, rows)]
    lines += format_draws(s["budgets"])
    sp = s["spearman_eb_pooled"]
    lines += ["", f"Spearman(radius EB, error), all budgets: {fmt_num(sp['rho'], 3)} [{fmt_num(sp['ci'][0], 3)}, "
                  f"{fmt_num(sp['ci'][1], 3)}] (paper > {PAPER_SPEARMAN}): {s['verdict_spearman']}", ""]
    policies = list(s["budgets"][0]["kl"]) if s["budgets"] else []
    cols = [Column("budget", ">")] + [Column(f"med ||o^-o||/||o|| {p}", ">") for p in policies] + \
           [Column(f"KL {p}", ">") for p in policies] + [Column("no accuracy cost vs topk")]
    rows = [[str(b["budget"])] + [fmt_num(b["median_relative_error"][p], 3) for p in policies]
            + [fmt_num(b["kl"][p]["mean"], 3) for p in policies] + [str(b["verdict_no_accuracy_cost"] or "-")]
            for b in s["budgets"]]
    lines.append(render_table(cols, rows))
    lines += ["", "reliability (all budgets): nominal -> coverage of the certificate / r_EB alone / normal"]
    lines += [f"  {100 * r['nominal']:.0f}% -> {_pct(r['certificate'])} / {_pct(r['eb'])} / {_pct(r['normal'])}"
              for r in s["reliability"]]
    auc = s.get("auc")
    if auc:
        lines += ["", f"AUC on these targets (poisson, all budgets; {auc['n_failures']} failures: {auc['n_eviction_caused']} "
                      f"eviction-caused, {auc['n_inherent']} inherent) [doc bootstrap]",
                  f"  predicting failure:        certificate {fmt_estimate(auc['failure']['certificate'])}, "
                  f"-confidence {fmt_estimate(auc['failure']['confidence'])} (paper: confidence better)",
                  f"  eviction-caused vs inherent: certificate {fmt_estimate(auc['attribution']['certificate'])}, "
                  f"-confidence {fmt_estimate(auc['attribution']['confidence'])} (paper: 0.75 / 0.73, confidence at or below chance)"]
    lines += ["", "not measured here: " + "; ".join(s["not_measured"])]
    return "\n".join(lines)


def certify_figure_paths(stem: str | Path) -> list[Path]:
    """The files :func:`save_figures` writes: ``<stem>-reliability.png`` and ``<stem>-scatter.png``."""
    stem = Path(stem)
    return [stem.with_name(stem.name + "-reliability.png"), stem.with_name(stem.name + "-scatter.png")]


def save_figures(ds, summary: dict, stem: str | Path) -> list[Path]:
    """``<stem>-reliability.png`` and ``<stem>-scatter.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(stem)
    paths = certify_figure_paths(stem)
    fig, ax = plt.subplots(figsize=(4.5, 4))
    rel = summary["reliability"]
    nominal = np.array([r["nominal"] for r in rel])
    ax.plot(nominal, nominal, "k:", label="nominal")
    for i, b in enumerate(summary["budgets"]):  # the certificate per budget, Wilson intervals as bars
        c = [x["certificate"] for x in b["calibration"]]
        rate = np.array([x["rate"] for x in c])
        err = np.abs(np.array([x["ci"] for x in c]).T - rate)
        ax.errorbar(nominal + 0.003 * (i - 1), rate, yerr=err, fmt="o-", ms=3, capsize=2,
                    label=f"certificate, budget {b['budget']}")
    ax.plot(nominal, [r["eb"]["rate"] for r in rel], "s--", ms=3, label="r_EB alone, all budgets")
    for j, t in enumerate(rel[0].get("tolerance_curve", [])[1:]):  # tau = 0 is r_EB alone, drawn above
        ax.plot(nominal, [r["tolerance_curve"][j + 1]["coverage"]["rate"] for r in rel], ":", lw=1,
                label=f"r_EB + tau ||o^||, tau {t['tau']:.2g}")
    ax.plot(nominal, [r["normal"]["rate"] for r in rel], "^--", ms=3, label="normal, all budgets")
    ax.set_xlabel("nominal coverage 1 - delta")
    ax.set_ylabel("measured coverage")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.5, 4))
    for k in ds["budget"].values:
        r = _records(ds, "poisson", int(k))
        ok = (r["has_tail"] > 0) & np.isfinite(r["radius_certificate"]) & (r["attn_error"] > 0)
        ax.loglog(r["radius_certificate"][ok], r["attn_error"][ok], ".", ms=2, alpha=0.5, label=f"budget {int(k)}")
    lim = ax.get_xlim()
    ax.plot(lim, lim, "k:", label="error = radius")
    ax.set_xlabel("certificate radius r_EB + tau ||o^||")
    ax.set_ylabel("true error ||o^ - o||")
    ax.legend(markerscale=4)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
