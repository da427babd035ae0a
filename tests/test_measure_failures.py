"""Failures mid-run: one clear error, and the shards already written are kept."""

from __future__ import annotations

import pytest
import torch

from truncsens.engine.batching import OutOfMemoryAtBatchSizeOne
from truncsens.engine.config import MeasureConfig
from truncsens.engine.forward import NonFiniteLogitsError
from truncsens.engine.measure import run_measure
from truncsens.engine.run.shards import MeasureInterrupted
from truncsens.models import load_model


def _cfg(model_dir, corpus_dir, out, **kw):
    return MeasureConfig(model=model_dir, corpus=corpus_dir, reference_context=64, windows=[1, 4],
                         targets_per_doc=2, docs_per_shard=2, out=str(out), progress=False, **kw)


def test_non_finite_logits_keep_written_shards(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "nan.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_cfg(tiny_llama_dir, corpus_dir, out), stop_after_shards=1)
    loaded = load_model(tiny_llama_dir)
    with torch.no_grad():
        loaded.model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
        run_measure(_cfg(tiny_llama_dir, corpus_dir, out, resume=True), loaded=loaded)
    assert [p.name for p in (tmp_path / "nan.nc.shards").glob("shard-*.nc")] == ["shard-00000.nc"]


def test_out_of_memory_at_batch_size_one(tiny_llama_dir, corpus_dir, tmp_path, monkeypatch):
    loaded = load_model(tiny_llama_dir)
    real_forward = loaded.model.forward

    def forward(*args, **kwargs):
        if kwargs["input_ids"].shape[1] >= 64:  # the reference pass never fits
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", forward)
    with pytest.raises(OutOfMemoryAtBatchSizeOne, match="batch size 1 with 64-token sequences"):
        run_measure(_cfg(tiny_llama_dir, corpus_dir, tmp_path / "oom.nc"), loaded=loaded)
