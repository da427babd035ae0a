"""Peak memory and time of one target's measurement as the context N grows, per semantics × policy.

One sequence of N tokens through a randomly initialised tiny Llama (2 layers, hidden 64, 4 query /
2 key-value heads, vocab 256; ``--config 0.5b``: a Qwen2.5-0.5B-sized Llama, for a GPU), one target
(its query at N - 1), one budget (``--budget``, 256): the semantics' reference pass with what the
policy needs (:meth:`truncsens.engine.semantics.base.Semantics.reference`) and the policy's kept pass
(:meth:`~truncsens.engine.semantics.base.Semantics.policy_logprobs`). Paths: ``prefill_evict`` with
``sink_recent``, ``h2o``, ``tova``, ``snapkv``, ``snapkv_shared``, ``poisson``; ``streaming`` with ``sink_recent`` and
``h2o`` (eviction decisions every ``--chunk`` tokens, 16 by default). Each (path, N) runs in a fresh subprocess; peak memory is, on CPU, the growth of the
process's peak resident set (``resource.getrusage`` ``ru_maxrss``) over its resident set before the
run (after a 64-token warm-up of the same path), on CUDA ``torch.cuda.max_memory_allocated`` over the
memory allocated before it. The growth exponent of each path is the least-squares slope of
log(memory) on log(N) over the lengths from 2k up (1: linear, 2: quadratic).

Usage::

    python benchmarks/memory_scaling.py                         # CPU, N = 1k 2k 4k 8k, 1 thread
    python benchmarks/memory_scaling.py --device cuda --config 0.5b --dtype bfloat16 --lengths 8192 32768
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's truncsens (PYTHONPATH first, when set)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the peak-memory measurement of streaming_memory
from streaming_memory import peak_excess_mib  # noqa: E402

CONFIGS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
}
PATHS = (("prefill_evict", "sink_recent"), ("prefill_evict", "h2o"), ("prefill_evict", "tova"),
         ("prefill_evict", "snapkv"), ("prefill_evict", "snapkv_shared"), ("prefill_evict", "poisson"),
         ("streaming", "sink_recent"), ("streaming", "h2o"))


def run_once(semantics_name: str, policy_name: str, length: int, budget: int, config: str, device: str,
             dtype: str, chunk: int = 1) -> dict:
    """One target's reference and kept pass in this process: {"mem_mib", "seconds"}."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from truncsens.engine.semantics import SEMANTICS
    from truncsens.policies import make_policy

    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIGS[config], max_position_embeddings=max(length, 1 << 15))
    model = LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype)).eval()
    semantics = SEMANTICS[semantics_name]
    policy = make_policy(policy_name)
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1)).to(device)

    def run(x: torch.Tensor, k: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = semantics.reference(model, x, [policy])
            semantics.policy_logprobs(model, x, policy, k, [0], ref, "original", chunk=chunk if semantics.streams else 1)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    seconds, mib = peak_excess_mib(run, ids, budget, device)
    return {"mem_mib": mib, "seconds": seconds}


def measure(semantics: str, policy: str, length: int, args) -> dict:
    """:func:`run_once` in a fresh subprocess (so peaks of earlier runs do not hide this one's)."""
    cmd = [sys.executable, __file__, "--one", semantics, policy, str(length), "--budget", str(args.budget),
           "--device", args.device, "--config", args.config, "--dtype", args.dtype, "--threads", str(args.threads), "--chunk", str(args.chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return {"mem_mib": float("nan"), "seconds": float("nan"), "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(memory) on log(N) (NaN with fewer than 2 finite positive points)."""
    pts = [(math.log(n), math.log(m)) for n, m in points if m > 0 and math.isfinite(m)]
    if len(pts) < 2:
        return float("nan")
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main() -> None:
    """Measure every (path, N), print the table and each path's growth exponent (``--json``: one JSON object)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--paths", nargs="+", default=[f"{s}:{q}" for s, q in PATHS], metavar="SEMANTICS:POLICY")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=16, help="streaming: tokens per eviction decision (--chunk of measure)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 avoids thread-pool stalls)")
    p.add_argument("--fit-from", type=int, default=2048, help="shortest N of the exponent's fit")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--one", nargs=3, metavar=("SEMANTICS", "POLICY", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        semantics, policy, length = args.one
        print(json.dumps(run_once(semantics, policy, int(length), args.budget, args.config, args.device, args.dtype,
                                    args.chunk)))
        return
    paths = [tuple(s.split(":")) for s in args.paths]
    rows = {}
    if not args.json:
        print(f"one target, budget {args.budget}, streaming chunk {args.chunk}; {args.device}, {args.threads} thread(s); Llama {args.config} "
              f"({CONFIGS[args.config]['num_hidden_layers']} layers, hidden {CONFIGS[args.config]['hidden_size']}), "
              f"{args.dtype}")
        print(f"{'semantics':14} {'policy':13} {'N':>6} {'peak MiB':>9} {'seconds':>8}")
    for semantics, policy in paths:
        for n in args.lengths:
            r = measure(semantics, policy, n, args)
            rows[f"{semantics}:{policy}:{n}"] = r
            if not args.json:
                print(f"{semantics:14} {policy:13} {n:6d} {r['mem_mib']:9.1f} {r['seconds']:8.2f}"
                      + (f"  {r['error']}" if "error" in r else ""), flush=True)
    fits = {f"{s}:{q}": exponent([(n, rows[f"{s}:{q}:{n}"]["mem_mib"]) for n in args.lengths if n >= args.fit_from])
            for s, q in paths}
    if args.json:
        print(json.dumps({"points": rows, "exponents": fits}))
        return
    print(f"growth exponent of peak memory in N (least squares on log-log, N >= {args.fit_from}; 1 linear, 2 quadratic):")
    for key, e in fits.items():
        print(f"  {key:28} {e:5.2f}")


if __name__ == "__main__":
    main()
