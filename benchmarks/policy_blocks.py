"""Exact versus block protocol for a policy sweep under ``streaming`` or ``prefill_evict``: forward
tokens, time, and the mean divergences both give on the same documents.

Both protocols run the same policies and budgets on the same documents (the first ``--docs``
held-out documents long enough). The exact protocol runs, per target, one N-token reference pass
and one kept pass per (policy, draw, budget): a stream of N tokens under ``streaming``, one decoded
token under ``prefill_evict``. The block protocol (:mod:`truncsens.engine.block.policies`) runs one
reference pass of L = N + e tokens per block of B targets, then one stream of L tokens (streaming)
or one decode of B tokens (prefill_evict) per (policy, draw, budget). Forward tokens are counted by
those rules; the means are over targets with their document-clustered standard errors
(:meth:`truncsens.fits.curves.Curve.mean_se`). The two protocols measure different targets (random
positions against blocks; reference contexts N against N .. N+B-1), so their means agree within
their errors rather than exactly; that every block value equals a single-target run is tested in
tests/test_block_policies.py.

Usage::

    python benchmarks/policy_blocks.py                                   # streaming sink_recent,h2o
    python benchmarks/policy_blocks.py --semantics prefill_evict --policies h2o,snapkv_shared,key_norm
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens, not an installed one

from truncsens import results  # noqa: E402
from truncsens.fits.curves import curves_of  # noqa: E402
from truncsens.engine.block.plan import policy_forward_tokens  # noqa: E402
from truncsens.engine.block.runs import block_sizes  # noqa: E402
from truncsens.engine.config import DEFAULT_BLOCK_FRACTION, DEFAULT_BLOCK_SIZE, MeasureConfig  # noqa: E402
from truncsens.engine.measure import run_measure  # noqa: E402
from truncsens.engine.semantics import semantics_for  # noqa: E402
from truncsens.models import load_model  # noqa: E402


def forward_tokens(ds, protocol: str, semantics: str, passes: int, max_context: int) -> int:
    """Forward tokens of a run by the rules of the module docstring (``passes``: kept passes per
    target or block, i.e. budgets x draws measured, summed over policies)."""
    N, n = int(ds.attrs["reference_context"]), int(ds.sizes["target"])
    if protocol == "exact":
        return n * (N + passes * semantics_for(semantics).cost(N, 0))  # streaming: N per pass, prefill_evict: 1
    return policy_forward_tokens(block_sizes(ds), N, passes, semantics_for(semantics).streams, max(0, max_context - N))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--domain", default="code")
    ap.add_argument("--semantics", default="streaming", choices=("streaming", "prefill_evict"))
    ap.add_argument("--policies", default="sink_recent,h2o")
    ap.add_argument("--budgets", default="32,128")
    ap.add_argument("--reference-context", type=int, default=512)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--targets-per-doc", type=int, default=64)
    ap.add_argument("--block-fraction", type=float, default=DEFAULT_BLOCK_FRACTION)
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--out-dir", default="runs/policy_blocks")
    ap.add_argument("--reuse", action="store_true", help="read results files already in --out-dir instead of measuring")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model)
    policies = args.policies.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = {}
    for protocol in ("exact", "block"):
        path = out_dir / f"{args.semantics}-{protocol}.nc"
        cfg = MeasureConfig(model=args.model, domain=args.domain, semantics=args.semantics, policies=policies,
                            budgets=budgets, reference_context=args.reference_context,
                            targets_per_doc=args.targets_per_doc, max_docs=args.docs, protocol=protocol, out=str(path),
                            overwrite=True, progress=False,
                            **({"block_fraction": args.block_fraction, "block_size": args.block_size} if protocol == "block" else {}))
        seconds = None
        if not (args.reuse and path.exists()):
            start = time.perf_counter()
            run_measure(cfg, loaded)
            seconds = time.perf_counter() - start
        ds = results.load(path)
        passes = len(policies) * len(budgets)
        row = {"targets": int(ds.sizes["target"]), "seconds": None if seconds is None else round(seconds, 1),
               "forward_tokens": forward_tokens(ds, protocol, args.semantics, passes, loaded.max_context), "means": {}}
        for curve in curves_of(ds, ("kl", "tv"), str(path)):
            for metric in ("kl", "tv"):
                mean, se = curve.mean_se(metric)
                row["means"][f"{curve.policy}/{metric}"] = {int(k): [float(m), float(s)] for k, m, s in zip(curve.points, mean, se)}
        rows[protocol] = row
    e, b = rows["exact"], rows["block"]
    print(f"{args.semantics}, policies {args.policies}, budgets {args.budgets}, N = {args.reference_context}, "
          f"{args.docs} documents x {args.targets_per_doc} targets")
    for protocol, r in rows.items():
        print(f"  {protocol:5s}: {r['targets']} targets, {r['forward_tokens']:,} forward tokens, {r['seconds']} s")
    times = f", {e['seconds'] / max(b['seconds'], 1e-9):.1f}x less time" if e["seconds"] and b["seconds"] else ""
    print(f"  ratio: {e['forward_tokens'] / b['forward_tokens']:.1f}x fewer forward tokens{times}")
    print("  mean ± se(doc)            exact                block")
    for key in e["means"]:
        for k in budgets:
            (me, se), (mb, sb) = e["means"][key][k], b["means"][key][k]
            print(f"  {key:16s} k={k:<5d} {me:9.4f} ± {se:7.4f}   {mb:9.4f} ± {sb:7.4f}")
    (out_dir / f"{args.semantics}-summary.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
