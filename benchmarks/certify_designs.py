"""Choose the certify sampling design on a development set, report coverage on the held-out rest
(issue 19, item 2). Not a speed benchmark: a measurement whose design choice is fixed before the
held-out documents' coverage is looked at.

One certify run per candidate design over the first ``--dev-docs + --heldout-docs`` documents of the
held-out split (the order ``truncsens certify`` uses); coverage (empirical Bernstein, records at the
floor left out) is computed separately on the first ``--dev-docs`` documents (development) and on
the rest (held out). The rule, fixed before any run: the default design is the first candidate, in
the order listed, whose development coverage reaches nominal 1 − δ at every budget; if none does,
the one with the highest development coverage at the smallest budget. Its held-out coverage is then
reported with both intervals. Per layer, the held-out coverage of the chosen design shows where a
shortfall lives.

Usage (about an hour on 2 CPU cores for the reference model at N = 1024):

    python benchmarks/certify_designs.py --reference-context 1024 --out results/certify-designs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

CANDIDATES = [  # (name, certify keyword arguments), in the order the rule reads them
    ("token (the shared design of earlier versions)", {"granularity": "token"}),
    ("head, window W=32", {"score": "window", "obs_window": 32}),
    ("head, window W=64", {"score": "window", "obs_window": 64}),
    ("head, window W=32, top 1/2", {"score": "window", "obs_window": 32, "top_fraction": 0.5}),
    ("head, window W=32, score^0.5", {"score": "window", "obs_window": 32, "temper": 0.5}),
    ("head, h2o", {"score": "h2o"}),
]


def split_coverage(ds, docs: list[str], floor_rel: float, delta: float) -> list[dict]:
    """Coverage per budget of the poisson records of the targets whose document is in ``docs``."""
    from truncsens.certificates.statistics import coverage

    mask = np.isin(np.asarray(ds["doc"].values, dtype=str), docs)
    sub = ds.isel(target=np.flatnonzero(mask))
    doc = np.asarray(sub["doc"].values, dtype=str)
    out = []
    for k in (int(b) for b in sub["budget"].values):
        r = sub.sel(policy="poisson", budget=k)
        tail = r["has_tail"].values > 0
        eb = np.where(tail, r["radius_eb"].values, np.nan)
        floor = floor_rel * r["attn_norm"].values
        cov = coverage(r["attn_error"].values, eb, 1 - delta, floor, doc, 200, 0)
        by_layer = [coverage(r["attn_error"].values[:, l], eb[:, l], 1 - delta, floor[:, l])["rate"]
                    for l in range(eb.shape[1])]
        out.append({"budget": k, **cov, "by_layer": by_layer})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--reference-context", type=int, default=1024)
    ap.add_argument("--dev-docs", type=int, default=8)
    ap.add_argument("--heldout-docs", type=int, default=16)
    ap.add_argument("--targets-per-doc", type=int, default=2)
    ap.add_argument("--out", default="results/certify-designs.json")
    args = ap.parse_args(argv)
    import truncsens

    report = {"model": args.model, "reference_context": args.reference_context, "candidates": []}
    for name, kwargs in CANDIDATES:
        run = truncsens.certify(args.model, reference_context=args.reference_context,
                                max_docs=args.dev_docs + args.heldout_docs, targets_per_doc=args.targets_per_doc,
                                progress=False, **kwargs)
        ds = run.dataset
        order = list(dict.fromkeys(str(d) for d in ds["doc"].values))  # documents in run order
        dev, held = order[: args.dev_docs], order[args.dev_docs:]
        floor_rel, delta = float(ds.attrs["error_floor_relative"]), float(ds.attrs["delta"])
        entry = {"name": name, "options": kwargs, "design": ds.attrs["design"],
                 "dev": split_coverage(ds, dev, floor_rel, delta), "heldout": split_coverage(ds, held, floor_rel, delta)}
        report["candidates"].append(entry)
        print(name, "dev", [round(b["rate"], 3) for b in entry["dev"]], "held out",
              [round(b["rate"], 3) for b in entry["heldout"]], flush=True)
    nominal = 1 - delta
    reaching = [c for c in report["candidates"] if all(b["rate"] >= nominal for b in c["dev"])]
    chosen = reaching[0] if reaching else max(report["candidates"], key=lambda c: c["dev"][0]["rate"])
    report["rule"] = ("the first candidate whose development coverage reaches nominal at every budget, else the "
                      "highest development coverage at the smallest budget")
    report["chosen"] = chosen["name"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("chosen:", chosen["name"], "held-out coverage", [round(b["rate"], 3) for b in chosen["heldout"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
