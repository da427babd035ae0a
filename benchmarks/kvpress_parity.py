"""Parity of ``--policy kvpress:<PressClass>`` (``prefill_evict``) with NVIDIA kvpress's own run, per target.

For each target of the reference model on the code corpus, and each press and budget k:

- truncsens: the ``prefill_evict`` semantics with the adapter policy
  (:mod:`truncsens.policies.kvpress_adapter`), ``--positions original``, or ``reindexed`` for the
  ``KeyRerotationPress`` rows;
- kvpress: the press as a context manager around the prefill of the T - 1 context tokens
  (``model.model(context, past_key_values=cache)``, as its ``KVPressTextGenerationPipeline`` does),
  then the pipeline's decode of the last token, at position T - 1, or at the compressed cache's
  length after ``KeyRerotationPress``; ``compression_ratio`` from
  :func:`~truncsens.policies.kvpress_adapter.compression_ratio`, so that kvpress keeps k - 1 keys.

Prints, per (press, k), the largest |Δ log p| over the vocabulary and targets and the largest
KL(kvpress ‖ truncsens) (nats, float64 from float32 logits) over targets.

Then SnapKV as published: truncsens's own ``snapkv`` policy (window and kernel of kvpress's
``SnapKVPress`` defaults, 64 and 5; scores from the model's own attention calls,
:mod:`truncsens.policies.snapkv`) against kvpress's ``SnapKVPress`` run as above, at the budgets of
``--snapkv-budgets`` (k - 1 > 64: below, kvpress gives the window's keys equal scores and
``torch.topk`` picks among them), with the share of (target, layer, key/value head) kept sets equal
to those kvpress's own ``score`` and ``topk`` keep (read through the ``kvpress:SnapKVPress`` adapter).

Run with kvpress installed (it pins its own transformers; a venv with system packages works)::

    python -m venv --system-site-packages /work/venvs/kvpress && /work/venvs/kvpress/bin/pip install kvpress
    PYTHONPATH=. /work/venvs/kvpress/bin/python benchmarks/kvpress_parity.py

Measured (kvpress 0.5.5, transformers 5.2.0, torch 2.13 CPU, float32, reference model, code corpus,
N = 512, 8 targets from 4 documents)::

    press                                     k  max |Δ log p|     max KL
    StreamingLLMPress                        16       1.06e-05   2.33e-12
    StreamingLLMPress                        64       1.20e-05   1.70e-12
    StreamingLLMPress                       256       1.36e-05   1.49e-12
    KnormPress                               16       1.03e-05   2.62e-12
    KnormPress                               64       1.02e-05   4.95e-12
    KnormPress                              256       1.22e-05   6.51e-12
    KeyRerotationPress(StreamingLLMPress)    16       1.34e-05   1.99e-12
    KeyRerotationPress(StreamingLLMPress)    64       1.13e-05   2.02e-12
    KeyRerotationPress(StreamingLLMPress)   256       9.56e-06   1.60e-12
    KeyRerotationPress(KnormPress)           16       1.35e-05   2.81e-12
    KeyRerotationPress(KnormPress)           64       1.15e-05   1.57e-12
    KeyRerotationPress(KnormPress)          256       1.17e-05   1.37e-12

    SnapKVPress vs truncsens snapkv           k  max |Δ log p|     max KL  equal kept sets
    SnapKVPress(window 64, kernel 5)         96       1.10e-05   1.73e-12       199 / 200
    SnapKVPress(window 64, kernel 5)        128       8.53e-06   1.69e-12       199 / 200
    SnapKVPress(window 64, kernel 5)        256       9.97e-06   3.98e-12       200 / 200

The differences (about 1e-5 in log p, 1e-12 in KL) are float32 rounding: truncsens runs the 8
targets as one batch, kvpress one target at a time; the adapter's kept sets are identical (the
tiny-model test in tests/test_kvpress_adapter.py checks the same equality at 1e-5). The two SnapKV
sets of 200 that differ hold one key each that the other does not, of exactly equal pooled votes
(1.7e-11 and 6.4e-14: keys the window barely reads): ``snapkv`` keeps the later key of a tie, kvpress
whichever ``torch.topk`` returns.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's truncsens


def targets(n_ctx: int, max_docs: int, per_doc: int):
    """(model, contexts [n, N]) of the reference model on the code corpus."""
    from truncsens.engine.config import MeasureConfig
    from truncsens.engine.documents import prepare_documents
    from truncsens.models import load_model
    from truncsens.targets import select_targets

    loaded = load_model("reference", "cpu")
    cfg = MeasureConfig(model="reference", domain="code", policies=["suffix"], semantics="prefill_evict",
                        reference_context=n_ctx, max_docs=max_docs, targets_per_doc=per_doc, out="unused.nc")
    docs = prepare_documents(cfg, loaded, n_ctx)
    return loaded.model.eval(), select_targets(docs.used, n_ctx, per_doc, 0).context


@torch.no_grad()
def kvpress_logprobs(model, context: torch.Tensor, press, rerotated: bool) -> torch.Tensor:
    """[V] float64 next-token log-probabilities of kvpress's run on one context [T]."""
    from transformers import DynamicCache

    T = context.numel()
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=context[None, : T - 1], past_key_values=cache)
    position = cache.get_seq_length() if rerotated else T - 1
    out = model(input_ids=context[None, T - 1:], past_key_values=cache, position_ids=torch.tensor([[position]]),
                logits_to_keep=1)
    return torch.log_softmax(out.logits[0, -1].double(), -1)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--per-doc", type=int, default=2)
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--snapkv-budgets", default="96,128,256", help="budgets of the SnapKV rows (k - 1 > 64)")
    args = parser.parse_args()

    import kvpress

    from truncsens.engine.semantics import semantics_for
    from truncsens.policies import make_policy
    from truncsens.policies.kvpress_adapter import compression_ratio

    model, contexts = targets(args.context, args.docs, args.per_doc)
    n, T = contexts.shape
    sem = semantics_for("prefill_evict")
    print(f"{n} targets, T = {T}; kvpress {importlib.metadata.version('kvpress')}")
    print(f"{'press':38s} {'k':>4s} {'max |Δ log p|':>14s} {'max KL':>10s}")
    for press_name, press_args, rerotate in (("StreamingLLMPress", {"n_sink": 4}, False), ("KnormPress", {}, False),
                                             ("StreamingLLMPress", {"n_sink": 4}, True), ("KnormPress", {}, True)):
        policy = make_policy(f"kvpress:{press_name}", policy_args=press_args)
        ref = sem.reference(model, contexts, [policy])
        for k in (int(b) for b in args.budgets.split(",")):
            ours = sem.policy_logprobs(model, contexts, policy, k, [0] * n, ref,
                                       "reindexed" if rerotate else "original")[0]  # [n, V]
            worst_delta, worst_kl = 0.0, 0.0
            for i in range(n):
                press = getattr(kvpress, press_name)(compression_ratio=compression_ratio(k, T), **press_args)
                theirs = kvpress_logprobs(model, contexts[i], kvpress.KeyRerotationPress(press) if rerotate else press,
                                          rerotate)  # [V]
                worst_delta = max(worst_delta, float((ours[i] - theirs).abs().max()))
                worst_kl = max(worst_kl, float((theirs.exp() * (theirs - ours[i])).sum()))
            label = f"KeyRerotationPress({press_name})" if rerotate else press_name
            print(f"{label:38s} {k:4d} {worst_delta:14.2e} {worst_kl:10.2e}")
    snapkv_rows(model, contexts, [int(b) for b in args.snapkv_budgets.split(",")])


