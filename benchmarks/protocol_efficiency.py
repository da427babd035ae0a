"""Exact versus block protocol on the same documents: forward tokens, alpha_TV and alpha_KL with their
bootstrap intervals, and the ratio of forward tokens needed for equal interval width.

Both protocols run on the same documents of the same corpus (the first ``--docs`` held-out
documents long enough for N + 1 tokens) with the default windows (powers of two up to N/2): the
exact protocol with ``--exact-targets`` random targets per document, the block protocol with
``--block-targets`` per document (one block each at the defaults). Intervals are percentile
bootstraps over documents (:func:`truncsens.fits.fitting.fit_datasets`, default fit range).

Equal-width ratio: an interval's width scales as 1 / sqrt(documents), and so do forward tokens at
a fixed design, so the tokens a protocol needs for a given width are proportional to
``tokens x width^2``; the ratio printed is ``(T_exact W_exact^2) / (T_block W_block^2)`` per
exponent. The N = 8,192 and 32,768 projections use the forward tokens per document of both designs
(:mod:`truncsens.engine.block.plan`) and assume the width factor ``(W_exact / W_block)^2`` measured
here carries over. ``--exact-results`` reuses an exact run on the same documents (to try block
designs without measuring the exact protocol again).

Agreement of the exponents is judged on their **paired difference**: both runs cover the same
documents in the same order and are fitted with the same resampling seed, so resample b draws the
same documents for both, and ``alpha_block[b] - alpha_exact[b]`` is a document bootstrap of the
difference (95 % percentile interval; the exponents agree when it contains 0). ``--paired-targets``
also measures the exact protocol on the block run's own targets (the same (document, position)
pairs): the difference of that pair isolates the protocol (actual windows w + j, reference
contexts) from the choice of targets.

``--designs`` prints, from the same two runs, interval widths and forward tokens of smaller
designs, by keeping the first m targets of every exact document (m = 1, 2, 4, ...) and the first m
targets of every block (tokens of a block of m, :func:`truncsens.engine.block.plan.forward_tokens`),
so the equal-width ratio can be read against the exact protocol's own best design.

Usage::

    python benchmarks/protocol_efficiency.py                    # reference model, code, N = 1,024
    python benchmarks/protocol_efficiency.py --docs 8 --out-dir /tmp/pe
    python benchmarks/protocol_efficiency.py --docs 47 --block-targets 8 --block-size 8 --paired-targets --designs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens, not an installed one

from truncsens import results  # noqa: E402
from truncsens.engine.block.plan import block_length, exact_forward_tokens, forward_tokens  # noqa: E402
from truncsens.engine.block.runs import block_sizes  # noqa: E402
from truncsens.engine.config import DEFAULT_BLOCK_FRACTION, DEFAULT_BLOCK_SIZE, MeasureConfig  # noqa: E402
from truncsens.engine.documents import prepare_documents  # noqa: E402
from truncsens.engine.kernel import measure_draws  # noqa: E402
from truncsens.engine.measure import run_measure, shard_results  # noqa: E402
from truncsens.engine.sweep import default_windows, resolve_sweep  # noqa: E402
from truncsens.fits.fitting import FitConfig, fit_datasets  # noqa: E402
from truncsens.models import load_model  # noqa: E402
from truncsens.targets import select_block_targets  # noqa: E402


def fit_power(ds, label: str, n_boot: int):
    """Power-law fit report of one dataset (TV and KL; seed fixed, so runs on the same documents are
    resampled alike)."""
    return fit_datasets([ds], FitConfig(metrics=("tv", "kl"), families=("power",), n_boot=n_boot), [label])


def power_alpha(report, metric: str) -> tuple[float, list[float] | None]:
    """(alpha, [lo, hi]) of the power-law fit of ``metric``."""
    fit = next(f for f in report.results[0].fits if f["metric"] == metric and f["family"] == "power")
    a = fit["params"]["alpha"]
    return float(a["value"]), a["ci"]


def alpha_samples(report, metric: str) -> np.ndarray:
    """[1 + B] alpha of the sample, then of every document resample."""
    fit = next(f for f in report.results[0].fits if f["metric"] == metric and f["family"] == "power")
    return np.asarray([fit["params"]["alpha"]["value"], *fit.get("bootstrap_samples", {}).get("alpha", [])], np.float64)


def paired_difference(report_a, report_b, metric: str) -> dict:
    """alpha_b - alpha_a with the 95 % percentile interval of its paired document bootstrap (both
    reports fitted on the same documents, in the same order, with the same resampling seed).

    Raises:
        ValueError: the two runs cover different documents.
    """
    docs_a, docs_b = report_a.results[0].curve.docs, report_b.results[0].curve.docs
    if docs_a != docs_b:
        raise ValueError("paired difference needs both runs on the same documents in the same order")
    diff = alpha_samples(report_b, metric) - alpha_samples(report_a, metric)  # [1 + B]
    boot = diff[1:][np.isfinite(diff[1:])]
    ci = [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))] if boot.size else None
    return {"value": float(diff[0]), "ci": ci, "agree": bool(ci and ci[0] <= 0.0 <= ci[1])}


def projection(N: int, fraction: float, size: int, exact_targets: int, block_targets: int) -> dict:
    """Forward tokens per target and per document of both protocols at reference context N (default
    windows, no sinks, no room beyond N), for the per-document designs of this benchmark."""
    windows = default_windows(N)
    B = block_length(N, fraction, size)
    sizes = [B] * (block_targets // B) + ([block_targets % B] if block_targets % B else [])
    return {"N": N, "exact_per_target": exact_forward_tokens(1, N, windows, 0),
            "block_per_target": forward_tokens([B], N, windows, 0, fraction, size) / B,
            "exact_per_doc": exact_forward_tokens(exact_targets, N, windows, 0),
            "block_per_doc": forward_tokens(sizes, N, windows, 0, fraction, size)}


def run_tokens(ds, protocol: str, N: int, args) -> int:
    """Forward tokens of a run (the engine's own plan of the protocol)."""
    windows = [int(w) for w in ds["window"].values]
    if protocol == "exact":
        return exact_forward_tokens(int(ds.sizes["target"]), N, windows, 0)
    return forward_tokens(block_sizes(ds), N, windows, 0, args.block_fraction, args.block_size)


def fit_row(ds, label: str, tokens: int, args, seconds: float | None, reused: Path | None) -> tuple[dict, object]:
    """(targets, documents, forward tokens and the power-law exponents with intervals and widths of
    one run; its fit report)."""
    report = fit_power(ds, label, args.bootstrap)
    row = {"targets": int(ds.sizes["target"]), "docs": len(set(ds["doc"].values.tolist())), "forward_tokens": tokens,
           "seconds": seconds}
    if reused is not None:
        row["reused"] = str(reused)
    for metric in ("tv", "kl"):
        value, ci = power_alpha(report, metric)
        row[f"alpha_{metric}"], row[f"alpha_{metric}_ci"] = value, ci
        row[f"width_{metric}"] = None if ci is None else ci[1] - ci[0]
    return row, report


def exact_on_targets(block_ds, loaded, args, path: Path):
    """The exact protocol measured on the block run's own targets (same documents and positions),
    saved to ``path``: every value is an N-token reference and a w-token window, as in an exact run.

    Raises:
        ValueError: the targets drawn again differ from the block run's (another corpus or seed).
    """
    N = int(block_ds.attrs["reference_context"])
    cfg = MeasureConfig(model=args.model, domain=args.domain, reference_context=N, targets_per_doc=args.block_targets,
                        max_docs=args.docs, out=str(path), overwrite=True, progress=False)
    docs = prepare_documents(cfg, loaded, N)
    targets = select_block_targets(docs.used, N, cfg.targets_per_doc, cfg.seed, int(block_ds.attrs["block_length"]))
    if (list(targets.doc) != [str(d) for d in block_ds["doc"].values]
            or not np.array_equal(targets.position, block_ds["position"].values)):
        raise ValueError("the block run's targets could not be drawn again (another corpus, seed or --docs)")
    sweep = resolve_sweep(cfg, N)
    out = measure_draws(loaded.model, targets, sweep.policies, sweep.budgets, sweep.semantics, cfg.positions,
                        cfg.draw_seed, loaded.device, cfg.batch_tokens(loaded.device))  # arrays [P=1, R=1, n, S]
    attrs = {k: v for k, v in block_ds.attrs.items()
             if not k.startswith("block_") and k not in ("attention_implementation", "n_clamped")}
    results.save(shard_results(out, targets, sweep, {**attrs, "protocol": "exact"}, docs.bos_id), path)
    return results.load(path)


def first_per_group(ds, key: str, m: int, seed: int = 0):
    """``m`` targets of every group: ``key`` "doc", m of each document's targets drawn at random
    (``seed``; an exact run's targets are in position order, so the first m would favour early
    positions); "block", the first m of every block (the targets a block of m would measure)."""
    docs = ds["doc"].values
    if key == "doc":
        rng = np.random.default_rng(seed)
        keep = [i for d in dict.fromkeys(docs.tolist())
                for i in sorted(rng.permutation(np.flatnonzero(docs == d))[:m].tolist())]
        return ds.isel(target=keep)
    keep, start = [], 0
    for size in block_sizes(ds):
        keep += range(start, start + min(m, size))
        start += size
    return ds.isel(target=keep)


SUBSETS = 5  # random subsets averaged per exact design (a width from one subset of one target per document is noisy)


def design_table(exact_ds, block_ds, N: int, args) -> list[dict]:
    """Widths and forward tokens of smaller designs cut from the two runs (module docstring); an
    exact design of m < (targets per document) averages alpha and width over :data:`SUBSETS` random subsets."""
    windows = [int(w) for w in exact_ds["window"].values]
    rows = []
    per_doc = max(exact_ds["doc"].to_series().value_counts())
    B = int(block_ds.attrs["block_length"])
    designs = [("exact", m) for m in (1, 2, 4, 8, 16, 32, 64) if m <= per_doc] + \
              [("block", m) for m in (1, 2, 4, 8, 16, 32, 64) if m <= B]
    for protocol, m in designs:
        if protocol == "exact":
            parts = [first_per_group(exact_ds, "doc", m, seed) for seed in range(SUBSETS if m < per_doc else 1)]
            tokens = exact_forward_tokens(int(parts[0].sizes["target"]), N, windows, 0)
        else:
            parts = [first_per_group(block_ds, "block", m)]
            tokens = len(block_sizes(parts[0])) * forward_tokens([m], N, windows, 0, args.block_fraction, args.block_size)
        row = {"protocol": protocol, "m": m, "targets": int(parts[0].sizes["target"]), "forward_tokens": tokens,
               "subsets": len(parts)}
        fits = [fit_power(ds, f"{protocol}-{m}", args.bootstrap) for ds in parts]
        for metric in ("tv", "kl"):
            found = [power_alpha(report, metric) for report in fits]
            widths = [ci[1] - ci[0] for _, ci in found if ci is not None]
            row[f"alpha_{metric}"] = float(np.mean([a for a, _ in found]))
            row[f"width_{metric}"] = float(np.mean(widths)) if widths else None
            row[f"cost_{metric}"] = None if not widths else tokens * row[f"width_{metric}"] ** 2  # tokens x width^2
        rows.append(row)
    return rows


def width_model(rows: list[dict], metric: str) -> tuple[float, float] | None:
    """(a, b) of the least-squares fit ``W(m)^2 = a + b / m`` to the exact designs' widths (a: the
    between-document part, which more targets per document cannot remove; b / m: the within-document
    part; the variance of a mean over documents of m targets each), or None with fewer than 2 designs."""
    pts = [(r["m"], r[f"width_{metric}"]) for r in rows if r["protocol"] == "exact" and r[f"width_{metric}"]]
    if len(pts) < 2:
        return None
    m, w = np.asarray(pts, np.float64).T
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(m), 1.0 / m], 1), w**2, rcond=None)
    return float(a), float(b)


