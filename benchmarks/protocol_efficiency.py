"""Exact versus block protocol on the same documents: forward tokens, alpha_TV and alpha_KL with their
bootstrap intervals, and the ratio of forward tokens needed for equal interval width.

Both protocols run on the same documents of the same corpus (the first ``--docs`` held-out
documents long enough for N + 1 tokens) with the default windows (powers of two up to N/2): the
exact protocol with ``--exact-targets`` random targets per document, the block protocol with
``--block-targets`` per document (one block each at the defaults). Intervals are percentile
bootstraps over documents (:func:`truncsens.fitting.fit_results`, default fit range).

Equal-width ratio: an interval's width scales as 1 / sqrt(documents), and so do forward tokens at
a fixed design, so the tokens a protocol needs for a given width are proportional to
``tokens x width^2``; the ratio printed is ``(T_exact W_exact^2) / (T_block W_block^2)`` per
exponent. The N = 8,192 and 32,768 projections use the forward tokens per document of both designs
(:mod:`truncsens.engine.block_plan`) and assume the width factor ``(W_exact / W_block)^2`` measured
here carries over. ``--exact-results`` reuses an exact run on the same documents (to try block
designs without measuring the exact protocol again).

Usage::

    python benchmarks/protocol_efficiency.py                    # reference model, code, N = 1,024
    python benchmarks/protocol_efficiency.py --docs 8 --out-dir /tmp/pe
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
from truncsens.engine.block_plan import block_length, exact_forward_tokens, forward_tokens  # noqa: E402
from truncsens.engine.block_runs import actual_coords  # noqa: E402
from truncsens.engine.config import DEFAULT_BLOCK_FRACTION, DEFAULT_BLOCK_SIZE, MeasureConfig  # noqa: E402
from truncsens.engine.measure import run_measure  # noqa: E402
from truncsens.engine.sweep import default_windows  # noqa: E402
from truncsens.fitting import FitConfig, fit_results  # noqa: E402
from truncsens.models import load_model  # noqa: E402


def block_sizes(ds) -> list[int]:
    """Targets per block of a block-protocol results dataset (from its actual reference contexts)."""
    _, context = actual_coords(ds)
    N = int(ds.attrs["reference_context"])
    return [int(N - c + 1) for i, c in enumerate(context) if i == 0 or c <= context[i - 1]]  # first target: N - B + 1


def power_alpha(report, metric: str) -> tuple[float, list[float] | None]:
    """(alpha, [lo, hi]) of the power-law fit of ``metric``."""
    fit = next(f for f in report.results[0].fits if f["metric"] == metric and f["family"] == "power")
    a = fit["params"]["alpha"]
    return float(a["value"]), a["ci"]


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


def fit_row(path: Path, protocol: str, N: int, args, seconds: float | None, reused: Path | None) -> dict:
    """Targets, documents, forward tokens and the power-law exponents (with intervals and widths) of one run."""
    ds = results.load(path)
    windows = [int(w) for w in ds["window"].values]
    n = int(ds.sizes["target"])
    tokens = (exact_forward_tokens(n, N, windows, 0) if protocol == "exact"
              else forward_tokens(block_sizes(ds), N, windows, 0, args.block_fraction, args.block_size))
    report = fit_results([str(path)], FitConfig(metrics=("tv", "kl"), families=("power",), n_boot=args.bootstrap))
    row = {"targets": n, "docs": len(set(ds["doc"].values.tolist())), "forward_tokens": tokens, "seconds": seconds}
    if reused is not None:
        row["reused"] = str(reused)
    for metric in ("tv", "kl"):
        value, ci = power_alpha(report, metric)
        row[f"alpha_{metric}"], row[f"alpha_{metric}_ci"] = value, ci
        row[f"width_{metric}"] = None if ci is None else ci[1] - ci[0]
    return row


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
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model)
    N = args.reference_context
    rows = {}
    for protocol, tpd in (("exact", args.exact_targets), ("block", args.block_targets)):
        path = out_dir / f"{protocol}.nc"
        seconds, reused = None, None
        if protocol == "exact" and args.exact_results:
            path = reused = Path(args.exact_results)
        else:
            cfg = MeasureConfig(model=args.model, domain=args.domain, reference_context=N, targets_per_doc=tpd,
                                max_docs=args.docs, protocol=protocol, block_fraction=args.block_fraction,
                                block_size=args.block_size, out=str(path), overwrite=True, progress=False)
            start = time.perf_counter()
            run_measure(cfg, loaded)
            seconds = round(time.perf_counter() - start, 1)
        rows[protocol] = fit_row(path, protocol, N, args, seconds, reused)
        print(f"{protocol}: {json.dumps(rows[protocol])}", flush=True)
    e, b = rows["exact"], rows["block"]
    out = {"reference_context": N, "exact": e, "block": b, "raw_token_ratio": e["forward_tokens"] / b["forward_tokens"]}
    for metric in ("tv", "kl"):
        we, wb = e[f"width_{metric}"], b[f"width_{metric}"]
        out[f"equal_width_ratio_{metric}"] = (e["forward_tokens"] * we**2) / (b["forward_tokens"] * wb**2) if we and wb else None
        ce, cb = e[f"alpha_{metric}_ci"], b[f"alpha_{metric}_ci"]
        out[f"alpha_{metric}_agree"] = bool(ce and cb and ce[0] <= b[f"alpha_{metric}"] <= ce[1]
                                            and cb[0] <= e[f"alpha_{metric}"] <= cb[1])
    widths = [out[f"equal_width_ratio_{m}"] / out["raw_token_ratio"] for m in ("tv", "kl") if out[f"equal_width_ratio_{m}"]]
    width_factor = float(np.mean(widths)) if widths else 1.0  # (W_exact / W_block)^2 of these designs, measured here
    out["width_factor"] = width_factor
    proj = [projection(n, args.block_fraction, args.block_size, args.exact_targets, args.block_targets)
            for n in (N, 8192, 32768)]
    for p in proj:
        p["raw_token_ratio"] = p["exact_per_target"] / p["block_per_target"]
        p["equal_width_ratio_projected"] = p["exact_per_doc"] / p["block_per_doc"] * width_factor
    out["projection"] = proj
    for key in ("raw_token_ratio", "equal_width_ratio_tv", "equal_width_ratio_kl", "alpha_tv_agree", "alpha_kl_agree"):
        print(f"{key}: {out[key]}")
    for p in proj:
        print(f"N={p['N']}: exact {p['exact_per_target']} tokens/target, block {p['block_per_target']:.1f} tokens/target "
              f"(per target {p['raw_token_ratio']:.1f}x); per document {p['exact_per_doc']} vs {p['block_per_doc']} tokens; "
              f"equal-width ratio (projected with the measured width factor {width_factor:.2f}) "
              f"{p['equal_width_ratio_projected']:.1f}x")
    (out_dir / "summary.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {out_dir / 'summary.json'}")


if __name__ == "__main__":
    main()
