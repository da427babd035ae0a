"""Streaming semantics: the one-pass 4D-mask forward vs the token-by-token loop, in one run.

Both compute the same thing (:mod:`truncsens.engine.streaming`; the equality is tested in
``tests/test_masks_streaming.py``): the next-token distribution after ``--length`` tokens when every
token was processed with its own policy-kept keys. The loop runs one forward per token against a
cache rebuilt from the kept keys/values at every step; the mask path runs one forward per batch.
Prints ``mask_vs_loop`` = loop seconds / mask seconds (acceptance: >= 5 on 512-token sequences on
2 CPU cores) and the largest difference of the log-probabilities.

Usage::

    python benchmarks/policies_throughput.py                    # reference model (or a random one of its size)
    python benchmarks/policies_throughput.py --policy random --budget 128 --sequences 4 --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test oracles

from engine_calls import streaming_logprobs  # noqa: E402
from oracles import streaming_loop as streaming_logprobs_loop  # noqa: E402
from truncsens.engine.reference_pass import reference_pass  # noqa: E402
from truncsens.policies import make_policy  # noqa: E402

# the architecture of truncsens.reference.train.TrainConfig, for when the weights are absent
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
    """Time the streaming mask path and the token-by-token loop on the same kept sets; print the ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="reference")
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", default="sink_recent")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--length", type=int, default=512, help="tokens per sequence")
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    model, name = build_model(args.model, args.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.sequences, args.length), generator=g).to(args.device)  # [B, T]
    policy = make_policy(args.policy)
    queries = torch.arange(args.length, device=args.device)
    scores = reference_pass(model, ids, attention=True).attention.cumsum(1) if policy.needs_scores else None
    kept = policy.keep(args.length, args.budget, queries, list(range(args.sequences)), scores)

    streaming_logprobs(model, ids[:1, :64], kept.keep[:1, :64, :64], kept.offset[:1, :64, :64])  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    fast = streaming_logprobs(model, ids, kept.keep, kept.offset)
    sync(args.device)
    t_mask = time.perf_counter() - t0
    t0 = time.perf_counter()
    slow = streaming_logprobs_loop(model, ids, kept.keep, kept.offset)
    sync(args.device)
    t_loop = time.perf_counter() - t0
    out = {
        "model": name, "device": args.device, "threads": torch.get_num_threads(), "policy": args.policy,
        "budget": args.budget, "length": args.length, "sequences": args.sequences, "mask_seconds": t_mask,
        "loop_seconds": t_loop, "mask_vs_loop": t_loop / t_mask, "max_abs_logprob_diff": float((fast - slow).abs().max()),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{name} on {args.device} ({out['threads']} threads): {args.sequences} x {args.length} tokens, "
              f"policy {args.policy}, budget {args.budget}")
        print(f"mask {t_mask:.3f} s | token-by-token loop {t_loop:.2f} s | max |diff| of log-probs {out['max_abs_logprob_diff']:.2e}")
        print(f"mask_vs_loop {t_loop / t_mask:.1f}x")


if __name__ == "__main__":
    main()
