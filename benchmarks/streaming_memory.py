"""Peak memory and time of a streaming run as the context grows: attention from eviction steps vs a dense mask.

One sequence of T tokens (T = 1k, 4k, 16k) through a randomly initialised small Llama (hidden 256,
4 layers, 4 heads, 2 key/value heads, vocab 32000), streaming semantics, a policy without scores
(``sink_recent`` and ``random``, budget 256, chunk 1): the decisions (eviction steps, O(T)) and one
forward. ``evict`` is the engine's path (:mod:`truncsens.engine.evict_attention`: query chunks with
SDPA on CPU, FlexAttention on CUDA; no T x T mask); ``dense`` builds the per-query kept sets and the
[B, 1, T, T] additive mask (the engine's path before attention from eviction steps), run up to 4k
tokens only. ``online`` is a policy with online scores (``h2o``, budget 256, chunk 1, T = 2k, 4k,
8k, 16k: ``--online-lengths``), run sequentially on a cache compacted to O(k + C) slots
(:func:`truncsens.engine.streaming_pass.stream_online`; its time is decisions and forward together):
its peak memory holds the cache and [B, T] decision buffers, so its exponent in T (the least-squares
slope of log peak memory on log T over T >= 2k, printed for every path) stays at most 1.1. Each
(path, policy, T) runs in a fresh subprocess; peak memory is, on CPU, the growth of the process's
peak resident set (``VmHWM``, reset before the run: :func:`reset_peak_rss`) over its resident set
before the run (after a 64-token warm-up), and on CUDA ``torch.cuda.max_memory_allocated`` over the
memory allocated before it. Growth ratios mem(4k)/mem(1k) and mem(16k)/mem(4k): 4 is linear, 16 quadratic.

Usage::

    python benchmarks/streaming_memory.py                      # CPU, T = 1024 4096 16384 (h2o: 2048 .. 16384)
    python benchmarks/streaming_memory.py --device cuda --lengths 1024 4096 16384 65536

Measured on 2 CPU cores (torch 2.13, transformers 5.24; ``python benchmarks/streaming_memory.py``)::

    streaming, budget 256, chunk 1, one sequence; cpu, 2 threads; Llama hidden 256, 4 layers, 4/2 heads, vocab 32000
    path   policy            T  peak MiB  decide s forward s
    evict  sink_recent    1024      22.3      6.67     12.55
    evict  sink_recent    4096     117.6     11.07     24.46
    evict  sink_recent   16384     383.5    127.30     89.54
    dense  sink_recent    1024      45.3      3.56      5.93
    dense  sink_recent    4096     254.6     17.63     13.44
    evict  random         1024      32.5      2.58     12.56
    evict  random         4096     110.9     18.17     27.43
    evict  random        16384     400.8     82.26     20.53
    dense  random         1024      40.2      1.08      3.01
    dense  random         4096     271.9      3.44      3.80
    growth of peak memory (4 = linear in T, 16 = quadratic):
      evict  sink_recent  mem(4096)/mem(1024)   5.3 mem(16384)/mem(4096)   3.3
      dense  sink_recent  mem(4096)/mem(1024)   5.6
      evict  random       mem(4096)/mem(1024)   3.4 mem(16384)/mem(4096)   3.6
      dense  random       mem(4096)/mem(1024)   6.8

The evict path grows linearly (16k / 1k: 17x and 12x for 16x the tokens); at 1k-4k the dense path's
fixed overheads still hide its T^2 terms (its [1, 1, T, T] float mask alone is 64 MiB at 4k and
1 GiB at 16k, plus the [T, T] kept set and offsets), but it already needs 2.2-2.5x the evict path's
memory at 4k. The times were taken while the 2 cores ran about 16 other processes (load average
~16), which stalls torch's thread pool on every small op and penalises the evict path's many small
per-chunk ops: in one process with ``torch.set_num_threads(1)`` at T = 2048 (sink_recent) the
forward took 1.2 s (evict) vs 1.5 s (dense). Use ``--threads 1`` on a busy machine; with it
(``--policies sink_recent --threads 1``, load average ~5)::

    path   policy            T  peak MiB  decide s forward s
    evict  sink_recent    1024      30.4      1.34      0.48
    evict  sink_recent    4096      86.2      6.02      1.98
    evict  sink_recent   16384     405.6     35.71      4.12
    dense  sink_recent    1024      28.3      0.57      0.46
    dense  sink_recent    4096     281.9      2.92      2.32
    growth of peak memory (4 = linear in T, 16 = quadratic):
      evict  sink_recent  mem(4096)/mem(1024)   2.8 mem(16384)/mem(4096)   4.7
      dense  sink_recent  mem(4096)/mem(1024)  10.0

The decisions (``decide s``: :func:`truncsens.policies.streaming.run_stream`, one policy step per
token) dominated the time at 16k in those runs; the forward grows linearly. ``suffix`` and
``sink_recent`` now take their eviction steps in closed form
(:func:`truncsens.policies.streaming.recent_eviction_steps`, equal to the loop: tests/test_policies.py):
0.002 s at 4k and under 0.1 s at 16k and 32k tokens, against 1.3 s for the loop at 4k (1 thread);
``random`` from a heap of its priorities (``RandomPolicy.eviction_steps``): 0.8 s for 8 sequences
of 16k tokens.
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's truncsens

CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1 << 17)
DENSE_MAX = 4096  # the dense mask is O(T^2): 16k tokens would need several GB
ONLINE_LENGTHS = (2048, 4096, 8192, 16384)  # the online path, token by token: T >= 2k


def rss_bytes() -> int:
    """The process's current resident set size in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Reset the process's peak resident set to its current one (Linux: ``5`` to ``/proc/self/clear_refs``),
    so that a peak of building the model or of the warm-up does not hide a smaller run's; nothing
    where that file cannot be written (then the peak counts from the process start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes since :func:`reset_peak_rss` (``VmHWM`` of
    ``/proc/self/status``, else ``ru_maxrss``, both in KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_excess_mib(run, ids: torch.Tensor, budget: int, device: str):
    """``(run(ids, budget), MiB)``: after a warm-up run on the first 64 tokens (libraries, thread pools,
    allocator), the peak memory of the run above what was held before it (CUDA: allocated bytes;
    CPU: resident set, its peak reset before the run)."""
    run(ids[:, :64], 16)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
        reset_peak_rss()
    result = run(ids, budget)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else peak_rss_bytes()
    return result, (peak - base) / 2 ** 20


def run_once(path: str, policy_name: str, length: int, budget: int, device: str) -> dict:
    """One streaming run in this process: {"mem_mib", "decide_s", "forward_s"} (``online``: the
    sequential run with online scores, decisions and forward together in ``forward_s``, ``decide_s`` None)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from truncsens.engine.semantics import SEMANTICS
    from truncsens.engine.streaming_pass import decide_offline
    from truncsens.policies import make_policy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(device).eval()
    streaming = SEMANTICS["streaming"]
    policy = make_policy(policy_name)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1)).to(device)

    def run(x: torch.Tensor, k: int) -> tuple[float | None, float]:
        t0 = time.perf_counter()
        if path == "online":  # the cache compacted to O(k + C) slots (truncsens.engine.streaming_pass)
            with torch.no_grad():
                streaming.stream(model, x, policy, k, [0], chunk=1)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            return None, time.perf_counter() - t0
        ev = decide_offline(policy, k, x.shape[1], 1, [0], device)
        t_decide = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            streaming.kept_logprobs(model, x, ev if path == "evict" else ev.kept(), None, "original")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return t_decide, time.perf_counter() - t0

    (t_decide, t_forward), mib = peak_excess_mib(run, ids, budget, device)
    return {"mem_mib": mib, "decide_s": t_decide, "forward_s": t_forward}


def measure(path: str, policy: str, length: int, budget: int, device: str) -> dict:
    """:func:`run_once` in a fresh subprocess (so peaks of earlier runs do not hide this one's)."""
    cmd = [sys.executable, __file__, "--one", path, policy, str(length), "--budget", str(budget), "--device", device,
           "--threads", str(torch.get_num_threads())]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:5.1f}" if a and b else "    -"


def exponent(lengths: list[int], mem: list[float]) -> float:
    """The least-squares slope of log(peak MiB) on log(T): 1 linear in T, 2 quadratic."""
    x, y = np.log(np.asarray(lengths, float)), np.log(np.asarray(mem, float))
    return float(np.polyfit(x, y, 1)[0])


def path_of(policy: str) -> tuple[str, ...]:
    """The paths a policy runs: ``online`` for a policy with online scores, else ``evict`` and ``dense``."""
    from truncsens.policies import make_policy

    return ("online",) if make_policy(policy).needs_scores else ("evict", "dense")


def lengths_of(path: str, args) -> list[int]:
    """The context lengths of ``path``: ``--online-lengths`` for ``online``, ``--lengths`` up to
    :data:`DENSE_MAX` for ``dense``, ``--lengths`` for ``evict``."""
    if path == "online":
        return args.online_lengths
    return [T for T in args.lengths if path != "dense" or T <= DENSE_MAX]


def main() -> None:
    """Measure every (path, policy, T) and print the table and the growth ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--policies", nargs="+", default=["sink_recent", "random", "h2o"],
                   help="policies without scores run the evict and dense paths, those with online scores "
                        "(h2o) the online path")
    p.add_argument("--online-lengths", type=int, nargs="+", default=list(ONLINE_LENGTHS),
                   help="context lengths of the online path (token by token)")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 avoids thread-pool stalls on a busy machine)")
    p.add_argument("--one", nargs=3, metavar=("PATH", "POLICY", "T"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        path, policy, length = args.one
        print(json.dumps(run_once(path, policy, int(length), args.budget, args.device)))
        return
    print(f"streaming, budget {args.budget}, chunk 1, one sequence; {args.device}, {torch.get_num_threads()} threads; "
          f"Llama hidden 256, 4 layers, 4/2 heads, vocab 32000")
    print(f"{'path':6} {'policy':12} {'T':>6} {'peak MiB':>9} {'decide s':>9} {'forward s':>9}")
    mem: dict[tuple[str, str, int], float] = {}
    for policy in args.policies:
        for path in path_of(policy):
            for T in lengths_of(path, args):
                r = measure(path, policy, T, args.budget, args.device)
                mem[path, policy, T] = r["mem_mib"]
                decide = "-" if r["decide_s"] is None else f"{r['decide_s']:.2f}"
                print(f"{path:6} {policy:12} {T:6d} {r['mem_mib']:9.1f} {decide:>9} {r['forward_s']:9.2f}", flush=True)
    print("growth of peak memory (4 = linear in T, 16 = quadratic):")
    for policy in args.policies:
        for path in path_of(policy):
            Ts = [T for T in lengths_of(path, args) if (path, policy, T) in mem]
            steps = " ".join(f"mem({b})/mem({a}) {ratio(mem[path, policy, a], mem[path, policy, b])}"
                             for a, b in zip(Ts, Ts[1:]))
            print(f"  {path:6} {policy:12} {steps}")
    fitted = [(path, policy) for policy in args.policies for path in path_of(policy)]
    print("exponent of peak memory in T, fitted over T >= 2048 (1 = linear, 2 = quadratic):")
    for path, policy in fitted:
        Ts = [T for T in lengths_of(path, args) if T >= 2048 and mem.get((path, policy, T), 0) > 0]
        if len(Ts) >= 2:
            slope = exponent(Ts, [mem[path, policy, T] for T in Ts])
            print(f"  {path:6} {policy:12} T = {Ts[0]}..{Ts[-1]}: {slope:.2f}")


if __name__ == "__main__":
    main()