@torch.no_grad()
def snapkv_rows(model, contexts: torch.Tensor, budgets: list[int]) -> None:
    """truncsens ``snapkv`` against kvpress ``SnapKVPress`` (module docstring): per budget, the largest
    |Δ log p| and KL over targets, and equal kept sets / all (target, layer, key/value head) sets."""
    import kvpress

    from truncsens.engine.semantics import semantics_for
    from truncsens.policies import make_policy
    from truncsens.policies.kvpress_adapter import compression_ratio

    n, T = contexts.shape
    sem = semantics_for("prefill_evict")
    ours = make_policy("snapkv")
    press_args = {"window_size": ours.window, "kernel_size": ours.kernel}
    adapter = make_policy("kvpress:SnapKVPress", policy_args=press_args)
    ref = sem.reference(model, contexts, [ours, adapter])
    queries = sem.queries(T, "cpu")
    print(f"\n{'SnapKVPress vs truncsens snapkv':38s} {'k':>4s} {'max |Δ log p|':>14s} {'max KL':>10s} {'equal kept sets':>16s}")
    for k in budgets:
        heads = ours.keep(T, k, queries, [0] * n, sem.scores(ours, ref, queries)).heads  # [L, n, Hkv, k-1]
        theirs = adapter.head_index(k, *sem.scores(adapter, ref, queries))  # kvpress's score and topk
        equal = (heads == theirs).all(-1)  # [L, n, Hkv]
        got = sem.policy_logprobs(model, contexts, ours, k, [0] * n, ref, "original")[0]  # [n, V]
        worst_delta, worst_kl = 0.0, 0.0
        for i in range(n):
            press = kvpress.SnapKVPress(compression_ratio=compression_ratio(k, T), **press_args)
            want = kvpress_logprobs(model, contexts[i], press, False)  # [V]
            worst_delta = max(worst_delta, float((got[i] - want).abs().max()))
            worst_kl = max(worst_kl, float((want.exp() * (want - got[i])).sum()))
        label = f"SnapKVPress(window {ours.window}, kernel {ours.kernel})"
        print(f"{label:38s} {k:4d} {worst_delta:14.2e} {worst_kl:10.2e} {int(equal.sum()):>9d} / {equal.numel()}")


if __name__ == "__main__":
    main()
