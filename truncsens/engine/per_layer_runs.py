"""The shards of a per-layer window sweep (``truncsens measure --per-layer``).

For each layer l alone and each window w, the target's next-token distribution when layer l keeps
only its ``n_sink`` first keys and its last w keys (the query's own among them) while every other
layer keeps its full cache, under ``prefill_evict`` (one prefill per batch serves every (layer,
window) decode) or ``streaming`` (every token processed that way: one parallel pass per (layer,
window)); :mod:`truncsens.engine.layer_windows_pass` holds the passes and their checks against naive
per-layer evicting loops. Results: metrics [layer, target, window] (:mod:`truncsens.results.schema`),
attrs ``per_layer`` (what a layer kept) and ``n_layers``.
"""

from __future__ import annotations

from typing import Callable

import torch

from truncsens import results
from truncsens.engine.attention_windows import layer_windows
from truncsens.engine.config import MeasureConfig
from truncsens.engine.documents import RunDocuments
from truncsens.engine.layer_windows_pass import layer_sweep_configurations, measure_layer_windows
from truncsens.engine.run.shard_results import with_bos_first
from truncsens.engine.run.skeleton import ShardWork
from truncsens.engine.sweep import Sweep
from truncsens.models import LoadedModel
from truncsens.targets import TargetSet

PER_LAYER = ("layer l alone keeps its n_sink first keys and its last w keys (the query's own among them); "
             "every other layer keeps its full cache")


def per_layer_attrs(loaded: LoadedModel) -> dict:
    """The attrs a per-layer sweep adds: ``per_layer`` (what a layer kept) and ``n_layers``."""
    return {"per_layer": PER_LAYER, "n_layers": len(layer_windows(loaded.model).windows)}


def per_layer_work(cfg: MeasureConfig, loaded: LoadedModel, N: int, sweep: Sweep, docs: RunDocuments,
                   attrs: dict) -> ShardWork:
    """The shards of a per-layer window sweep; progress counts the reference pass (N tokens) and each
    (layer, window) pass: one decoded token under ``prefill_evict``, N tokens under ``streaming``.

    Raises (when a shard runs):
        truncsens.engine.layer_windows_pass.LayerMaskError: the model's attention modules cannot take
            a per-layer mask.
    """
    n_layers = int(attrs["n_layers"])
    configs = layer_sweep_configurations(n_layers, sweep.values)  # layer-major: index l * W + j
    batch_tokens = cfg.batch_tokens(loaded.device)

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        with torch.no_grad():
            metrics, clamped = measure_layer_windows(loaded.model, plan, configs, cfg.n_sink, loaded.device, batch_tokens,
                                                     on_tokens, semantics=sweep.semantics)
        L, W, n = n_layers, len(sweep.values), len(plan)
        arrays = {m: v.reshape(L, W, n).transpose(0, 2, 1) for m, v in metrics.items()}  # [L*W, n] -> [L, n, W]
        ds = results.make_results(arrays, "window", sweep.values, plan.doc, plan.position, plan.token_id.numpy(),
                                  {**attrs, "n_clamped": clamped}, layers=list(range(L)))
        return with_bos_first(ds, plan, docs.bos_id)

    per_target = N + len(configs) * sweep.semantics.cost(N, 0)  # the reference pass, then each configuration
    return ShardWork(compute_shard, per_target, f"measure per layer {sweep.semantics.name}")
