"""What a streaming certificate costs: ``certify --semantics streaming`` against ``measure
--semantics streaming`` of the same policy on the same targets, time per target and their ratio,
in one process. The model is loaded once and each command runs once on one target before the timed
runs, so the times are those of the measurement, not of start-up.

Both run poisson at the same budgets on the same held-out documents and targets (same seed, N,
targets per document). ``measure`` simulates the streaming cache in one parallel pass per (policy,
budget) with a per-query eviction step of every key (docs/method.md, section 3), with one kept set
per key/value head shared by the layers (``--granularity head``). ``certify`` runs the stream token
by token, every layer and key/value head evicting on its own, and computes at the target's step the
Hájek output, the variance estimate, the radii and the true error over every key computed
(docs/method.md, "Certificates in a streaming cache"). The ratio is the price of those records.

Usage::

    python benchmarks/certify_streaming_cost.py                     # reference model, N = 512, k = 128
    python benchmarks/certify_streaming_cost.py --reference-context 1024 --budgets 256 --docs 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens, not an installed one

import truncsens  # noqa: E402
from truncsens.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--domain", default="code")
    ap.add_argument("--reference-context", type=int, default=512)
    ap.add_argument("--budgets", default="128", help="token budgets, comma-separated")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--targets-per-doc", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    lm = load_model(args.model)  # loaded once: neither timing includes loading the model
    common = dict(tokenizer=lm.tokenizer, domain=args.domain, reference_context=args.reference_context,
                  seed=0, progress=False)

    def run_measure(out: Path, docs: int, per_doc: int):
        return truncsens.measure(lm.model, policies="poisson", budgets=budgets, semantics="streaming",
                                 granularity="head", out=out, max_docs=docs, targets_per_doc=per_doc, **common)

    def run_certify(out: Path, docs: int, per_doc: int):
        return truncsens.certify(lm.model, semantics="streaming", policies="poisson", budgets=",".join(map(str, budgets)),
                                 out=out, max_docs=docs, targets_per_doc=per_doc, **common)

    with tempfile.TemporaryDirectory(prefix="truncsens-cost-") as folder:
        run_measure(Path(folder) / "warm-m.nc", 1, 1)  # warm-up: corpus, tokenizer, first-call costs
        run_certify(Path(folder) / "warm-c.nc", 1, 1)
        start = time.perf_counter()
        ds = run_measure(Path(folder) / "m.nc", args.docs, args.targets_per_doc)
        t_measure = time.perf_counter() - start
        start = time.perf_counter()
        cert = run_certify(Path(folder) / "c.nc", args.docs, args.targets_per_doc)
        t_certify = time.perf_counter() - start
    n_measure, n_certify = int(ds.sizes["target"]), int(cert.dataset.sizes["target"])
    if n_measure != n_certify:
        raise SystemExit(f"the runs measured {n_measure} and {n_certify} targets: not the same targets")
    row = {"model": args.model, "domain": args.domain, "reference_context": args.reference_context, "budgets": budgets,
           "targets": n_measure, "measure_s_per_target": t_measure / n_measure,
           "certify_s_per_target": t_certify / n_certify, "ratio": t_certify / t_measure}
    if args.json:
        print(json.dumps(row))
        return
    print(f"{args.model}, {args.domain}, N = {args.reference_context}, poisson at k = {args.budgets}, "
          f"{n_measure} targets: measure --semantics streaming {row['measure_s_per_target']:.2f} s/target, "
          f"certify --semantics streaming {row['certify_s_per_target']:.2f} s/target, ratio {row['ratio']:.1f}x")


if __name__ == "__main__":
    main()
