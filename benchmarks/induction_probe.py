"""Does the model copy a span it has seen, and from how far back? (why the reference model
misses the copy-accuracy aim). Not a speed benchmark.

Each probe is a crop of N tokens of held-out code (the builtin ``code`` corpus, held-out split) whose
last S = 24 tokens are overwritten by a copy of the S tokens that begin D tokens before them: the
context ends with a span whose every token stood exactly D tokens earlier. A model that copies (an induction
head: find the earlier occurrence of the current tokens, predict what followed) predicts every copied
token after the first few; the probe scores the model's top-1 prediction of the copied tokens 5..S
(after four copied tokens, the span is unambiguous). Two kinds of span:

- ``natural``: the crop's own text is copied (much of it can also be guessed from its words);
- ``drawn``: the source span is first replaced by tokens drawn independently from the held-out
  token frequencies, then copied: only copying predicts them (the repeated random tokens of Olsson et
  al. 2022, "In-context learning and induction heads", where induction heads first show).

A pure copier scores 100 % on both at every D. The probes depend on ``--seed`` only.

Usage (about 3 minutes per model on 2 CPU cores with the defaults)::

    python benchmarks/induction_probe.py [--model PATH] [--reference-context 2048] \
        [--distance 32 --distance 512 ...] [--probes 16] [--out results/induction-probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPAN = 24  # copied tokens per probe
SCORED_FROM = 4  # copied tokens before the first scored one
DISTANCES = (32, 128, 512, 1024, 1536)


def probe_sequence(stream, rng, n: int, distance: int, drawn: bool):
    """One probe: [n] token ids (numpy int64) whose last SPAN tokens copy those ``distance`` tokens
    earlier; ``drawn`` first replaces the source span with tokens drawn from ``stream``'s frequencies.

    Raises:
        ValueError: ``distance + 2 * SPAN > n`` (the source would start before the crop).
    """
    if distance + 2 * SPAN > n:
        raise ValueError(f"distance {distance} needs a context of at least {distance + 2 * SPAN} tokens, got {n}")
    start = int(rng.integers(0, stream.size - n))
    seq = stream[start:start + n].copy()  # [n]
    src = n - SPAN - distance  # the source span: seq[src : src + SPAN]
    if drawn:
        seq[src:src + SPAN] = stream[rng.integers(0, stream.size, size=SPAN)]
    seq[n - SPAN:] = seq[src:src + SPAN]
    return seq


def copied_hits(pred, seq) -> int:
    """How many of the scored copied tokens of probe ``seq`` [n] the predictions ``pred`` [SPAN] get
    right; ``pred[i]`` is the prediction made at position n - SPAN - 1 + i, that is of token
    ``seq[n - SPAN + i]`` (copied tokens SCORED_FROM + 1 .. SPAN are scored)."""
    n = len(seq)
    return int((pred[SCORED_FROM:] == seq[n - SPAN + SCORED_FROM:]).sum())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference", help="model id or folder (default: the bundled reference model)")
    ap.add_argument("--reference-context", type=int, default=2048, help="N: tokens per probe")
    ap.add_argument("--distance", type=int, action="append", default=None,
                    help=f"copy distance D in tokens (repeatable; default {', '.join(map(str, DISTANCES))})")
    ap.add_argument("--probes", type=int, default=16, help="probes per distance and kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the accuracies as JSON here (refused if it exists)")
    args = ap.parse_args(argv)
    distances = args.distance or list(DISTANCES)
    n = args.reference_context
    bad = [d for d in distances if d < 1 or d + 2 * SPAN > n]
    if bad or args.probes < 1:
        sys.exit(f"error: each --distance must be in [1, {n - 2 * SPAN}] at N = {n} and --probes ≥ 1 "
                 f"(got distances {bad or distances}, probes {args.probes})")
    if args.out and Path(args.out).exists():
        sys.exit(f"error: {args.out} already exists; remove it or choose another --out")

    import numpy as np
    import torch
    from tqdm import tqdm

    from truncsens.corpora import load_corpus
    from truncsens.engine.documents import tokenize_documents
    from truncsens.models import load_model

    loaded = load_model(args.model)
    docs = tokenize_documents(load_corpus(domain="code", split="heldout").documents, loaded.tokenizer)
    eos = [] if loaded.tokenizer.eos_token_id is None else [loaded.tokenizer.eos_token_id]
    stream = np.concatenate([np.asarray([*d.ids.tolist(), *eos], dtype=np.int64) for d in docs])  # [T] held-out code, documents joined by EOS
    rng = np.random.default_rng(args.seed)
    rows = []
    with torch.no_grad():
        for kind in ("natural", "drawn"):
            for d in tqdm(distances, desc=kind, leave=False):
                hits = 0
                for _ in range(args.probes):
                    seq = probe_sequence(stream, rng, n, d, kind == "drawn")
                    ids = torch.from_numpy(seq)[None].to(loaded.device)  # [1, n]
                    logits = loaded.model(input_ids=ids).logits[0, n - SPAN - 1:n - 1]  # [SPAN, V]: predictions of the copy
                    hits += copied_hits(logits.argmax(-1).cpu().numpy(), seq)
                total = args.probes * (SPAN - SCORED_FROM)
                rows.append({"kind": kind, "distance": d, "correct": hits, "scored": total, "accuracy": hits / total})
    print(f"copied-span accuracy (tokens {SCORED_FROM + 1}..{SPAN} of each copy), N = {n}, {args.probes} probes, {loaded.name}")
    print("  distance  " + "  ".join(f"{d:>6d}" for d in distances))
    for kind in ("natural", "drawn"):
        accs = [r["accuracy"] for r in rows if r["kind"] == kind]
        print(f"  {kind:8s}  " + "  ".join(f"{a:6.0%}" for a in accs))
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": loaded.name, "model_sha256": loaded.content_sha256, "reference_context": n,
                                    "span": SPAN, "scored_from": SCORED_FROM, "probes": args.probes,
                                    "seed": args.seed, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
