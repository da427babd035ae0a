"""Full-cache key–value recall accuracy of one or more models on more documents than
``certify-attribution`` draws (an accuracy aim of ≥ 50 % read on 8 documents moves by 12.5 points with
one document). Not a speed benchmark.

The documents are the synthetic key–value recall documents of ``certify-attribution``
(:func:`truncsens.certificates.tasks.kv_document`: six ``key_<digits> = "<value>"`` lines, filler
code, then one query ``assert key_<j> == "`` at the end of the N-token context, its definition at
least certify-attribution's distance D away); document i depends on (seed, i) only, so the first 8
are that command's. Each
model reads each document whole (no eviction) and is scored on its top-1 prediction of the value's
first token (:func:`truncsens.api.reference.task_accuracy`). The interval is Wilson's at 95 %
(statsmodels ``proportion_confint``).

Usage (about 20 s per model and 64 documents on 2 CPU cores at N = 2048)::

    python benchmarks/recall_accuracy.py --model reference --model runs/recall/final --kv-docs 64 \
        [--reference-context 2048] [--out results/recall-accuracy.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=None, help="model id or folder (repeatable; default: reference)")
    ap.add_argument("--reference-context", type=int, default=2048)
    ap.add_argument("--kv-docs", type=int, default=64, help="key-value documents (the first 8 are certify-attribution's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the counts as JSON here (refused if it exists)")
    args = ap.parse_args(argv)
    if args.kv_docs < 1:
        sys.exit(f"error: --kv-docs must be at least 1, got {args.kv_docs}")
    path = Path(args.out) if args.out else None
    if path is not None and path.exists():
        sys.exit(f"error: {path} already exists; remove it or choose another --out")

    from statsmodels.stats.proportion import proportion_confint

    from truncsens.api.reference import task_accuracy
    from truncsens.models import load_model

    rows = []
    print(f"key-value recall, full cache, N = {args.reference_context}, {args.kv_docs} documents (seed {args.seed})")
    for name in args.model or ["reference"]:
        loaded = load_model(name)
        kv = task_accuracy(loaded, args.reference_context, max_docs=1, copy_per_doc=0, kv_docs=args.kv_docs,
                           seed=args.seed)["kv"]
        lo, hi = proportion_confint(kv["correct"], kv["n"], alpha=0.05, method="wilson")
        rows.append({"model": name, "model_sha256": loaded.content_sha256, **kv, "wilson_95": [lo, hi]})
        print(f"  {kv['correct']:3d} / {kv['n']} = {kv['accuracy']:.1%} [{lo:.1%}, {hi:.1%}]  {name}", flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"reference_context": args.reference_context, "kv_docs": args.kv_docs,
                                    "seed": args.seed, "models": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
