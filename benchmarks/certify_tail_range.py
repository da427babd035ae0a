"""What a server would have to keep of the evicted keys for the certificate to see them: coverage and
width of the certify radius with its range taken over the whole tail. A diagnosis of one certify run.

Every miss of ``truncsens certify`` is a tail key that was not drawn (docs/certify.md): the
empirical-Bernstein radius takes its range ``B̂`` from the kept keys only. The range the bound asks
for runs over every tail key. This script runs ``truncsens certify`` with its default design on the
first ``--docs`` documents and, for every poisson record, recomputes the empirical-Bernstein radius
with the range over the whole tail from what a server could keep beside the evicted cache
(:mod:`truncsens.certificates.tail_bounds`):

- ``kept keys only (certify's radius)``: nothing kept of the evicted keys;
- ``the evicted keys``: the evicted keys themselves and each value's norm (``d + 1`` numbers per token and head,
  about half of what eviction saves);
- ``4-bit keys`` / ``2-bit keys``: a per-channel quantized copy of the evicted keys and each value's
  norm (KIVI-style);
- ``pages of 16``: Quest's per-page channel minimum and maximum of the evicted keys and the page's
  largest value norm.

For each, per budget: coverage of the records above the floor (Wilson interval), the median radius
relative to ‖o‖, the share of records whose radius exceeds ‖o‖ (a certificate that says nothing:
the error of any convex combination of the values can reach that much), and Spearman(radius, error).
The variance term is the same in all of them; only the range differs. The radius certify reports is
unchanged by this script (checked against the results file).

Usage (about 2 minutes on 2 CPU cores for the reference model at N = 1024):

    python benchmarks/certify_tail_range.py --reference-context 1024 --out results/certify-tail-range.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from certify_misses import Recorder, arguments, recorded_certify  # noqa: E402  (the same walk over certify's evicted decodes)

PLUG_IN = "kept keys only (certify's radius)"
VARIANTS = (PLUG_IN, "the evicted keys", "4-bit keys", "2-bit keys", "pages of 16")


class RangeRecorder(Recorder):
    """Reads every poisson decode (as :class:`certify_misses.Recorder`), with the query and keys of the
    layer stashed by :meth:`evict`, and keeps per record the error, ‖o‖ and the radius of each variant."""

    def __init__(self, inner, inner_evict, n_layers: int, policies: list[str], budgets: list[int]):
        super().__init__(inner, n_layers, policies, budgets)
        self.inner_evict = inner_evict
        self.stash: dict = {}

    def evict(self, probe, module, query, key, value, scaling):
        """Wraps the probe's ``_evict``: keeps the query [B, H, 1, d], keys [B, H, T, d] and scale."""
        n_rep = query.shape[1] // key.shape[1]
        self.stash = {"query": query[:, :, 0], "keys": key.repeat_interleave(n_rep, dim=1), "scaling": scaling}
        return self.inner_evict(probe, module, query, key, value, scaling)

    def record(self, rec, budget: int, layer: int, logits, values, kept, pi, tail, delta: float) -> None:
        import torch

        from truncsens.certificates.estimator import eb_sum_radius
        from truncsens.certificates.tail_bounds import (
            page_logit_bound, page_max, quantized_logit_bound, tail_range,
        )

        shape = logits.shape  # [B, H, T]
        kept, tail = kept.expand(shape), tail.expand(shape)
        pi = pi.to(torch.float64).expand(shape)
        undrawn = tail & ~kept  # [B, H, T]
        q, k, s = self.stash["query"], self.stash["keys"], self.stash["scaling"]
        v_norm = values.to(torch.float64).norm(dim=-1)  # [B, H, T]
        bounds = {  # variant -> (logit upper bounds, value-norm upper bounds), each [B, H, T]
            "the evicted keys": (logits.to(torch.float64), v_norm),
            "4-bit keys": (quantized_logit_bound(q, k, undrawn, 4, s), v_norm),
            "2-bit keys": (quantized_logit_bound(q, k, undrawn, 2, s), v_norm),
            "pages of 16": (page_logit_bound(q, k, undrawn, 16, s), page_max(v_norm, undrawn, 16)),
        }
        radii = {PLUG_IN: rec.radius_eb}
        for name, (u, nu) in bounds.items():
            b = tail_range(logits, u, nu, rec.o_hat, kept, pi, tail, rec.value_range)  # [B, H]
            radii[name] = eb_sum_radius(rec.variance, b, rec.n_random, rec.has_tail, delta)
        for b in range(shape[0]):
            for h in range(shape[1]):
                if bool(rec.has_tail[b, h]):
                    self.rows.append({"budget": budget, "layer": layer, "head": h, "error": float(rec.error[b, h]),
                                      "o_norm": float(rec.o_norm[b, h]),
                                      **{f"radius {n}": float(r[b, h]) for n, r in radii.items()}})


