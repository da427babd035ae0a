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

Run with kvpress installed (it pins its own transformers; a venv with system packages works)::

    python -m venv --system-site-packages /work/venvs/kvpress && /work/venvs/kvpress/bin/pip install kvpress
    PYTHONPATH=. /work/venvs/kvpress/bin/python benchmarks/kvpress_parity.py

Measured (kvpress 0.5.5, transformers 5.2.0, torch 2.13 CPU, float32, reference model, code corpus,
N = 512, 8 targets from 4 documents)::

    press                                     k  max |Δ log p|     max KL
    StreamingLLMPress                        16       7.72e-06   1.01e-12
    StreamingLLMPress                        64       7.83e-06   4.40e-13
    StreamingLLMPress                       256       4.82e-06   1.42e-12
    KnormPress                               16       9.05e-06   2.70e-12
    KnormPress                               64       1.25e-05   3.90e-12
    KnormPress                              256       1.21e-05   8.65e-12
    KeyRerotationPress(StreamingLLMPress)    16       9.30e-06   6.19e-13
    KeyRerotationPress(StreamingLLMPress)    64       7.50e-06   7.24e-13
    KeyRerotationPress(StreamingLLMPress)   256       8.39e-06   8.16e-13
    KeyRerotationPress(KnormPress)           16       8.20e-06   1.04e-12
    KeyRerotationPress(KnormPress)           64       8.60e-06   8.19e-13
    KeyRerotationPress(KnormPress)          256       9.40e-06   1.62e-12

The differences (about 1e-5 in log p, 1e-12 in KL) are float32 rounding: truncsens runs the 8
targets as one batch, kvpress one target at a time; kept sets are identical (the tiny-model test
in tests/test_kvpress_adapter.py checks the same equality at 1e-5).
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


if __name__ == "__main__":
    main()
