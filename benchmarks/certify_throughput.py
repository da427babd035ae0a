"""Certify vs the plain poisson measurement at the same targets and budgets, in one run.

The plain measurement is :func:`truncsens.engine.kernel.measure_targets` with the poisson policy
under prefill_evict (reference pass with attention scores, one evicted decode per budget); certify
is :func:`truncsens.certificates.driver.compute_arrays` with poisson only (probed prefill with block-wise
scores, probed reference decode, one probed evicted decode per budget recording every layer and
head). Prints ``certify_vs_plain`` = certify seconds / plain seconds (acceptance: <= 1.5).

Usage::

    python benchmarks/certify_throughput.py                       # reference model, 8 targets, N = 1024
    python benchmarks/certify_throughput.py --targets 4 --context 512 --json
"""

from __future__ import annotations

import argparse
import json
import time

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens

from truncsens.certificates.driver import compute_arrays  # noqa: E402
from truncsens.engine.kernel import measure_targets  # noqa: E402
from truncsens.engine.semantics import SEMANTICS  # noqa: E402
from truncsens.engine.sweep import Sweep  # noqa: E402
from truncsens.models import load_model  # noqa: E402
from truncsens.policies import make_policy  # noqa: E402
from truncsens.targets import TargetSet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reference")
    parser.add_argument("--targets", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loaded = load_model(args.model, args.device)
    model, N, n = loaded.model, args.context, args.targets
    budgets = [N // 8, N // 4, N // 2]
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, model.config.vocab_size, (n, N), generator=g)  # [n, N]
    targets = TargetSet([f"d{i}" for i in range(n)], np.arange(n) + N, ctx, torch.randint(0, 50, (n,), generator=g))
    policy = make_policy("poisson", n_sink=4)
    sweep = Sweep("budget", budgets, budgets, [policy], SEMANTICS["prefill_evict"])
    batch = 4 * N

    def plain() -> None:
        measure_targets(model, targets, [policy], budgets, SEMANTICS["prefill_evict"], "original", 0, loaded.device, batch)

    def certify() -> None:
        compute_arrays(model, targets, sweep, 0, 0.05, loaded.device, batch, lambda _: None)

    plain(), certify()  # warm up
    seconds = {}
    for name, fn in (("plain", plain), ("certify", certify)):
        start = time.perf_counter()
        fn()
        seconds[name] = time.perf_counter() - start
    report = {"targets": n, "context": N, "budgets": budgets, "plain_s": seconds["plain"], "certify_s": seconds["certify"],
              "certify_vs_plain": seconds["certify"] / seconds["plain"], "threads": torch.get_num_threads()}
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))


if __name__ == "__main__":
    main()