def fixed_documents_ratio(rows: list[dict], block: dict, metric: str, per_target: int) -> dict:
    """Forward tokens the exact protocol needs **on the same documents** to reach the block run's
    interval width, from :func:`width_model`: m* = b / (W_block^2 - a) targets per document, then
    ``m* x documents x per_target`` against the block run's tokens. ``m_star`` is None (and the
    ratio infinite) when W_block^2 <= a: no number of exact targets per document reaches it."""
    model = width_model(rows, metric)
    wb = block[f"width_{metric}"]
    if model is None or not wb:
        return {"a": None, "b": None, "m_star": None, "ratio": None}
    a, b = model
    m_star = b / (wb**2 - a) if wb**2 > a else None
    ratio = float("inf") if m_star is None else m_star * block["docs"] * per_target / block["forward_tokens"]
    return {"a": a, "b": b, "m_star": m_star, "ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--domain", default="code")
    ap.add_argument("--reference-context", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--exact-targets", type=int, default=8)
    ap.add_argument("--block-targets", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--block-fraction", type=float, default=DEFAULT_BLOCK_FRACTION)
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--out-dir", default="runs/protocol_efficiency")
    ap.add_argument("--exact-results", default=None, help="reuse this exact-protocol results file (same documents) instead of measuring")
    ap.add_argument("--block-results", default=None, help="reuse this block-protocol results file (same documents and design)")
    ap.add_argument("--paired-targets", action="store_true", help="also measure the exact protocol on the block run's targets")
    ap.add_argument("--designs", action="store_true", help="print widths and tokens of smaller designs cut from the two runs")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model)
    N = args.reference_context
    rows, reports, data = {}, {}, {}
    for protocol, tpd, given in (("exact", args.exact_targets, args.exact_results), ("block", args.block_targets, args.block_results)):
        path = out_dir / f"{protocol}.nc"
        seconds, reused = None, None
        if given:
            path = reused = Path(given)
        else:
            block = {"block_fraction": args.block_fraction, "block_size": args.block_size} if protocol == "block" else {}
            cfg = MeasureConfig(model=args.model, domain=args.domain, reference_context=N, targets_per_doc=tpd,
                                max_docs=args.docs, protocol=protocol, out=str(path), overwrite=True, progress=False,
                                **block)
            start = time.perf_counter()
            run_measure(cfg, loaded)
            seconds = round(time.perf_counter() - start, 1)
        data[protocol] = results.load(path)
        rows[protocol], reports[protocol] = fit_row(data[protocol], str(path), run_tokens(data[protocol], protocol, N, args),
                                                    args, seconds, reused)
        print(f"{protocol}: {json.dumps(rows[protocol])}", flush=True)
    e, b = rows["exact"], rows["block"]
    out = {"reference_context": N, "exact": e, "block": b, "raw_token_ratio": e["forward_tokens"] / b["forward_tokens"]}
    for metric in ("tv", "kl"):
        we, wb = e[f"width_{metric}"], b[f"width_{metric}"]
        out[f"equal_width_ratio_{metric}"] = (e["forward_tokens"] * we**2) / (b["forward_tokens"] * wb**2) if we and wb else None
        out[f"alpha_{metric}_difference"] = paired_difference(reports["exact"], reports["block"], metric)
    if args.paired_targets:
        path = out_dir / "exact_on_block_targets.nc"
        start = time.perf_counter()
        same = exact_on_targets(data["block"], loaded, args, path)
        row, report = fit_row(same, str(path), run_tokens(same, "exact", N, args), args,
                              round(time.perf_counter() - start, 1), None)
        out["exact_on_block_targets"] = row
        print(f"exact on the block targets: {json.dumps(row)}", flush=True)
        for metric in ("tv", "kl"):
            out[f"alpha_{metric}_difference_same_targets"] = paired_difference(report, reports["block"], metric)
    widths = [out[f"equal_width_ratio_{m}"] / out["raw_token_ratio"] for m in ("tv", "kl") if out[f"equal_width_ratio_{m}"]]
    width_factor = float(np.mean(widths)) if widths else 1.0  # (W_exact / W_block)^2 of these designs, measured here
    out["width_factor"] = width_factor
    proj = [projection(n, args.block_fraction, args.block_size, args.exact_targets, args.block_targets)
            for n in (N, 8192, 32768)]
    for p in proj:
        p["raw_token_ratio"] = p["exact_per_target"] / p["block_per_target"]
        p["equal_width_ratio_projected"] = p["exact_per_doc"] / p["block_per_doc"] * width_factor
    out["projection"] = proj
    for key in ("raw_token_ratio", "equal_width_ratio_tv", "equal_width_ratio_kl"):
        print(f"{key}: {out[key]}")
    for key in [k for k in out if k.startswith("alpha_") and "difference" in k]:
        d = out[key]
        print(f"{key} (block - exact, paired document bootstrap): {d['value']:+.3f} {d['ci']} -> "
              f"{'agree' if d['agree'] else 'DIFFER'}")
    for p in proj:
        print(f"N={p['N']}: exact {p['exact_per_target']} tokens/target, block {p['block_per_target']:.1f} tokens/target "
              f"(per target {p['raw_token_ratio']:.1f}x); per document {p['exact_per_doc']} vs {p['block_per_doc']} tokens; "
              f"equal-width ratio (projected with the measured width factor {width_factor:.2f}) "
              f"{p['equal_width_ratio_projected']:.1f}x")
    if args.designs:
        out["designs"] = design_table(data["exact"], data["block"], N, args)
        print("designs (first m targets per document / per block; cost = forward tokens x width^2):")
        for r in out["designs"]:
            print(f"  {r['protocol']:5s} m={r['m']:>2}  targets {r['targets']:>5}  tokens {r['forward_tokens']:>8}  "
                  + "  ".join(f"{mt}: alpha {r[f'alpha_{mt}']:.3f} width {r[f'width_{mt}'] or float('nan'):.3f} "
                              f"cost {r[f'cost_{mt}'] or float('nan'):.4g}" for mt in ("tv", "kl")))
        by = {(r["protocol"], r["m"]): r for r in out["designs"]}
        out["same_design_ratio"] = {}
        for m in sorted({m for p, m in by if p == "exact"} & {m for p, m in by if p == "block"}):
            e_m, b_m = by[("exact", m)], by[("block", m)]
            ratios = {mt: e_m[f"cost_{mt}"] / b_m[f"cost_{mt}"] if e_m[f"cost_{mt}"] and b_m[f"cost_{mt}"] else None
                      for mt in ("tv", "kl")}
            out["same_design_ratio"][m] = ratios
            print(f"m = {m} targets per document (exact: m random; block: one block of m): equal-width ratio "
                  + ", ".join(f"{mt} {v:.1f}x" for mt, v in ratios.items() if v))
        per_target = exact_forward_tokens(1, N, [int(w) for w in data["exact"]["window"].values], 0)
        for mt in ("tv", "kl"):
            fixed = out[f"fixed_documents_{mt}"] = fixed_documents_ratio(out["designs"], b, mt, per_target)
            if fixed["ratio"] is not None:
                m_star = "never (between-document floor)" if fixed["m_star"] is None else f"{fixed['m_star']:.1f}"
                print(f"on these {b['docs']} documents ({mt}): W^2 = {fixed['a']:.3g} + {fixed['b']:.3g}/m; exact needs m* = "
                      f"{m_star} targets per document for the block width {b[f'width_{mt}']:.3f}: ratio {fixed['ratio']:.1f}x")
            best = {p: min((r for r in out["designs"] if r["protocol"] == p and r[f"cost_{mt}"]), key=lambda r: r[f"cost_{mt}"])
                    for p in ("exact", "block")}
            out[f"best_design_ratio_{mt}"] = best["exact"][f"cost_{mt}"] / best["block"][f"cost_{mt}"]
            print(f"best designs ({mt}): exact m={best['exact']['m']}, block m={best['block']['m']}: "
                  f"equal-width ratio {out[f'best_design_ratio_{mt}']:.1f}x")
    (out_dir / "summary.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {out_dir / 'summary.json'}")


if __name__ == "__main__":
    main()
