"""What one token step of a streaming run costs as the context N grows: ``certify --semantics
streaming`` (its streaming run, poisson), ``measure --semantics streaming`` with ``h2o``, ``tova`` and
``poisson`` (online scores, chunk 1, one kept set per key/value head) and the floor, a bare decode
loop over a cache of k slots (the model's own attention; after each token the oldest key is dropped).

One process, one thread (``torch.set_num_threads(1)``), the reference model loaded once; every path
streams the same B sequences of the builtin ``long`` corpus (the first B · N tokens, cut into B rows)
at budget k, one warm-up run of 64 tokens first. Times are CPU seconds of the process
(``time.process_time``: other jobs on a shared machine do not count; with one thread it is the work
done) divided by N, the token steps of one run. ``exponent``: the least-squares slope of
log(time per run) against log N (1: linear per target, O(1) per step); ``/floor``: time per step
over the floor's at the same N.

Usage::

    python benchmarks/streaming_cost.py                          # N = 512 2048 8192, k = 128, batch 4
    python benchmarks/streaming_cost.py --lengths 512 2048 4096 --paths certify,floor
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens, not an installed one

import torch  # noqa: E402

from truncsens.certificates.designs import CertifyDesign  # noqa: E402
from truncsens.certificates.probe import check_model  # noqa: E402
from truncsens.certificates.stream_passes import stream_run  # noqa: E402
from truncsens.corpora.builtin import long_documents  # noqa: E402
from truncsens.engine import kvcache  # noqa: E402
from truncsens.engine.semantics import SEMANTICS  # noqa: E402
from truncsens.models import load_model  # noqa: E402
from truncsens.policies import make_policy  # noqa: E402

PATHS = ("certify", "h2o", "tova", "poisson", "floor")


@torch.no_grad()
def floor(model, ids: torch.Tensor, budget: int) -> None:
    """Decode ``ids`` [B, N] token by token over a cache of at most k slots (the k - 1 most recent keys)."""
    B, N = ids.shape
    cache = kvcache.new_cache(model)
    for t in range(N):
        pos = torch.full((B, 1), t, dtype=torch.long)
        model(input_ids=ids[:, t : t + 1], position_ids=pos, use_cache=True, logits_to_keep=1,
              **{kvcache.cache_keyword(model): cache})
        if t + 1 >= budget:  # keep the k - 1 most recent keys: the next query's own makes k
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, 1 - budget :], layer.values[:, :, 1 - budget :]


def run(path: str, model, ids: torch.Tensor, budget: int) -> None:
    """One streaming run of ``path`` over ``ids`` [B, N]."""
    B = ids.shape[0]
    if path == "certify":
        stream_run(model, ids, make_policy("poisson"), budget, list(range(B)), 0.05, CertifyDesign())
    elif path == "floor":
        floor(model, ids, budget)
    else:
        SEMANTICS["streaming"].stream(model, ids, make_policy(path), budget, list(range(B)), 1, "head")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--paths", default=",".join(PATHS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = args.paths.split(",")
    lm = load_model("reference")
    model = lm.model.eval()
    check_model(model, "reference")
    text = "\n".join(doc.text for doc in long_documents())
    tokens = torch.tensor(lm.tokenizer(text)["input_ids"][: args.batch * max(args.lengths)])
    if tokens.numel() < args.batch * max(args.lengths):
        raise SystemExit(f"the long corpus has {tokens.numel()} tokens, fewer than {args.batch} x {max(args.lengths)}")
    rows = tokens.view(args.batch, -1)  # [B, max N]
    for path in paths:  # warm-up: first-call costs
        run(path, model, rows[:, :64], 16)
    per_step: dict[str, list[float]] = {p: [] for p in paths}
    cfg = model.config
    print(f"streaming cost per token step, reference model ({cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads), k = {args.budget}, batch {args.batch}, "
          f"1 thread, CPU time of one process")
    print(f"{'path':8} {'N':>6} {'ms/step':>8} {'/floor':>7}")
    for N in args.lengths:
        ids = rows[:, :N].contiguous()
        for path in paths:
            start = time.process_time()
            run(path, model, ids, args.budget)
            per_step[path].append((time.process_time() - start) / N)
        for path in paths:
            ratio = per_step[path][-1] / per_step["floor"][-1] if "floor" in per_step else math.nan
            print(f"{path:8} {N:>6} {1e3 * per_step[path][-1]:>8.2f} {ratio:>7.2f}", flush=True)
    logn = torch.tensor([math.log(n) for n in args.lengths], dtype=torch.float64)
    print(f"exponent of time per run in N ({args.lengths[0]} to {args.lengths[-1]}; 1: O(1) per step):")
    for path in paths:
        y = torch.tensor([math.log(t * n) for t, n in zip(per_step[path], args.lengths)], dtype=torch.float64)
        slope = float(((logn - logn.mean()) * (y - y.mean())).sum() / ((logn - logn.mean()) ** 2).sum())
        print(f"  {path:8} {slope:.2f}")


if __name__ == "__main__":
    main()
