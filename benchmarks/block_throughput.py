"""Throughput of the block protocol (:func:`truncsens.engine.block.passes.measure_blocks`) at long
reference contexts: forward tokens/s and model FLOPs utilization (MFU).

FLOPs counted (forward only, per token and per pass): ``2 x`` the non-embedding parameters per
token (every matrix multiply of the layers), the causal attention ``4 x layers x heads x head_dim x
L^2 / 2`` per pass of L tokens (QK^T and AV, half the square by causality), and the output head
``2 x hidden x vocab`` per kept logit row (Kaplan et al. 2020, arXiv 2001.08361, table 1, with the
causal half of the attention). MFU = FLOPs / seconds / ``--peak-tflops`` (default 989, the dense
bfloat16 peak of an H100/H200 SXM).

Usage::

    python benchmarks/block_throughput.py --random-config qwen2.5-0.5b --device cuda --dtype bfloat16 \\
        --reference-context 32768 --blocks 2
    python benchmarks/block_throughput.py --model reference --reference-context 512 --blocks 2   # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens
sys.path.insert(0, str(Path(__file__).resolve().parent))  # measure_throughput's random configs

from measure_throughput import RANDOM_CONFIGS, build_model, sync  # noqa: E402
from truncsens.engine.block.plan import block_length, block_passes  # noqa: E402
from truncsens.engine.block.passes import choose_attention, measure_blocks  # noqa: E402
from truncsens.engine.sweep import default_windows  # noqa: E402
from truncsens.targets import TokenDoc, select_block_targets  # noqa: E402


def model_flops(model, shapes: list[tuple[int, int]]) -> float:
    """Forward FLOPs of the passes ``shapes`` (module docstring)."""
    cfg = model.config
    emb = model.get_input_embeddings().weight.numel()
    head = 0 if getattr(cfg, "tie_word_embeddings", False) else model.get_output_embeddings().weight.numel()
    dense = sum(p.numel() for p in model.parameters()) - emb - head  # the layers' matrices (and norms)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    return float(sum(2 * dense * L + attn * L * L / 2 + 2 * cfg.hidden_size * cfg.vocab_size * k for L, k in shapes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS))
    p.add_argument("--model", default="reference")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reference-context", type=int, default=8192)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--block-fraction", type=float, default=0.125)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=None)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model, vocab, name = build_model(args)
    attention = choose_attention(model, args.device)
    N = args.reference_context
    max_context = int(getattr(model.config, "max_position_embeddings", N))
    room = max(0, max_context - N)
    B = block_length(N, args.block_fraction, args.block_size)
    windows = default_windows(N)
    g = torch.Generator().manual_seed(0)
    docs = [TokenDoc(f"d{i}", torch.randint(0, vocab, (N + B,), generator=g)) for i in range(args.blocks + 1)]
    targets = select_block_targets(docs, N, B, 0, B)
    batch_tokens = args.batch_tokens or (16384 if args.device == "cpu" else 262144)
    warm = targets.subset(slice(0, B))
    measure_blocks(model, warm, windows[:3], 0, "original", args.block_fraction, args.block_size, args.device,
                   batch_tokens, room=room)  # warm-up
    sync(args.device)
    rest = targets.subset(slice(B, len(targets)))
    start = time.perf_counter()
    out = measure_blocks(model, rest, windows, 0, "original", args.block_fraction, args.block_size, args.device,
                         batch_tokens, room=room)
    sync(args.device)
    seconds = time.perf_counter() - start
    flops = model_flops(model, block_passes(B, N, windows, 0, args.block_fraction, args.block_size, room)) * args.blocks
    result = {
        "model": name, "device": args.device, "dtype": args.dtype, "attention_implementation": attention,
        "reference_context": N, "block_length": B, "blocks": args.blocks, "targets": len(rest), "windows": windows,
        "forward_tokens": out.forward_tokens, "seconds": seconds, "tokens_per_s": out.forward_tokens / seconds,
        "targets_per_s": len(rest) / seconds, "tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / 1e12 / args.peak_tflops, "peak_tflops": args.peak_tflops,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{name} on {args.device} ({args.dtype}, {attention}), N={N}, {args.blocks} blocks of {B}: "
              f"{out.forward_tokens} tokens in {seconds:.2f} s = {result['tokens_per_s']:,.0f} tok/s, "
              f"{result['tflops']:.2f} TFLOP/s, MFU {result['mfu']:.1%}")


if __name__ == "__main__":
    main()
