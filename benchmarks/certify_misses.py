"""Where the default certify design misses, and what its score missed (the coverage shortfall at
12.5 % of N, shown with its cause). Not a speed benchmark: a diagnosis of one certify run.

The run is ``truncsens certify`` with its default design (per layer and key/value head, π from the
head's observation-window attention, tempered) on the first ``--docs`` documents. While it runs,
every evicted decode of a poisson design is also read here: for each record (target, layer, head)
with a random tail, beside the certify records themselves (error ‖ô − o‖, empirical-Bernstein
radius, ‖o‖), the target query's own attention a_i over the keys and the design's π_i give

- ``hidden``: Σ a_i over tail keys that were not drawn (attention mass the kept set cannot show);
- ``tail``: Σ a_i over all tail keys;
- the **worst key** i* = argmax a_i / π_i over the tail (the key whose draw or absence moves ô the
  most per unit of π): whether it was drawn, its a_i, its π_i, its distance from the target (tokens)
  and its score rank among the tail keys (1 = the key the observation window scored highest).

A miss (error above the radius, records at the floor left out as certify leaves them out) whose
worst key was not drawn and carries much of the target's attention is a key the observation window
did not see coming: the target's query leans on it, the last W prefill queries did not.

Usage (about 10 minutes on 2 CPU cores for the reference model at N = 1024):

    python benchmarks/certify_misses.py --reference-context 1024 --out results/certify-misses.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


SLIGHT = 1e-4  # a miss with ||o^ - o|| <= SLIGHT ||o||: the tail held almost no attention, the radius even less
LEANED_ON = 0.01  # a worst key with at least this much of the target's attention, not drawn: a key the score missed


class Recorder:
    """Wraps :func:`truncsens.certificates.estimator.attention_records` as the probe calls it, keeping the
    diagnostics of every poisson record (module docstring). Calls come in layer order, one evicted
    forward per (policy, budget) in certify's order, one batch after another."""

    def __init__(self, inner, n_layers: int, policies: list[str], budgets: list[int]):
        self.inner, self.L, self.policies, self.budgets = inner, n_layers, policies, budgets
        self.calls = 0
        self.rows: list[dict] = []

    def __call__(self, logits, values, available, kept, pi, tail, delta=0.05, variance="hajek"):
        rec = self.inner(logits, values, available, kept, pi, tail, delta, variance)
        forward, layer = divmod(self.calls, self.L)
        self.calls += 1
        per_batch = len(self.policies) * len(self.budgets)
        policy = self.policies[(forward % per_batch) // len(self.budgets)]
        budget = self.budgets[forward % len(self.budgets)]
        if policy == "poisson":
            self.record(rec, budget, layer, logits, values, kept, pi, tail, delta)
        return rec

    def record(self, rec, budget: int, layer: int, logits, values, kept, pi, tail, delta: float) -> None:
        """Keep the diagnostics of one poisson decode of one layer (rows per target and head)."""
        import torch

        shape = logits.shape  # [B, H, T]
        kept, tail = kept.expand(shape), tail.expand(shape)
        pi = pi.to(torch.float64).expand(shape)
        a = torch.softmax(logits.to(torch.float64), dim=-1)  # [B, H, T] the target query's attention
        T = shape[-1]
        surprise = torch.where(tail, a / pi.clamp_min(1e-300), torch.full_like(a, -1.0))  # [B, H, T]
        worst = surprise.argmax(-1)  # [B, H]
        for b in range(shape[0]):
            for h in range(shape[1]):
                if not bool(rec.has_tail[b, h]):
                    continue
                i = int(worst[b, h])
                t = tail[b, h]
                higher = int(((pi[b, h] > pi[b, h, i]) & t).sum())  # tail keys the score put above i*
                self.rows.append({
                    "budget": budget, "layer": layer, "head": h,
                    "error": float(rec.error[b, h]), "radius_eb": float(rec.radius_eb[b, h]),
                    "o_norm": float(rec.o_norm[b, h]),
                    "hidden": float(a[b, h][t & ~kept[b, h]].sum()), "tail": float(a[b, h][t].sum()),
                    "worst_drawn": bool(kept[b, h, i]), "worst_attention": float(a[b, h, i]),
                    "worst_pi": float(pi[b, h, i]), "worst_distance": int(T - 1 - i),
                    "worst_score_rank": higher + 1, "n_tail": int(t.sum())})


def summarize(rows: list[dict], floor_rel: float) -> dict:
    """Coverage and miss anatomy per budget, per layer and per (layer, head)."""
    out = {}
    for budget in sorted({r["budget"] for r in rows}):
        rs = [r for r in rows if r["budget"] == budget and r["error"] > floor_rel * r["o_norm"]]
        for r in rs:
            r["miss"] = r["error"] > r["radius_eb"]

        def describe(group: list[dict]) -> dict:
            miss = [r for r in group if r["miss"]]
            hit = [r for r in group if not r["miss"]]
            med = lambda xs, key: float(np.median([x[key] for x in xs])) if xs else None  # noqa: E731
            return {"records": len(group), "misses": len(miss),
                    "coverage": 1 - len(miss) / len(group) if group else None,
                    "misses_worst_key_not_drawn": sum(not r["worst_drawn"] for r in miss),
                    "misses_slight": sum(r["error"] <= SLIGHT * r["o_norm"] for r in miss),
                    "misses_leaned_on": sum(r["worst_attention"] >= LEANED_ON and not r["worst_drawn"] for r in miss),
                    "median_hidden_mass": {"miss": med(miss, "hidden"), "covered": med(hit, "hidden")},
                    "median_worst_attention": {"miss": med(miss, "worst_attention"), "covered": med(hit, "worst_attention")},
                    "median_worst_pi": {"miss": med(miss, "worst_pi"), "covered": med(hit, "worst_pi")},
                    "median_worst_distance": {"miss": med(miss, "worst_distance"), "covered": med(hit, "worst_distance")},
                    "median_worst_score_rank": {"miss": med(miss, "worst_score_rank"), "covered": med(hit, "worst_score_rank")},
                    "median_relative_error": {"miss": float(np.median([r["error"] / r["o_norm"] for r in miss])) if miss else None}}

        layers = sorted({r["layer"] for r in rs})
        heads = sorted({r["head"] for r in rs})
        out[str(budget)] = {
            "all": describe(rs),
            "by_layer": {str(l): describe([r for r in rs if r["layer"] == l]) for l in layers},
            "by_head": {f"{l}.{h}": describe([r for r in rs if r["layer"] == l and r["head"] == h])
                        for l in layers for h in heads if any(r["layer"] == l and r["head"] == h for r in rs)}}
    return out


def arguments(argv: list[str] | None, description: str, budgets: str, out: str) -> argparse.Namespace:
    """The options of a recorded certify run (this script's and benchmarks/certify_tail_range.py's)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="reference", help="'reference' (bundled), a model folder or hub id")
    ap.add_argument("--reference-context", type=int, default=1024, help="N: tokens of context per target")
    ap.add_argument("--docs", type=int, default=24, help="the first this many held-out code documents")
    ap.add_argument("--targets-per-doc", type=int, default=2, help="targets drawn per document")
    ap.add_argument("--budgets", default=budgets, help="token counts or percentages of N")
    ap.add_argument("--out", default=out, help="JSON report (refused if it exists)")
    return ap.parse_args(argv)


def recorded_certify(args: argparse.Namespace, make_recorder):
    """``truncsens certify`` (default design) on the first ``--docs`` documents with a recorder
    reading every evicted decode: ``make_recorder(probe_module, n_layers, budgets)`` builds it and
    installs it in the probe (this process only). Returns (dataset, recorder, budgets in tokens)."""
    import tempfile

    import truncsens
    import truncsens.certificates.probe as probe_module
    from truncsens.certificates.config import parse_budgets, resolve_budgets
    from truncsens.models import load_model

    loaded = load_model(args.model)  # once: certify runs on the loaded object
    budgets = resolve_budgets(parse_budgets(args.budgets), args.reference_context, 4)
    recorder = make_recorder(probe_module, loaded.model.config.num_hidden_layers, budgets)
    with tempfile.TemporaryDirectory() as tmp:
        ds = truncsens.certify(loaded.model, loaded.tokenizer, reference_context=args.reference_context,
                               max_docs=args.docs, targets_per_doc=args.targets_per_doc, budgets=args.budgets,
                               progress=False, out=Path(tmp) / "certify.nc").dataset
        return ds.load(), recorder, budgets


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv, __doc__.split("\n\n")[0], "12.5%,25%", "results/certify-misses.json")
    if Path(args.out).exists():
        print(f"error: {args.out} exists; remove it or pass another --out", file=sys.stderr)
        return 2
    from truncsens.certificates.statistics import coverage

    def make(probe_module, n_layers, budgets):
        recorder = Recorder(probe_module.attention_records, n_layers, ["poisson", "topk", "random"], budgets)
        probe_module.attention_records = recorder  # read every evicted decode
        return recorder

    ds, recorder, budgets = recorded_certify(args, make)
    floor_rel = float(ds.attrs["error_floor_relative"])
    report = {"setup": vars(args), "design": ds.attrs["design"], "n_targets": int(ds.sizes["target"]),
              "floor_relative": floor_rel, "by_budget": summarize(recorder.rows, floor_rel),
              "records": recorder.rows}
    # the recorder's misses are certify's own: the same counts from the results file
    for k in budgets:
        r = ds.sel(policy="poisson", budget=k)
        tail = r["has_tail"].values > 0
        cov = coverage(r["attn_error"].values, np.where(tail, r["radius_eb"].values, np.nan), 0.95,
                       floor_rel * r["attn_norm"].values, leave_out_floor=True)
        mine = report["by_budget"][str(k)]["all"]
        assert cov["n"] == mine["records"] and round(cov["rate"] * cov["n"]) == mine["records"] - mine["misses"], (cov, mine)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for k, s in report["by_budget"].items():
        a = s["all"]
        print(f"budget {k}: {a['records']} records above the floor, {a['misses']} misses "
              f"({a['misses_worst_key_not_drawn']} with the worst key not drawn; {a['misses_slight']} slight, relative "
              f"error <= {SLIGHT:g}; {a['misses_leaned_on']} on an undrawn key holding >= {LEANED_ON:g} of the "
              "target's attention)")
        for name, part in (("layer", s["by_layer"]), ("head", s["by_head"])):
            for key, d in part.items():
                if d["misses"]:
                    print(f"  {name} {key}: {d['misses']}/{d['records']} misses ({d['misses_slight']} slight, "
                          f"{d['misses_leaned_on']} leaned-on key not drawn); median over misses (covered): hidden mass "
                          f"{_f(d['median_hidden_mass'])}, worst key attention {_f(d['median_worst_attention'])}, "
                          f"pi {_f(d['median_worst_pi'])}, distance {_f(d['median_worst_distance'])}, "
                          f"score rank {_f(d['median_worst_score_rank'])}")
    return 0


def _f(pair: dict) -> str:
    g = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    return f"{g(pair['miss'])} ({g(pair['covered'])})"


if __name__ == "__main__":
    sys.exit(main())
