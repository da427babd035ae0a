"""The kvpress ratios of a ``truncsens plan`` reproduce its measured distortion.

A plan's JSON gives, per budget, ``kvpress_compression_ratios`` for kvpress's
``PerLayerCompressionPress`` wrapping ``StreamingLLMPress(n_sink=sinks)``. kvpress runs that
wrapper's hook only with FlashAttention, so on CPU the check is with the wrapped press's scorer, layer
by layer (:func:`truncsens.policies.kvpress_adapter.per_layer_head_index`): each layer's kept keys
must be exactly its sinks and last window of the plan, and decoding the held-out targets against a
cache that holds, per layer, only those keys (written here, independent of the engine's masks) must
give the plan's measured KL target by target.

Runs only where NVIDIA kvpress is importable; it pins its own transformers, so it lives in its own
environment::

    python -m venv --system-site-packages /work/venvs/kvpress && /work/venvs/kvpress/bin/pip install kvpress
    /work/venvs/kvpress/bin/python -m pytest tests/test_kvpress_plan.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="NVIDIA kvpress is not installed (pip install 'truncsens[kvpress]'); "
                                                "the plan's kvpress ratios are checked only where it is")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from truncsens.api.measure import measure_config  # noqa: E402
from truncsens.api.plan import plan  # noqa: E402
from truncsens.engine.documents import prepare_documents  # noqa: E402
from truncsens.engine.prefill_layers import record_prefill  # noqa: E402
from truncsens.models import load_model  # noqa: E402
from truncsens.policies.kvpress_adapter import per_layer_head_index  # noqa: E402
from truncsens.targets import select_targets  # noqa: E402

N, SINKS, PER_DOC, MAX_DOCS = 64, 2, 2, 6


def heldout_contexts(model_dir: str, corpus: str, doc: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, N] contexts, [n] next tokens) of the plan's held-out targets, checked against its JSON."""
    cfg = measure_config(model_dir, corpus=corpus, domain="code", split="auto", reference_context=N, windows=[1],
                         sinks=SINKS, targets_per_doc=PER_DOC, max_docs=MAX_DOCS, seed=0, device="cpu",
                         dtype="float32", batch_tokens=None, out="unused.nc", progress=False)
    loaded = load_model(cfg.model, "cpu", "float32")
    docs = prepare_documents(cfg, loaded, N)
    half = (len(docs.used) + 1) // 2
    held = select_targets(docs.used[half:], N, PER_DOC, 0)
    assert [str(d) for d in held.doc] == doc["heldout_targets"]["doc"]
    assert [int(p) for p in held.position] == doc["heldout_targets"]["position"]
    return held.context, held.token_id


def kvpress_decode(model, ids: torch.Tensor, ratios: list[float]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """[V] float64 log-probabilities of the token after ``ids`` [1, N] when each layer's prefill cache
    is cut to the keys StreamingLLMPress keeps at that layer's ratio; and the L kept index tensors."""
    with record_prefill(model) as layers:
        out = model(input_ids=ids[:, :-1], use_cache=True)
    cache = out.past_key_values
    kv = [(cache.layers[l].keys, cache.layers[l].values) for l in range(len(layers.modules))]  # [1, H, N-1, d] each
    press = kvpress.StreamingLLMPress(compression_ratio=0.0, n_sink=SINKS)
    kept = per_layer_head_index(press, ratios, layers, kv)  # L x [1, H, n_l]
    short = DynamicCache()
    for l, (k, v) in enumerate(kv):
        at = kept[l].unsqueeze(-1).expand(*kept[l].shape, k.shape[-1])  # [1, H, n_l, d]
        short.update(k.gather(2, at), v.gather(2, at), l)
    # one query, no padding: SDPA needs no mask, so each layer reads its whole (own-length) cache
    step = model(input_ids=ids[:, -1:], position_ids=torch.tensor([[N - 1]]), past_key_values=short, use_cache=True)
    return torch.log_softmax(step.logits[0, -1].double(), -1), kept


def test_plan_kvpress_ratios_reproduce_the_measured_distortion(tiny_llama_dir, corpus_dir):
    doc = plan(tiny_llama_dir, corpus=corpus_dir, reference_context=N, average_windows=[8, 24], sweep=[2, 4, 8, 16, 32],
               sinks=SINKS, targets_per_doc=PER_DOC, max_docs=MAX_DOCS, n_boot=0, progress=False).to_json()
    contexts, _ = heldout_contexts(tiny_llama_dir, corpus_dir, doc)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    for budget in doc["budgets"]:
        windows, ratios = budget["plan"]["windows"], budget["plan"]["kvpress_compression_ratios"]
        assert len(set(windows)) > 1  # a real per-layer plan, not the uniform window
        kl = []
        with torch.no_grad():
            for ids in contexts:
                ids = ids.unsqueeze(0)  # [1, N]
                full = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)  # [V]
                lp, kept = kvpress_decode(model, ids, ratios)
                for l, w in enumerate(windows):  # sinks and the last w - 1 prefix keys (the query is the w-th)
                    want = list(range(SINKS)) + list(range(N - w, N - 1))
                    assert kept[l][0].tolist() == [want] * kept[l].shape[1], (l, w)
                kl.append(float((full.exp() * (full - lp)).sum()))
        np.testing.assert_allclose(kl, budget["plan"]["per_target"], rtol=1e-4, atol=1e-7)
