"""The certify summary: statistics of a results file beside the paper's figures, as a dict (for
``--json``), as printed text (one renderer, :func:`truncsens.report.tables.render_table`), and two figures
(reliability: coverage against nominal 1 − δ; scatter: certificate against true error).

Paper figures (P. Xie, arXiv 2607.21475): coverage 96.9 / 97.2 / 97.7 % at budgets of 12.5 / 25 /
50 % of the context (nominal 95 %), Spearman(certificate, error) > 0.94, no accuracy cost against
deterministic eviction at equal budget. Verdicts are fixed rules, set before looking at any result:
coverage holds when the Wilson interval reaches 1 − δ; Spearman holds when the estimate exceeds
0.94; "no accuracy cost" holds when the document-clustered mean of KL(poisson) − KL(topk) is not
above 0 by more than two standard errors.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from truncsens.certificates.statistics import coverage, mean_by_documents, reliability, spearman_by_documents
from truncsens.report.tables import Column, fmt_estimate, fmt_num, render_table

PAPER_COVERAGE = {12.5: 0.969, 25.0: 0.972, 50.0: 0.977}
PAPER_SPEARMAN = 0.94


def _records(ds, policy: str, budget: int | None = None) -> dict[str, np.ndarray]:
    sel = ds.sel(policy=policy) if budget is None else ds.sel(policy=policy, budget=budget)
    return {v: sel[v].values for v in ("attn_error", "attn_norm", "radius_eb", "radius_normal", "attn_variance",
                                       "value_range", "n_random", "has_tail")}


def summarize(ds, n_boot: int = 200, seed: int = 0) -> dict:
    """The summary of a certify results Dataset (see the module docstring for the verdict rules)."""
    delta = float(ds.attrs["delta"])
    N = int(ds.attrs["reference_context"])
    doc = np.asarray(ds["doc"].values, dtype=str)
    policies = [str(p) for p in ds["policy"].values]
    budgets = []
    floor_rel = float(ds.attrs.get("error_floor_relative", 0.0) or 0.0)  # 0: a file from before the floor
    for k in (int(b) for b in ds["budget"].values):
        r = _records(ds, "poisson", k)
        tail = r["has_tail"] > 0  # [target, layer, head]
        floor = floor_rel * r["attn_norm"]
        eb, normal = np.where(tail, r["radius_eb"], np.nan), np.where(tail, r["radius_normal"], np.nan)
        row = {"budget": k, "percent": 100 * k / N,
               "coverage_eb": coverage(r["attn_error"], eb, 0.95, floor, doc, n_boot, seed),
               "coverage_normal": coverage(r["attn_error"], normal, 0.95, floor, doc, n_boot, seed),
               "coverage_eb_by_layer": [coverage(r["attn_error"][:, l], eb[:, l], 0.95, floor[:, l])
                                        for l in range(eb.shape[1])],
               "spearman_eb": spearman_by_documents(r["radius_eb"], r["attn_error"], doc, n_boot, seed),
               "median_relative_error": {}, "kl": {}}
        for p in policies:
            q = _records(ds, p, k)
            row["median_relative_error"][p] = float(np.nanmedian(q["attn_error"] / q["attn_norm"]))
            row["kl"][p] = mean_by_documents(ds["kl"].sel(policy=p, budget=k).values, doc)
        if "topk" in policies:
            diff = ds["kl"].sel(policy="poisson", budget=k).values - ds["kl"].sel(policy="topk", budget=k).values
            row["kl_poisson_minus_topk"] = mean_by_documents(diff, doc)
        paper = PAPER_COVERAGE.get(round(row["percent"], 1))
        row["paper_coverage"] = paper
        cov = row["coverage_eb"]
        row["verdict_coverage"] = "holds" if cov["ci"][1] >= 1 - delta else "fails (below nominal)"
        d = row.get("kl_poisson_minus_topk")
        row["verdict_no_accuracy_cost"] = None if d is None else (
            "holds" if not (d["mean"] - 2 * (d["se"] if math.isfinite(d["se"]) else 0) > 0) else "fails (poisson worse)")
        budgets.append(row)
    pooled = _records(ds, "poisson")
    spearman = spearman_by_documents(np.moveaxis(pooled["radius_eb"], 0, 0), pooled["attn_error"], doc, n_boot, seed)
    measured = ds["attn_floor_error"].values if "attn_floor_error" in ds else None
    return {
        "model": ds.attrs.get("model"), "corpus": ds.attrs.get("corpus"), "reference_context": N, "delta": delta,
        "design": ds.attrs.get("design", "one design shared by every layer and head (a file from before per-head designs)"),
        "floor": {"declared_relative": floor_rel,
                  "measured_relative_median": float(np.nanmedian(measured)) if measured is not None else None,
                  "measured_relative_max": float(np.nanmax(measured)) if measured is not None else None},
        "n_targets": int(ds.sizes["target"]), "n_docs": len(set(doc)), "budgets": budgets,
        "auc": failure_aucs(ds, n_boot, seed),
        "spearman_eb_pooled": spearman,
        "verdict_spearman": "holds" if spearman["rho"] > PAPER_SPEARMAN else f"fails (paper: > {PAPER_SPEARMAN})",
        "reliability": reliability({k: v for k, v in pooled.items()}, floor=floor_rel * pooled["attn_norm"]),
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


def format_summary(s: dict) -> str:
    """Printed tables of :func:`summarize`."""
    fl = s["floor"]
    measured = ("" if fl["measured_relative_median"] is None else
                f"; measured full-cache difference from float64: median {fmt_num(fl['measured_relative_median'], 2)}, "
                f"max {fmt_num(fl['measured_relative_max'], 2)}")
    lines = [f"certify: {s['model']} on {s['corpus']}, N = {s['reference_context']}, {s['n_targets']} targets from "
             f"{s['n_docs']} documents, delta = {s['delta']:g} (nominal coverage {100 * (1 - s['delta']):.1f}%)",
             f"design: {s['design']}",
             f"floor: records with ||o^-o|| <= {fmt_num(fl['declared_relative'], 3)} ||o|| are at the floor, counted apart "
             f"and left out of coverage{measured}", ""]
    cols = [Column("budget", ">"), Column("% of N", ">"), Column("coverage EB [Wilson]", ">"), Column("[doc bootstrap]", ">"),
            Column("paper", ">"), Column("verdict"), Column("coverage normal", ">"), Column("Spearman EB [doc CI]", ">"),
            Column("records", ">"), Column("at floor", ">")]
    rows = []
    for b in s["budgets"]:
        sp, cov = b["spearman_eb"], b["coverage_eb"]
        doc_ci = f"[{100 * cov['doc_ci'][0]:.1f}, {100 * cov['doc_ci'][1]:.1f}]" if math.isfinite(cov["doc_ci"][0]) else "-"
        rows.append([str(b["budget"]), f"{b['percent']:.1f}", _pct(cov), doc_ci,
                     f"{100 * b['paper_coverage']:.1f}%" if b["paper_coverage"] else "-", b["verdict_coverage"],
                     _pct(b["coverage_normal"]), f"{fmt_num(sp['rho'], 3)} [{fmt_num(sp['ci'][0], 3)}, {fmt_num(sp['ci'][1], 3)}]",
                     str(cov["n"]), str(cov["n_at_floor"])])
    lines.append(render_table(cols, rows))
    if s["budgets"]:
        n_layers = len(s["budgets"][0]["coverage_eb_by_layer"])
        cols = [Column("budget", ">")] + [Column(f"layer {l}", ">") for l in range(n_layers)]
        rows = [[str(b["budget"])] + [f"{100 * c['rate']:.1f}%" if c["n"] else "-" for c in b["coverage_eb_by_layer"]]
                for b in s["budgets"]]
        lines += ["", "coverage EB by layer (records at the floor left out)", render_table(cols, rows)]
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
    lines += ["", "reliability (all budgets): nominal -> coverage EB / normal"]
    lines += [f"  {100 * r['nominal']:.0f}% -> {_pct(r['eb'])} / {_pct(r['normal'])}" for r in s["reliability"]]
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
    nominal = [r["nominal"] for r in rel]
    ax.plot(nominal, nominal, "k:", label="nominal")
    ax.plot(nominal, [r["eb"]["rate"] for r in rel], "o-", label="empirical Bernstein")
    ax.plot(nominal, [r["normal"]["rate"] for r in rel], "s-", label="normal")
    ax.set_xlabel("nominal coverage 1 - delta")
    ax.set_ylabel("measured coverage")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.5, 4))
    for k in ds["budget"].values:
        r = _records(ds, "poisson", int(k))
        ok = (r["has_tail"] > 0) & np.isfinite(r["radius_eb"]) & (r["attn_error"] > 0)
        ax.loglog(r["radius_eb"][ok], r["attn_error"][ok], ".", ms=2, alpha=0.5, label=f"budget {int(k)}")
    lim = ax.get_xlim()
    ax.plot(lim, lim, "k:", label="error = radius")
    ax.set_xlabel("certificate radius (EB)")
    ax.set_ylabel("true error ||o^ - o||")
    ax.legend(markerscale=4)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
