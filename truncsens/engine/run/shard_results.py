"""The results Dataset of one shard of ``truncsens measure`` (exact and block protocols alike), from
what the kernel returns; the layout is that of :mod:`truncsens.engine.measure` (see its docstring and
docs/results.md)."""

from __future__ import annotations

import numpy as np

from truncsens import results
from truncsens.engine.kernel import KernelOutput
from truncsens.engine.sweep import Sweep
from truncsens.targets import TargetSet


def with_bos_first(ds, plan: TargetSet, bos_id: int | None):
    """``ds`` with the per-target int8 coord ``bos_first``: whether the reference context began with
    the tokenizer's BOS (all 0 when it has none)."""
    first = plan.context[:, 0].numpy() if len(plan) else np.zeros(0, np.int64)  # [n]
    bos_first = (first == bos_id) if bos_id is not None else np.zeros(len(plan), bool)
    return ds.assign_coords(bos_first=("target", bos_first.astype(np.int8)))


def shard_results(out: KernelOutput, plan: TargetSet, sweep: Sweep, attrs: dict, bos_id: int | None = None):
    """The results Dataset of one shard from ``out`` of :func:`~truncsens.engine.kernel.measure_draws`
    (arrays [P, R, n, K]; the layout is in the docstring of :mod:`truncsens.engine.measure`: the ``policy`` dim only for P > 1,
    the ``draw`` dim only for R > 1); the per-target coord ``bos_first`` (int8) says whether the
    reference context began with the tokenizer's BOS."""
    single = len(sweep.policies) == 1
    names = [p.name for p in sweep.policies]
    R = out.kept_tokens.shape[1]

    def layout(values: np.ndarray) -> np.ndarray:  # [P, R, n, K] -> ([P,] [R,] n, K)
        values = values if R > 1 else values[:, 0]
        return values[0] if single else values

    ds = results.make_results({m: layout(v) for m, v in out.metrics.items()}, sweep.dim, sweep.values,
                              plan.doc, plan.position, plan.token_id.numpy(), {**attrs, "n_clamped": out.n_clamped},
                              policies=None if single else names, draws=R if R > 1 else None)
    ds = with_bos_first(ds, plan, bos_id)
    if sweep.is_window_sweep:
        return ds
    dims = ds["kl"].dims
    extras = {"kept_tokens": out.kept_tokens}
    if out.evicted_attention_mass is not None:
        extras["evicted_attention_mass"] = out.evicted_attention_mass
    for name, values in extras.items():
        ds[name] = (dims, layout(values))
    ds["kept_tokens"].attrs["units"] = "tokens"
    if "evicted_attention_mass" in ds:
        ds["evicted_attention_mass"].attrs["description"] = (
            "attention probability mass of the full-context target query on the evicted keys, mean over layers and heads")
    return ds
