"""What a `measure` run costs beyond its forwards, and what `truncsens --help` costs.

Prints:

1. ``run_vs_bare``: the seconds of a bare batched forward over exactly the sequences a whole
   ``measure`` run reads (its targets' reference contexts and the last w tokens of each, w in its
   windows; :func:`measure_throughput.bare_forward`, ``logits_to_keep=1``) divided by the seconds of
   the whole run on the loaded model (:func:`truncsens.api.measure.run_measurement`: corpus read and
   hashed, token ids from the cache, targets, the engine, the results file written). The model is
   loaded once, before, and one run warms up; a run with the token-id cache emptied (it tokenizes
   the corpus, as every run did before the cache) is timed and printed apart. Wall-clock seconds
   and, less disturbed by other jobs on a shared machine, this process's CPU seconds (1 thread). Target >= 0.9 on the reference model at N = 512 with 8 targets.
2. ``help_cpu_seconds``: the CPU time of a fresh process running the console script's entry point
   with ``--help`` (best of 3; interpreter start included), and whether it imported torch; beside it
   the CPU time of a process that only imports torch. Target < 0.5 s.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py          # reference model, CPU, N = 512, 8 targets
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_throughput import bare_forward  # noqa: E402


def child_cpu(code: str, *argv: str) -> tuple[float, str]:
    """CPU seconds (user + system) of ``python -c code argv`` and its stderr's last line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, (proc.stderr.strip().splitlines() or [""])[-1]


HELP = ("import sys\nfrom truncsens.cli.main import run\ntry:\n    run()\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="reference")
    p.add_argument("--reference-context", type=int, default=512)
    p.add_argument("--targets", type=int, default=8, help="targets of the run (one document)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from truncsens.api.measure import measure_config, run_measurement
    from truncsens.engine.documents import prepare_documents
    from truncsens.models import load_model
    from truncsens.results import load
    from truncsens.targets import TargetSet

    N = args.reference_context
    work = Path(tempfile.mkdtemp(prefix="run_overhead-"))
    os.environ["TRUNCSENS_CACHE_DIR"] = str(work / "cache")  # starts empty: the first run tokenizes
    loaded = load_model(args.model, "cpu", "float32")
    cfg = measure_config(args.model, reference_context=N, max_docs=1, targets_per_doc=args.targets, device="cpu",
                         out=work / "r.nc", overwrite=True, progress=False)

    def timed_run() -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one whole run."""
        t0, c0 = time.perf_counter(), time.process_time()
        run_measurement(cfg, loaded)
        return time.perf_counter() - t0, time.process_time() - c0

    def timed_bare() -> tuple[float, float]:
        c0 = time.process_time()
        return bare_forward(loaded.model, targets, windows, "cpu", batch_tokens), time.process_time() - c0

    timed_run()  # warm-up (first forwards, lazy imports); fills the token-id cache
    shutil.rmtree(work / "cache", ignore_errors=True)
    (t_first, c_first) = timed_run()  # token-id cache empty: the corpus is tokenized, as every run did before the cache
    t_run, c_run = min(timed_run() for _ in range(2))

    ds = load(work / "r.nc")
    windows = [int(w) for w in ds["window"].values]
    docs = {d.id: d.ids for d in prepare_documents(cfg, loaded, N).used}
    doc_of = [str(d) for d in ds["doc"].values]
    pos = [int(t) for t in ds["position"].values]
    ctx = torch.stack([docs[d][t - N:t] for d, t in zip(doc_of, pos)])  # [n, N]
    targets = TargetSet(doc_of, pos, ctx, torch.stack([docs[d][t] for d, t in zip(doc_of, pos)]))
    batch_tokens = cfg.batch_tokens("cpu")
    bare_forward(loaded.model, targets, windows[:2], "cpu", batch_tokens)  # warm-up
    t_bare, c_bare = min(timed_bare() for _ in range(2))

    helps = [child_cpu(HELP, "--help") for _ in range(3)]
    help_cpu, help_torch = min(helps)
    torch_cpu = min(child_cpu("import torch")[0] for _ in range(2))

    out = {"model": args.model, "reference_context": N, "targets": len(pos), "windows": windows,
           "threads": torch.get_num_threads(), "run_seconds": t_run, "uncached_run_seconds": t_first,
           "bare_seconds": t_bare, "run_vs_bare": t_bare / t_run, "uncached_run_vs_bare": t_bare / t_first,
           "run_cpu_seconds": c_run, "uncached_run_cpu_seconds": c_first, "bare_cpu_seconds": c_bare,
           "run_vs_bare_cpu": c_bare / c_run, "uncached_run_vs_bare_cpu": c_bare / c_first,
           "help_cpu_seconds": help_cpu, "help": help_torch, "import_torch_cpu_seconds": torch_cpu}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.model} on cpu, {torch.get_num_threads()} thread(s), N={N}, {len(pos)} targets x {len(windows)} windows")
    print(f"whole run {t_run:.2f} s (token-id cache emptied: {t_first:.2f} s) | bare forward {t_bare:.2f} s")
    print(f"run_vs_bare {t_bare / t_run:.2f} (cache emptied {t_bare / t_first:.2f})")
    print(f"CPU time: whole run {c_run:.2f} s (cache emptied {c_first:.2f} s) | bare forward {c_bare:.2f} s | "
          f"run_vs_bare_cpu {c_bare / c_run:.2f} (cache emptied {c_bare / c_first:.2f})")
    print(f"help_cpu_seconds {help_cpu:.2f} ({help_torch}; a process importing torch alone: {torch_cpu:.2f} s CPU)")


if __name__ == "__main__":
    main()
