"""Throughput of the re-encode engine, in one run on the same targets and windows.

Prints two ratios:

1. ``engine_vs_naive``: time of the naive loop (``naive_pair`` of ``tests/oracles.py``, one
   reference forward and one kept forward per (target, window) pair, batch size 1, full logits)
   divided by the engine's time (:func:`truncsens.engine.kernel.measure_targets`). Target >= 1.8
   on 2 CPU cores.
2. ``engine_vs_bare``: engine tokens/s divided by the tokens/s of a bare batched forward of the
   same model over exactly the same sequences and batch sizes (``logits_to_keep=1``, no
   divergences, no bookkeeping). Target >= 0.8.

Usage::

    python benchmarks/measure_throughput.py                      # reference model, CPU
    python benchmarks/measure_throughput.py --random-config qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --reference-context 4096 --targets 64

``--random-config`` builds a randomly initialised model of a real architecture's size (no hub needed).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test oracles

from oracles import naive_pair  # noqa: E402
from truncsens.engine.kernel import measure_targets  # noqa: E402
from truncsens.engine.semantics import SEMANTICS  # noqa: E402
from truncsens.engine.sweep import default_windows  # noqa: E402
from truncsens.policies import make_policy  # noqa: E402
from truncsens.targets import TargetSet  # noqa: E402

RANDOM_CONFIGS = {
    # sizes from the public config.json of each model
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6),
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=5e5),
}


def build_model(args):
    """(model on args.device, vocabulary size, name): a random model of --random-config, or --model loaded."""
    if args.random_config:
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

        spec = dict(RANDOM_CONFIGS[args.random_config])
        arch = spec.pop("arch")
        cfg = (Qwen2Config if arch == "qwen2" else LlamaConfig)(**spec)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
        return model.to(args.device).eval(), cfg.vocab_size, args.random_config
    from truncsens.models import load_model

    loaded = load_model(args.model, args.device, args.dtype)
    return loaded.model, loaded.model.config.vocab_size, args.model


def sync(device: str) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def bare_forward(model, targets: TargetSet, windows, device: str, batch_tokens: int) -> float:
    """Seconds for a plain batched forward over the same sequences the engine reads."""
    ctx = targets.context.to(device)
    n, N = ctx.shape
    sync(device)
    t0 = time.perf_counter()
    seqs = [(ctx, torch.arange(N, device=device))]
    for w in windows:
        index = torch.arange(N - w, N, device=device)  # the last w tokens
        seqs.append((ctx[:, index], index))
    for ids, pos in seqs:
        bs = max(1, min(n, batch_tokens // ids.shape[1]))
        for i in range(0, n, bs):
            chunk = ids[i : i + bs]
            model(input_ids=chunk, attention_mask=torch.ones_like(chunk), position_ids=pos.expand(chunk.shape[0], -1), logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    """Time engine, bare forward and naive loop on the same targets; print both ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="reference")
    p.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reference-context", type=int, default=1024)
    p.add_argument("--targets", type=int, default=16)
    p.add_argument("--naive-targets", type=int, default=None, help="targets for the naive loop (default: all)")
    p.add_argument("--batch-tokens", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    model, vocab, name = build_model(args)
    N = args.reference_context
    windows = default_windows(N)
    batch_tokens = args.batch_tokens or (16384 if args.device == "cpu" else 262144)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, vocab, (args.targets, N), generator=g)  # [n, N]
    targets = TargetSet([f"d{i}" for i in range(args.targets)], np.arange(args.targets) + N, ctx,
                        torch.randint(0, vocab, (args.targets,), generator=g))
    tokens = args.targets * (N + sum(windows))

    suffix, reencode = [make_policy("suffix")], SEMANTICS["reencode"]
    measure_targets(model, targets.subset(slice(0, 2)), suffix, windows[:2], reencode, "original", 0, args.device, batch_tokens)  # warm-up
    bare_forward(model, targets.subset(slice(0, 2)), windows[:2], args.device, batch_tokens)
    sync(args.device)
    t0 = time.perf_counter()
    measure_targets(model, targets, suffix, windows, reencode, "original", 0, args.device, batch_tokens)
    sync(args.device)
    t_engine = time.perf_counter() - t0
    t_bare = bare_forward(model, targets, windows, args.device, batch_tokens)

    n_naive = args.naive_targets or args.targets
    t0 = time.perf_counter()
    for i in range(n_naive):
        for w in windows:
            naive_pair(model, targets.context[i].to(args.device), int(targets.token_id[i]), w, 0, "original")
    sync(args.device)
    t_naive = (time.perf_counter() - t0) * args.targets / n_naive

    out = {
        "model": name, "device": args.device, "dtype": args.dtype, "reference_context": N, "windows": windows,
        "targets": args.targets, "naive_targets": n_naive, "tokens": tokens, "threads": torch.get_num_threads(),
        "engine_seconds": t_engine, "bare_seconds": t_bare, "naive_seconds": t_naive,
        "engine_tokens_per_s": tokens / t_engine, "bare_tokens_per_s": tokens / t_bare,
        "engine_vs_naive": t_naive / t_engine, "engine_vs_bare": t_bare / t_engine,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{name} on {args.device} ({args.dtype}), N={N}, {args.targets} targets x {len(windows)} windows, {tokens} tokens")
        print(f"engine {t_engine:.2f} s ({tokens / t_engine:,.0f} tok/s) | bare forward {t_bare:.2f} s "
              f"({tokens / t_bare:,.0f} tok/s) | naive loop {t_naive:.2f} s" + (" (extrapolated)" if n_naive < args.targets else ""))
        print(f"engine_vs_naive {t_naive / t_engine:.2f}x")
        print(f"engine_vs_bare {t_bare / t_engine:.2f}")


if __name__ == "__main__":
    main()
