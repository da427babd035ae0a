"""Streaming semantics: the engine's run vs a token-by-token loop that rebuilds the cache, in one run.

Both compute the same thing (the equality is tested in ``tests/test_masks_streaming.py`` and
``tests/test_streaming_online.py``): the next-token distribution after ``--length`` tokens of one
cache that evicts as it goes. The engine (:meth:`truncsens.engine.semantics.Streaming.stream`, chunk
``--chunk``) decides and runs in one go: one masked forward per batch for policies without scores
(suffix, sink_recent, random), one batched forward per chunk with online scores otherwise (h2o, tova,
key_norm, poisson). The loop (``tests/oracles.streaming_loop``) is then given the engine's kept sets
and runs one forward per token and sequence against a cache rebuilt from the kept keys/values.
Prints ``engine_vs_loop`` = loop seconds / engine seconds (acceptance: >= 5 at chunk 1 on 512-token
sequences on 2 CPU cores) and the largest difference of the log-probabilities.

Usage::

    python benchmarks/policies_throughput.py                    # reference model (or a random one of its size)
    python benchmarks/policies_throughput.py --policy sink_recent --budget 128 --sequences 4 --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test oracles
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens

from oracles import streaming_loop as streaming_logprobs_loop  # noqa: E402
from truncsens.engine.semantics import SEMANTICS  # noqa: E402
from truncsens.policies import make_policy  # noqa: E402

# the architecture of truncsens.models.reference.train.TrainConfig, for when the weights are absent
REFERENCE_SIZE = dict(vocab_size=4096, hidden_size=320, intermediate_size=864, num_hidden_layers=5,
                      num_attention_heads=5, num_key_value_heads=5, max_position_embeddings=1024)


def build_model(name: str, device: str):
    """(model, description): the named model, or a random Llama of the reference size."""
    from truncsens.models import REFERENCE_DIR, load_model

    if name != "reference" or (REFERENCE_DIR / "config.json").is_file():
        return load_model(name, device).model, name
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**REFERENCE_SIZE)).to(device).eval()
    return model, "random Llama of the reference size (weights absent)"


def sync(device: str) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    """Time the engine's streaming run and the token-by-token loop on the same kept sets; print the ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="reference")
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1, help="streaming decision interval of the engine (tokens)")
    p.add_argument("--length", type=int, default=512, help="tokens per sequence")
    p.add_argument("--sequences", type=int, default=8, help="sequences, batched by the engine as a run batches targets")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for both (default: torch's; on a machine whose cores are busy, 1 avoids "
                        "thread-synchronization stalls that would dominate either timing)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, name = build_model(args.model, args.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.sequences, args.length), generator=g).to(args.device)  # [B, T]
    policy = make_policy(args.policy)
    streaming = SEMANTICS["streaming"]
    seeds = list(range(args.sequences))

    streaming.stream(model, ids[:1, :64], policy, min(args.budget, 32), seeds[:1], args.chunk)  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    fast, evictions = streaming.stream(model, ids, policy, args.budget, seeds, args.chunk)
    sync(args.device)
    t_engine = time.perf_counter() - t0
    kept = evictions.kept()  # [B, T, T] the engine's decisions, for the loop
    t0 = time.perf_counter()
    slow = streaming_logprobs_loop(model, ids, kept.keep, kept.offset)
    sync(args.device)
    t_loop = time.perf_counter() - t0
    out = {
        "model": name, "device": args.device, "threads": torch.get_num_threads(), "policy": args.policy,
        "budget": args.budget, "chunk": args.chunk, "length": args.length, "sequences": args.sequences,
        "engine_seconds": t_engine, "loop_seconds": t_loop, "engine_vs_loop": t_loop / t_engine,
        "max_abs_logprob_diff": float((fast - slow).abs().max()),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{name} on {args.device} ({out['threads']} threads): {args.sequences} x {args.length} tokens, "
              f"policy {args.policy}, budget {args.budget}, chunk {args.chunk}")
        print(f"engine {t_engine:.3f} s | token-by-token loop {t_loop:.2f} s | max |diff| of log-probs "
              f"{out['max_abs_logprob_diff']:.2e}")
        print(f"engine_vs_loop {t_loop / t_engine:.1f}x")


if __name__ == "__main__":
    main()
