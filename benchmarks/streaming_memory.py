"""Peak memory and time of a streaming run as the context grows: attention from eviction steps vs a dense mask.

One sequence of T tokens (T = 1k, 4k, 16k) through a randomly initialised small Llama (hidden 256,
4 layers, 4 heads, 2 key/value heads, vocab 32000), streaming semantics, a policy without scores
(``sink_recent`` and ``random``, budget 256, chunk 1): the decisions (eviction steps, O(T)) and one
forward. ``evict`` is the engine's path (:mod:`truncsens.engine.evict_attention`: query chunks with
SDPA on CPU, FlexAttention on CUDA; no T x T mask); ``dense`` builds the per-query kept sets and the
[B, 1, T, T] additive mask (the path before issue 9 item 3), run up to 4k tokens only. Each
(path, policy, T) runs in a fresh subprocess; peak memory is, on CPU, the growth of the process's
peak resident set (``resource.getrusage`` ``ru_maxrss``) over its resident set before the run (after
a 64-token warm-up), and on CUDA ``torch.cuda.max_memory_allocated`` over the memory allocated before
it. Growth ratios mem(4k)/mem(1k) and mem(16k)/mem(4k): 4 is linear, 16 quadratic.

Usage::

    python benchmarks/streaming_memory.py                      # CPU, T = 1024 4096 16384
    python benchmarks/streaming_memory.py --device cuda --lengths 1024 4096 16384 65536

Measured on 2 CPU cores (shared with other jobs; torch 2.13, transformers 5.24), budget 256, chunk 1:

    (filled in below by running this script)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's truncsens

CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1 << 17)
PATHS = ("evict", "dense")
DENSE_MAX = 4096  # the dense mask is O(T^2): 16k tokens would need several GB


def rss_bytes() -> int:
    """The process's current resident set size in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_once(path: str, policy_name: str, length: int, budget: int, device: str) -> dict:
    """One streaming run in this process: {"mem_mib", "decide_s", "forward_s"}."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from truncsens.engine.semantics import SEMANTICS
    from truncsens.engine.streaming_pass import decide_offline
    from truncsens.policies import make_policy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(device).eval()
    streaming = SEMANTICS["streaming"]
    policy = make_policy(policy_name)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1)).to(device)

    def run(x: torch.Tensor, k: int) -> float:
        t0 = time.perf_counter()
        ev = decide_offline(policy, k, x.shape[1], 1, [0], device)
        t_decide = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            streaming.kept_logprobs(model, x, ev if path == "evict" else ev.kept(), None, "original")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return t_decide, time.perf_counter() - t0

    run(ids[:, :64], 16)  # warm-up: libraries, thread pools, allocator
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    t_decide, t_forward = run(ids, budget)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else peak_rss_bytes()
    return {"mem_mib": (peak - base) / 2 ** 20, "decide_s": t_decide, "forward_s": t_forward}


def measure(path: str, policy: str, length: int, budget: int, device: str) -> dict:
    """:func:`run_once` in a fresh subprocess (so peaks of earlier runs do not hide this one's)."""
    cmd = [sys.executable, __file__, "--one", path, policy, str(length), "--budget", str(budget), "--device", device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:5.1f}" if a and b else "    -"


def main() -> None:
    """Measure every (path, policy, T) and print the table and the growth ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--policies", nargs="+", default=["sink_recent", "random"])
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--one", nargs=3, metavar=("PATH", "POLICY", "T"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        path, policy, length = args.one
        print(json.dumps(run_once(path, policy, int(length), args.budget, args.device)))
        return
    print(f"streaming, budget {args.budget}, chunk 1, one sequence; {args.device}, {torch.get_num_threads()} threads; "
          f"Llama hidden 256, 4 layers, 4/2 heads, vocab 32000")
    print(f"{'path':6} {'policy':12} {'T':>6} {'peak MiB':>9} {'decide s':>9} {'forward s':>9}")
    mem: dict[tuple[str, str, int], float] = {}
    for policy in args.policies:
        for path in PATHS:
            for T in args.lengths:
                if path == "dense" and T > DENSE_MAX:
                    continue
                r = measure(path, policy, T, args.budget, args.device)
                mem[path, policy, T] = r["mem_mib"]
                print(f"{path:6} {policy:12} {T:6d} {r['mem_mib']:9.1f} {r['decide_s']:9.2f} {r['forward_s']:9.2f}",
                      flush=True)
    print("growth of peak memory (4 = linear in T, 16 = quadratic):")
    for policy in args.policies:
        for path in PATHS:
            Ts = [T for T in args.lengths if (path, policy, T) in mem]
            steps = " ".join(f"mem({b})/mem({a}) {ratio(mem[path, policy, a], mem[path, policy, b])}"
                             for a, b in zip(Ts, Ts[1:]))
            print(f"  {path:6} {policy:12} {steps}")


if __name__ == "__main__":
    main()
