"""Cost per streamed token of the merging caches against ``sink_recent`` run the same way, in one run.

Each policy streams ``--sequences`` sequences of ``--length`` tokens token by token (chunk 1) at
budget ``--budget``, on the reference model (or a random Llama of its size): ``sink_recent`` through
the engine's sequential evicting cache (:func:`truncsens.engine.streaming_pass.stream_online`, one
batched forward per token, evicted slots dropped), ``merge_mean`` and ``merge_nearest`` through the
merging cache (:func:`truncsens.engine.merge_pass.stream_merging`: the same forward per token, plus
the merge of the cache's slots and, for ``merge_nearest``, the key similarities). Each is timed
``--repeats`` times (CPU seconds of this process; the best); prints ms per token and the ratio to
``sink_recent``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/merge_cost.py
    OMP_NUM_THREADS=1 python benchmarks/merge_cost.py --budget 256 --length 1024 --sequences 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # build_model
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens

import torch  # noqa: E402

from policies_throughput import build_model  # noqa: E402
from truncsens.engine.attention_windows import layer_windows  # noqa: E402
from truncsens.engine.merge_pass import stream_merging  # noqa: E402
from truncsens.engine.streaming_pass import stream_online  # noqa: E402
from truncsens.policies import make_policy  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    model, described = build_model(args.model, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.sequences, args.length), generator=g)  # [B, T]
    windows = layer_windows(model)
    runs = {
        "sink_recent": lambda: stream_online(model, ids, make_policy("sink_recent"), args.budget,
                                             list(range(args.sequences)), 1, windows),
        "merge_mean": lambda: stream_merging(model, ids, make_policy("merge_mean"), args.budget),
        "merge_nearest": lambda: stream_merging(model, ids, make_policy("merge_nearest"), args.budget),
    }
    print(f"model: {described}; {args.sequences} sequences x {args.length} tokens, budget {args.budget}, chunk 1, "
          f"{torch.get_num_threads()} thread(s); CPU seconds, best of {args.repeats}")
    base = None
    for name, fn in runs.items():
        best = float("inf")
        for _ in range(args.repeats):
            start = time.process_time()
            fn()
            best = min(best, time.process_time() - start)
        per_token = 1000 * best / args.length
        base = base or per_token
        print(f"  {name:>14}  {best:7.2f} s  {per_token:6.2f} ms per token  x{per_token / base:.2f} of sink_recent")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