def summarize(rows: list[dict], floor_rel: float, level: float) -> dict:
    """Per budget and variant: coverage (Wilson), median radius / ‖o‖, share above ‖o‖, Spearman."""
    from scipy.stats import spearmanr

    from truncsens.certificates.statistics import coverage

    out = {}
    for budget in sorted({r["budget"] for r in rows}):
        rs = [r for r in rows if r["budget"] == budget and r["error"] > floor_rel * r["o_norm"]]
        err = np.array([r["error"] for r in rs])
        norm = np.array([r["o_norm"] for r in rs])
        per = {}
        for name in VARIANTS:
            rad = np.array([r[f"radius {name}"] for r in rs])
            cov = coverage(err, rad, level)  # Wilson interval; the floor is left out above
            per[name] = {"coverage": cov["rate"], "ci": list(cov["ci"]), "median_radius_rel": float(np.median(rad / norm)),
                         "share_radius_above_norm": float(np.mean(rad > norm)),
                         "spearman": float(spearmanr(rad, err).statistic)}
        out[str(budget)] = {"records": len(rs), "variants": per}
    return out


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv, __doc__.split("\n\n")[0], "12.5%,25%,50%", "results/certify-tail-range.json")
    if Path(args.out).exists():
        print(f"error: {args.out} exists; remove it or pass another --out", file=sys.stderr)
        return 2
    from truncsens.certificates.statistics import coverage

    def make(probe_module, n_layers, budgets):
        recorder = RangeRecorder(probe_module.attention_records, probe_module._evict, n_layers,
                                 ["poisson", "topk", "random"], budgets)
        probe_module.attention_records = recorder  # read every evicted decode
        probe_module._evict = recorder.evict
        return recorder

    ds, recorder, budgets = recorded_certify(args, make)
    floor_rel, delta = float(ds.attrs["error_floor_relative"]), float(ds.attrs["delta"])
    report = {"setup": vars(args), "design": ds.attrs["design"], "n_targets": int(ds.sizes["target"]),
              "floor_relative": floor_rel, "delta": delta, "by_budget": summarize(recorder.rows, floor_rel, 0.95)}
    for k in budgets:  # the plug-in rows are certify's own records: same counts as the results file
        r = ds.sel(policy="poisson", budget=k)
        tail = r["has_tail"].values > 0
        cov = coverage(r["attn_error"].values, np.where(tail, r["radius_eb"].values, np.nan), 1 - delta,
                       floor_rel * r["attn_norm"].values, leave_out_floor=True)
        mine = report["by_budget"][str(k)]
        assert cov["n"] == mine["records"] and abs(cov["rate"] - mine["variants"][PLUG_IN]["coverage"]) < 1e-12
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}: {report['n_targets']} targets, design {report['design']}; records above the floor")
    print("| budget | range over the tail from | coverage [95% Wilson] | median radius / ‖o‖ | radius > ‖o‖ "
          "| Spearman(radius, error) |")
    print("|---|---|---|---|---|---|")
    for k, s in report["by_budget"].items():
        for i, (name, v) in enumerate(s["variants"].items()):
            budget = f"{100 * int(k) / args.reference_context:g} % (n = {s['records']})" if i == 0 else ""
            print(f"| {budget} | {name} | {100 * v['coverage']:.1f} % [{100 * v['ci'][0]:.1f}, {100 * v['ci'][1]:.1f}] "
                  f"| {v['median_radius_rel']:.3g} | {100 * v['share_radius_above_norm']:.0f} % "
                  f"| {v['spearman']:.3f} |".replace("| -", "| −"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
