"""The ``truncsens certify-attribution`` summary: statistics of :mod:`truncsens.certificates.attribution`
read from a results file, beside the paper's figures, as a dict (``--json``), printed tables (one
renderer, :func:`truncsens.report.tables.render_table`) and a figure of recomputation curves.

Paper (P. Xie, arXiv 2607.21475): attribution AUC of the certificate 0.75 at 6k tokens and 0.73 at
16k, output confidence at or below chance; certificate-gated recomputation beats random and
confidence-gated; output confidence predicts failure better than the certificate. Verdict rules,
fixed before looking at any result (:func:`truncsens.certificates.attribution.verdict_above`): a claim
"holds" when its bootstrap interval over documents lies on the claimed side (AUC above 0.5, a
difference above 0), "not shown" when only the estimate does, "fails" otherwise. "Confidence at or
below chance" holds when the interval of its attribution AUC reaches down to 0.5.

``"decomposition"`` and the section "where attribution is lost" [ours]: the ORACLE AUCs of the true
error and the output KL beside the certificate's and confidence's, and the realizable score chosen
on development documents, reported on held-out ones
(:func:`truncsens.certificates.attribution_scores.decomposition`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from truncsens.certificates.attribution import (
    GATE_FRACTIONS, PAPER_AUC, by_documents, removal_curves, target_records, verdict_above,
)
from truncsens.certificates.attribution_scores import decomposition
from truncsens.report.tables import Column, fmt_count, fmt_estimate, fmt_num, render_table

CURVE_FRACTIONS = np.linspace(0, 1, 41)


def _counts(ds, policy: str, k: int) -> dict:
    r = target_records(ds, k, policy)
    fk, fr = r["fail_kept"], r["fail_ref"]
    return {"failures": int(fk.sum()), "eviction_caused": int((fk & ~fr).sum()), "inherent": int((fk & fr).sum()),
            "fixed": int((~fk & fr).sum())}


def _flip(stat: dict) -> dict:
    return {"value": -stat["value"], "ci": [-stat["ci"][1], -stat["ci"][0]]}


def _verdicts(stats: dict) -> dict:
    conf = stats["auc_attribution_confidence"]
    lo = conf["ci"][0] if math.isfinite(conf["ci"][0]) else conf["value"]
    at_chance = "holds" if lo <= 0.5 else "fails (confidence separates them)"
    out = {"certificate_attributes": verdict_above(stats["auc_attribution_certificate"], 0.5),
           "confidence_at_chance": "not measurable" if math.isnan(conf["value"]) else at_chance,
           "confidence_predicts_failure_better": verdict_above(_flip(stats["diff_auc_failure"]))}
    for f in GATE_FRACTIONS:
        out[f"gating_beats_random_{f:g}"] = verdict_above(stats[f"diff_removed_random_{f:g}"])
        out[f"gating_beats_confidence_{f:g}"] = verdict_above(stats[f"diff_removed_confidence_{f:g}"])
    return out


def summarize_attribution(ds, n_boot: int = 200, seed: int = 0) -> dict:
    """The summary of an attribution results Dataset (verdict rules in the module docstring).

    Besides each budget and all budgets pooled, ``pooled_by_kind`` repeats the pooled statistics within
    each task kind ("copy", "kv") with its count of eviction-caused failures: when one kind supplies
    most eviction-caused failures and the other most inherent ones, the pooled AUC could reward
    telling the kinds apart rather than the failures.
    """
    N = int(ds.attrs["reference_context"])
    kind = np.asarray(ds["task_kind"].values, dtype=str)
    policies = [str(p) for p in ds["policy"].values]
    rows = []
    budgets = [int(b) for b in ds["budget"].values]
    per_budget = [target_records(ds, k) for k in budgets]  # poisson, one dict of [n] arrays per budget
    for k, a in zip(budgets, per_budget):
        stats = by_documents(a["cert"], a["conf_kept"], a["conf_ref"], a["fail_kept"], a["fail_ref"], a["doc"],
                             n_boot, seed)
        rows.append({"budget": k, "percent": 100 * k / N, "counts": {p: _counts(ds, p, k) for p in policies},
                     "poisson": stats, "verdicts": _verdicts(stats)})
    a = {name: np.concatenate([r[name] for r in per_budget]) for name in per_budget[0]}  # pooled: [K·n]
    pooled = by_documents(a["cert"], a["conf_kept"], a["conf_ref"], a["fail_kept"], a["fail_ref"], a["doc"], n_boot,
                          seed)
    pooled_kind = np.tile(kind, len(budgets))  # [K·n] kind of each pooled record (budget by budget)
    caused = a["fail_kept"] & ~a["fail_ref"]  # [K·n] eviction-caused failures
    by_kind = {}  # one kind alone: are its eviction-caused failures told from its inherent ones?
    for k in sorted(set(kind)):
        m = pooled_kind == k
        stats = by_documents(a["cert"][m], a["conf_kept"][m], a["conf_ref"][m], a["fail_kept"][m], a["fail_ref"][m],
                             a["doc"][m], n_boot, seed)
        by_kind[k] = {"poisson": stats, "eviction_caused": int(caused[m].sum())}
    fail_ref = per_budget[0]["fail_ref"]  # the full cache's failures (the same at every budget)
    traj = ds.attrs.get("trajectory")
    return {
        "model": ds.attrs.get("model"), "corpus": ds.attrs.get("corpus"), "reference_context": N,
        "delta": float(ds.attrs["delta"]), "failure_nll": float(ds.attrs["failure_nll"]),
        "min_distance": int(ds.attrs["min_distance"]), "n_targets": int(ds.sizes["target"]),
        "process": ds.attrs.get("certified_process"),  # None: a file from before streaming certificates (prefill-evict)
        "n_docs": len(set(np.asarray(ds["doc"].values, dtype=str))),
        "n_targets_by_kind": {k: int((kind == k).sum()) for k in sorted(set(kind))},
        "full_cache_failures": {k: int(fail_ref[kind == k].sum()) for k in sorted(set(kind))},
        "answerable": int((~fail_ref).sum()),  # targets the full cache gets right: what eviction can break
        "budgets": rows, "pooled": {"poisson": pooled, "verdicts": _verdicts(pooled)},
        "pooled_by_kind": by_kind,
        "paper": {"auc_attribution_certificate": PAPER_AUC,
                  "claims": ["confidence at or below chance for attribution", "certificate-gated recomputation beats "
                             "random and confidence-gated", "confidence predicts failure better than the certificate"]},
        "trajectory": json.loads(traj) if traj else None,
        # files written before the server-side records: no decomposition
        "decomposition": decomposition(ds, n_boot, seed) if "attn_hat_norm" in ds else None,
    }


def format_attribution(s: dict) -> str:
    """Printed tables of :func:`summarize_attribution`."""
    kinds = ", ".join(f"{n} {k}" for k, n in s["n_targets_by_kind"].items())
    lines = [f"certify-attribution: {s['model']} on {s['corpus']}, N = {s['reference_context']}, "
             f"{fmt_count(s['n_targets'], 'target')} ({kinds}) from {fmt_count(s['n_docs'], 'document')}; D = {s['min_distance']}; failure: wrong top-1 or NLL > "
             f"{s['failure_nll']:.3f} nats; full cache fails on "
             + ", ".join(f"{n} {k}" for k, n in s["full_cache_failures"].items()),
             *([f"process: {s['process']}"] if s.get("process") else []), ""]
    policies = list(s["budgets"][0]["counts"]) if s["budgets"] else []
    cols = [Column("budget", ">")] + [Column(f"{p}: fail / evict / inherent", ">") for p in policies]
    rows = [[f"{b['budget']} ({b['percent']:.1f}%)"] + [
        f"{c['failures']} / {c['eviction_caused']} / {c['inherent']}" for c in (b["counts"][p] for p in policies)]
        for b in s["budgets"]]
    lines += [render_table(cols, rows), ""]
    if s.get("answerable"):  # (files summarised before the count have none)
        cols = [Column("budget", ">")] + [Column(p, ">") for p in policies]
        rows = [[f"{b['budget']} ({b['percent']:.1f}%)"] + [
            f"{100 * b['counts'][p]['eviction_caused'] / s['answerable']:.1f}%" for p in policies] for b in s["budgets"]]
        lines += [f"share of the {s['answerable']} answerable targets (full cache right) that fail under eviction",
                  render_table(cols, rows), ""]
    table = [*((f"{b['budget']}", b["poisson"]) for b in s["budgets"]), ("pooled", s["pooled"]["poisson"])]
    by_kind = s["pooled_by_kind"]
    kinds_table = [(f"pooled, {k} only", t["poisson"]) for k, t in by_kind.items()] if len(by_kind) > 1 else []
    cols = [Column("poisson budget", ">"), Column("AUC attrib. certificate", ">"),
            Column("AUC attrib. -confidence", ">"),
            Column("AUC attrib. -conf. full", ">"), Column("AUC failure certificate", ">"),
            Column("AUC failure -confidence", ">")]
    rows = [[name, fmt_estimate(t["auc_attribution_certificate"]), fmt_estimate(t["auc_attribution_confidence"]),
             fmt_estimate(t["auc_attribution_confidence_ref"]), fmt_estimate(t["auc_failure_certificate"]),
             fmt_estimate(t["auc_failure_confidence"])] for name, t in table + kinds_table]
    lines += [render_table(cols, rows), ""]
    cols = [Column("poisson budget", ">"), Column("recompute", ">"), Column("certificate-gated", ">"),
            Column("confidence-gated", ">"), Column("random", ">")]
    rows = [[name, f"{100 * f:g}%", fmt_estimate(t[f"removed_certificate_{f:g}"]), fmt_estimate(t[f"removed_confidence_{f:g}"]),
             fmt_num(t[f"removed_random_{f:g}"]["value"], 3)] for name, t in table for f in GATE_FRACTIONS]
    lines += ["share of eviction-caused failures removed by recomputing a share of targets [doc bootstrap]",
              render_table(cols, rows), ""]
    v = s["pooled"]["verdicts"]
    paper = " / ".join(f"{a:g} at {n}" for n, a in s["paper"]["auc_attribution_certificate"].items())
    lines += ["claims of the paper (pooled over budgets) -> on this model:",
              f"  certificate tells eviction-caused from inherent failures (AUC {paper}): "
              f"{fmt_estimate(s['pooled']['poisson']['auc_attribution_certificate'])} -> {v['certificate_attributes']}",
              "  output confidence at or below chance for that: "
              f"{fmt_estimate(s['pooled']['poisson']['auc_attribution_confidence'])} -> {v['confidence_at_chance']}",
              f"  confidence predicts failure better than the certificate: -(certificate - confidence) AUC "
              f"{fmt_estimate(_flip(s['pooled']['poisson']['diff_auc_failure']))} -> {v['confidence_predicts_failure_better']}"]
    for f in GATE_FRACTIONS:
        lines.append(f"  certificate-gated beats random / confidence-gated at {100 * f:g}%: "
                     f"{v[f'gating_beats_random_{f:g}']} / {v[f'gating_beats_confidence_{f:g}']}")
    if s.get("decomposition"):
        lines += ["", *format_decomposition(s["decomposition"])]
    t = s.get("trajectory")
    if t:
        lines += ["", f"trajectory: {t['n_steps']} greedy steps from {t['prefix_tokens']} tokens of {t['doc']}, "
                      f"poisson budget {t['budget']}, {t['streams']} layer x head streams, delta = {t['delta']:g}",
                  f"  misses per step (level delta_t): {t['misses_per_step']}",
                  f"  misses per step (naive, level delta): {t['naive_misses_per_step']}",
                  f"  streams whose confidence sequence was violated: {t['violated_streams']} of {t['streams']} (valid "
                  f"sequences: at most {t['expected_violated_at_most']:.2f} expected); naive reading: "
                  f"{t['naive_violated_streams']}; largest e-value {fmt_num(t['max_e_value'], 3)} (threshold "
                  f"{fmt_num(t['threshold'], 3)})"]
    return "\n".join(lines)


ROW_NAMES = {"certificate": "certificate r_EB/||o_hat||", "oracle_error": "ORACLE true error of the draw ||o_hat - o||/||o||",
             "oracle_kl": "ORACLE output KL(full || evicted)", "confidence": "-confidence (evicted run)"}


def format_decomposition(d: dict) -> list[str]:
    """Printed lines of :func:`truncsens.certificates.attribution_scores.decomposition`."""
    lines = ["where attribution is lost (poisson, pooled over budgets, eviction-caused vs inherent failures; ORACLE "
             "rows read the full cache: the true error of that draw, which no server has) [doc bootstrap]"]
    held = d["held_out"]
    cols = [Column("score", "<"), Column("AUC, every document", ">"), Column("AUC, held-out documents", ">")]
    rows = [[ROW_NAMES[n], fmt_estimate(d["all_documents"][n]), fmt_estimate(held[n])] for n in ROW_NAMES]
    c = d["chosen"]
    rows.append([f"realizable, chosen on development: {c}", fmt_estimate(d["all_documents"][c]), fmt_estimate(held["chosen"])])
    lines += [render_table(cols, rows), ""]
    n = d["counts"]
    lines.append(f"split: {d['split']['rule']}; {len(d['split']['development'])} development documents "
                 f"({n['development']['eviction_caused']} eviction-caused / {n['development']['inherent']} inherent), "
                 f"{len(d['split']['held_out'])} held-out ({n['held_out']['eviction_caused']} / {n['held_out']['inherent']})")
    chooser = d.get("development_stratified") or d["development"]  # the AUCs the choice was made on
    dev = sorted(chooser.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 1.0)
    which = "kind-stratified development AUC" if d.get("development_stratified") else "development AUC"
    lines.append(f"realizable candidates, {which}: " + ", ".join(f"{k} {fmt_num(v, 3)}" for k, v in dev))
    v, aim = held["chosen"]["value"], d["aim"]
    gap = "reached" if v >= aim else f"short by {fmt_num(aim - v, 2)}"
    lines.append(f"chosen {c} on held-out documents: {fmt_estimate(held['chosen'])}; aim {aim:g}: {gap} "
                 f"(ORACLE true error there: {fmt_estimate(held['oracle_error'])})")
    if d.get("within_kind"):
        lines += _within_kind_lines(d)
    oracle, cert = np.asarray(d["heads"]["oracle_error"], float), np.asarray(d["heads"]["certificate"], float)
    gaps = np.nan_to_num(oracle - cert, nan=-np.inf).ravel()
    top = [i for i in np.argsort(-gaps)[:3] if np.isfinite(gaps[i])]
    H = oracle.shape[1]
    lines.append("heads where the certificate loses most of the ORACLE's AUC: " + ", ".join(
        f"layer {i // H} head {i % H} {fmt_num(oracle.ravel()[i], 2)} vs {fmt_num(cert.ravel()[i], 2)}" for i in top))
    return lines


def _within_kind_lines(d: dict) -> list[str]:
    """The table of AUCs within each task kind and stratified over kinds (every document, and held-out)."""
    w = d["within_kind"]
    kinds = w["kinds"]
    counts = ", ".join(f"{k} {c['eviction_caused']} eviction-caused / {c['inherent']} inherent" for k, c in w["counts"].items())
    lines = ["", f"attribution within each task kind ({counts}); stratified: eviction-caused vs inherent failures of "
                 f"the same kind only (a score that is the task kind alone gets 0.5); the realizable score is chosen by "
                 f"its stratified development AUC [doc bootstrap]"]
    cols = [Column("score", "<"), Column("pooled", ">"), Column("stratified", ">")] + \
           [Column(f"{k} only", ">") for k in kinds] + [Column("held-out stratified", ">")]
    names = {**ROW_NAMES, "kind_only": "task kind alone (baseline)"}
    rows = []
    for n, label in list(names.items()) + [(d["chosen"], f"realizable, chosen: {d['chosen']}")]:
        a = w["all_documents"][n]
        held = w["held_out"].get("chosen" if n == d["chosen"] else n)
        rows.append([label, fmt_estimate(a["pooled"]), fmt_estimate(a["stratified"])]
                    + [fmt_estimate(a["by_kind"][k]) if k in a["by_kind"] else "-" for k in kinds]
                    + [fmt_estimate(held["stratified"]) if held else "-"])
    return lines + [render_table(cols, rows)]


def curves_path(stem: str | Path) -> Path:
    """The file :func:`save_curves` writes: ``<stem>-recomputation.png``."""
    stem = Path(stem)
    return stem.with_name(stem.name + "-recomputation.png")


def save_curves(ds, stem: str | Path) -> Path:
    """``<stem>-recomputation.png``: share of eviction-caused failures removed against the share of
    targets recomputed (certificate-gated, confidence-gated, random), one panel per budget and pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(stem)
    path = curves_path(stem)
    panels = [(f"budget {int(k)}", int(k)) for k in ds["budget"].values] + [("pooled", None)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, (title, k) in zip(axes[0], panels):
        a = target_records(ds, k)
        caused = a["fail_kept"] & ~a["fail_ref"]
        curves = removal_curves(a["cert"], a["conf_kept"], caused, CURVE_FRACTIONS)
        for name, style in (("certificate", "o-"), ("confidence", "s-"), ("random", "k:")):
            ax.plot(CURVE_FRACTIONS, curves[name], style, ms=2, label=name)
        ax.set_title(f"{title}: {int(caused.sum())} eviction-caused of {caused.size}", fontsize=9)
        ax.set_xlabel("share of targets recomputed")
    axes[0][0].set_ylabel("eviction-caused failures removed")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
