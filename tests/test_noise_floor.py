"""benchmarks/noise_floor.py, the script docs/precision.md points to: on the smaller random Llama it
measures a batch-size change as exactly 0 and a KV-cache step as nonzero noise below the metric
records' noise floors (the values the fits leave out)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from truncsens.metrics import METRICS

SPEC = importlib.util.spec_from_file_location("noise_floor", Path(__file__).parents[1] / "benchmarks" / "noise_floor.py")
noise_floor = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(noise_floor)


def test_the_smaller_model_measures_noise_below_the_records_floors():
    hidden, layers, vocab, T = noise_floor.CONFIGS[0]
    assert (hidden, layers, vocab, T) == (128, 2, 4096, 128)
    ids = torch.randint(0, vocab, (4, T), generator=torch.Generator().manual_seed(0))
    out = noise_floor.last_logits(noise_floor.model(hidden, layers, vocab), ids)
    assert [t.shape for t in out.values()] == [(4, vocab)] * 3
    same = noise_floor.compare(out["full"], out["full"])
    assert same["tv_max"] == same["kl_max"] == same["js_max"] == same["logit_diff"] == 0.0 and same["clamped"] == 0
    step = noise_floor.compare(out["full"], out["step"])
    assert 0 < step["logit_diff"] < 1e-5
    floors = {m.name: m.noise_floor for m in METRICS if m.name in ("tv", "kl", "js")}
    assert floors == {"tv": 1.5e-7, "kl": 1e-13, "js": 2e-14}
    assert step["tv_max"] <= floors["tv"] and step["kl_max"] <= floors["kl"] and step["js_max"] <= floors["js"]
