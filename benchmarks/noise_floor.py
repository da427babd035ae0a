"""The noise floor of a float32 forward pass on your device (docs/precision.md, "Noise floor of the
forward pass itself"). Not a speed benchmark.

Two forward passes equal in exact arithmetic give float32 logits that differ by the order of their
sums. For random Llama weights (h=128, 2 layers, V=4096, T=128 and h=512, 4 layers, V=32000, T=512;
16 random sequences) it compares the last position's next-token distribution of

- 16 batches of 1 against one batch of 16, and
- a full forward against a KV-cache step (the prefix prefilled, the last token decoded),

printing TV (max, median), KL and JS maxima, the largest logit difference and the clamped count.
The metric records' noise floors (truncsens/metrics.py) are the largest values measured on CPU,
rounded up.

    python benchmarks/noise_floor.py [cuda]
"""
from __future__ import annotations

import platform
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from truncsens.divergences import all_metrics
from truncsens.engine.kvcache import cache_keyword, new_cache

CONFIGS = ((128, 2, 4096, 128), (512, 4, 32000, 512))  # hidden, layers, vocab, T


def model(hidden: int, layers: int, vocab: int, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with ``hidden // 32`` heads and ``hidden // 64`` key/value heads, in eval mode."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def last_logits(m: LlamaForCausalLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The last position's float32 logits ``[n, V]`` of ``ids`` ``[n, T]``: ``one`` (n batches of 1),
    ``full`` (one batch of n) and ``step`` (a KV-cache step after a prefill of the first T − 1 tokens)."""
    with torch.no_grad():
        one = torch.cat([m(input_ids=ids[i:i + 1]).logits[:, -1].float() for i in range(ids.shape[0])])
        full = m(input_ids=ids).logits[:, -1].float()
        cache, kw = new_cache(m), cache_keyword(m)  # the keyword of the installed transformers
        m(input_ids=ids[:, :-1], use_cache=True, **{kw: cache})  # prefill: fills ``cache`` in place
        step = m(input_ids=ids[:, -1:], use_cache=True, **{kw: cache}).logits[:, -1].float()
    return {"one": one, "full": full, "step": step}


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """TV max and median, KL and JS maxima, max |logit diff| and the clamped count of two ``[n, V]`` logits."""
    mt, n = all_metrics(a, b, torch.zeros(a.shape[0], dtype=torch.long))
    return {"tv_max": float(mt["tv"].max()), "tv_median": float(mt["tv"].median()), "kl_max": float(mt["kl"].max()),
            "js_max": float(mt["js"].max()), "logit_diff": float((a - b).abs().max()), "clamped": n}


def main(device: str = "cpu") -> None:
    print(f"{device} ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    for hidden, layers, vocab, T in CONFIGS:
        m = model(hidden, layers, vocab).to(device)
        ids = torch.randint(0, vocab, (16, T), generator=g).to(device)
        out = last_logits(m, ids)
        tag = f"{device} Llama h={hidden} L={layers} V={vocab} T={T}"
        for label, (a, b) in (("batch 1 vs batch 16", ("one", "full")), ("full forward vs KV-cache step", ("full", "step"))):
            r = compare(out[a], out[b])
            print(f"{tag} {label}: TV max {r['tv_max']:.1e} median {r['tv_median']:.1e} | KL max {r['kl_max']:.1e} | "
                  f"JS max {r['js_max']:.1e} | max |logit diff| {r['logit_diff']:.1e} | clamped {r['clamped']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
