"""``truncsens plan`` as a function: per-layer KV windows from each layer's measured truncation
sensitivity, validated against the uniform window and a PyramidKV-style schedule at equal KV bytes.

Steps (method in docs/plan.md):

1. The documents are split in two: the first half (by run order) is the fit set, the rest held out.
2. On the fit set, each layer alone keeps its sinks and last w keys while every other layer keeps its
   full cache (prefill-evict, :mod:`truncsens.engine.layer_windows_pass`): D_l(w) for every layer l and
   sweep window w, and a power law per layer with document-bootstrap intervals
   (:mod:`truncsens.fits.per_layer`). A layer whose curve reaches the noise floor too early for a law
   is kept at the window where it does (:func:`truncsens.fits.per_layer.floor_window`) in every plan.
3. For each budget (an average window, or KV bytes per sequence) the windows minimizing the predicted
   sum of per-layer distortions (:mod:`truncsens.budget.allocation`); the uniform window and the
   linear schedule at equal bytes.
4. On the held-out set, the three configurations are measured, with document-bootstrap intervals and
   the plan / uniform ratio; and each layer alone at its planned window, whose sum against the joint
   measurement checks the additivity the allocation assumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from truncsens import DEFAULT_DEVICE
from truncsens.api.plan_passes import PlanPasses
from truncsens.api.plan_report import PlanReport  # (defined there, imported from here too)
from truncsens.budget.allocation import (
    allocation_with_fixed, budget_for, kvpress_ratios, linear_schedule, predicted_with_fixed, uniform_windows,
)
from truncsens.fits.fit_file import check_new_files
from truncsens.report.plots import figure_paths
from truncsens.fits.per_layer import floor_window, layer_power_laws
from truncsens.models.caller_state import keeps_caller_state
from truncsens.stats import cluster_mean_se, percentile_interval, resample_weights


class PlanError(ValueError):
    """A plan cannot be made as asked; the message names the input and the fix."""


def _floor_fixed(law: dict) -> int:
    """The window a layer is fixed at because its fit failed for lack of windows above the noise floor
    (:func:`truncsens.fits.per_layer.floor_window`), or 0 when it is planned by its law."""
    if law["status"] == "ok":
        return 0
    return floor_window(law) or 0


def _mean_ci(values: np.ndarray, doc: list[str], n_boot: int, seed: int, level: float) -> dict:
    """Mean over targets with a document-bootstrap percentile interval."""
    mean, _ = cluster_mean_se(values[:, None], doc)
    docs, index = np.unique(np.asarray(doc, dtype=str), return_inverse=True)
    sums, counts = np.bincount(index, values, len(docs)), np.bincount(index, None, len(docs))
    w = resample_weights(len(docs), n_boot, seed)[1:]
    boot = (w @ sums) / (w @ counts)
    return {"value": float(mean[0]), "ci": list(percentile_interval(boot, level)) if n_boot else [np.nan, np.nan]}


def _ratio_ci(a: np.ndarray, b: np.ndarray, doc: list[str], n_boot: int, seed: int, level: float) -> dict:
    """mean(a) / mean(b) over the same targets, with a document-bootstrap interval."""
    docs, index = np.unique(np.asarray(doc, dtype=str), return_inverse=True)
    sa, sb = np.bincount(index, a, len(docs)), np.bincount(index, b, len(docs))
    w = resample_weights(len(docs), n_boot, seed)
    ratios = (w @ sa) / (w @ sb)
    return {"value": float(ratios[0]), "ci": list(percentile_interval(ratios[1:], level)) if n_boot else [np.nan, np.nan]}


def default_sweep(reference_context: int) -> list[int]:
    """Windows 4, 8, 16, ... up to N/2."""
    out, w = [], 4
    while w <= reference_context // 2:
        out.append(w)
        w *= 2
    return out


def bytes_per_token(model, dtype: str) -> int:
    """KV bytes one cached token costs in one layer: 2 (K and V) · key/value heads · head dim · bytes per
    element, from the model's config.

    Raises:
        PlanError: a config without head counts.
    """
    from truncsens.budget.kv_spec import BYTES_PER_ELEMENT

    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // heads if heads else None)
    if not heads or not dim:
        raise PlanError("the model config names no attention heads or head size: KV bytes cannot be counted")
    return int(2 * kv * dim * BYTES_PER_ELEMENT.get(dtype, 4))


@keeps_caller_state
def plan(model: Any = "reference", tokenizer: Any = None, *, domain: str = "code", corpus: str | None = None,
         split: str = "auto", reference_context: int | None = None, average_windows: Sequence[float] | None = None,
         kv_bytes: Sequence[int] | None = None, eps: Sequence[float] | None = None, sweep: Sequence[int] | None = None, sinks: int = 4, metric: str = "kl",
         targets_per_doc: int = 4, max_docs: int | None = 16, seed: int = 0, n_boot: int = 200, level: float = 0.95,
         device: str | None = None, dtype: str | None = None, batch_tokens: int | None = None,
         out: str | Path | None = None, plot_out: str | Path | None = None, overwrite: bool = False,
         progress: bool = True, semantics: str = "prefill_evict") -> PlanReport:
    """Per-layer windows for given KV budgets, measured and validated (module docstring).

    Args:
        model, tokenizer: as :func:`truncsens.measure`.
        average_windows: budgets as the average window per layer (recent keys, tokens; the sinks come
            on top in every layer); or ``kv_bytes``: budgets in KV bytes per sequence, sinks included;
            or ``eps``: for each distortion ε, the smallest budget whose plan the laws predict to reach
            it (one of the three; none: average windows 64 and 256).
        sweep: windows of the per-layer sweep (default 4, 8, ..., N/2); sinks: keys every windowed
            layer keeps in front; metric: the divergence planned for (default KL, whose per-layer
            sums the additivity check tests).
        targets_per_doc, max_docs, seed: the targets (half the documents fit, half validate).
        n_boot, level: document bootstrap of every interval.
        out: write the plan JSON; plot_out: draw ``<plot_out>.png``; overwrite: replace them.
        semantics: "prefill_evict" (keys computed with the full context, then each layer keeps its
            window: one prefill per batch) or "streaming" (every token processed with its layers'
            windows: one full pass per configuration).

    Returns:
        a :class:`PlanReport`.

    Raises:
        PlanError: no budget or both kinds, fewer than 2 documents, a layer without a decaying law, a
            budget below every layer's smallest window.
        FileExistsError: ``out`` or the figure exists and not ``overwrite`` (checked first).
        as :func:`truncsens.measure` for the model, corpus and options.
    """
    from truncsens.api.measure import measure_config, model_argument
    from truncsens.engine.documents import check_documents_before_loading
    from truncsens.engine.measure import resolve_reference_context
    from truncsens.engine.run.progress import say
    from truncsens.engine.run.shards import ShardProgress
    from truncsens.models import load_model

    average_windows, defaulted = _check_request(metric, semantics, average_windows, kv_bytes, eps)
    check_new_files(([Path(out)] if out is not None else []) + (figure_paths(plot_out) if plot_out is not None else []), overwrite)
    spec, device, dtype_, loaded = model_argument(model, tokenizer, device, dtype)
    cfg = measure_config(spec, corpus=corpus, domain=domain, split=split, reference_context=reference_context,
                         windows=[1], sinks=sinks, targets_per_doc=targets_per_doc, max_docs=max_docs, seed=seed,
                         device=device or DEFAULT_DEVICE, dtype=dtype_ or "float32", batch_tokens=batch_tokens, out="unused.nc",
                         progress=progress)
    check_documents_before_loading(cfg)  # an unknown domain or a missing corpus before the model loads
    if cfg.reference_context:  # the windows against N, also before the model loads
        _sweep_windows(sweep, cfg.reference_context, sinks, average_windows, defaulted)
    elif sweep and min(sweep) < 1:
        raise PlanError(f"sweep windows must be at least 1 token, got {list(sweep)}")
    if loaded is None:
        say("plan", f"loading model {cfg.model}", progress)
        loaded = load_model(cfg.model, cfg.device, cfg.dtype)
    N = resolve_reference_context(cfg, loaded)
    docs, fit_targets, held_targets = _split_targets(cfg, loaded, N, lambda text: say("plan", text, progress))
    windows = _sweep_windows(sweep, N, sinks, average_windows, defaulted)
    run = PlanPasses(loaded, sinks, cfg.batch_tokens(loaded.device), semantics, metric)
    n_budgets = len(next(b for b in (average_windows, kv_bytes, eps) if b))
    total = run.tokens(fit_targets, run.n_layers * len(windows)) + run.tokens(held_targets, n_budgets * (3 + run.n_layers))
    with ShardProgress(total, "plan", progress, 2, unit="pass") as bar:  # the fit set's sweep, then the held-out set
        run.on_tokens = bar.update
        laws, layers = _fit_layers(run, fit_targets, windows, n_boot, seed, level)
        bar.shard_done(0)
        budgets_bytes = _budgets_in_bytes(layers, N, sinks, average_windows, kv_bytes, eps)
        budgets_out = _validate(run, layers, held_targets, _schedules(layers, budgets_bytes, N, sinks), N, n_boot, seed, level)
        bar.shard_done(0)
    doc = {"kind": "truncsens-plan", "schema": 1, "model": loaded.name, "model_revision": loaded.revision,
           "model_sha256": loaded.content_sha256, "corpus": docs.corpus, "corpus_sha256": docs.sha256,
           "domain": docs.domain, "semantics": semantics, "positions": "original", "reference_context": N,
           "sinks": sinks, "metric": metric, "bytes_per_token_per_layer": layers.per_token, "sweep": windows,
           "n_fit_targets": len(fit_targets), "n_fit_docs": (len(docs.used) + 1) // 2, "n_heldout_targets": len(held_targets),
           "n_heldout_docs": len(docs.used) - (len(docs.used) + 1) // 2,
           "heldout_targets": {"doc": [str(d) for d in held_targets.doc],
                               "position": [int(p) for p in held_targets.position]}, "seed": seed, "n_boot": n_boot, "level": level,
           "layers": laws, "budgets": budgets_out}
    report = PlanReport(doc)
    if out is not None:
        report.written.append(report.write(out, overwrite))
    if plot_out is not None:
        report.written += report.plot(plot_out, overwrite)
    return report


def _check_request(metric: str, semantics: str, average_windows, kv_bytes, eps) -> tuple[Sequence[float] | None, bool]:
    """The metric, the semantics and the one kind of budget asked for, checked before any pass:
    ``(average_windows, defaulted)``, the default budgets 64 and 256 when none is given.

    Raises:
        PlanError, KeyError: see :func:`plan` (an unknown metric: as :func:`truncsens.metrics.metric`).
    """
    from truncsens.engine.config import PER_LAYER_SEMANTICS
    from truncsens.metrics import metric as metric_record

    metric_record(metric)  # an unknown metric fails here, before any pass
    if semantics not in PER_LAYER_SEMANTICS:
        raise PlanError(f"semantics (--semantics) must be one of {', '.join(PER_LAYER_SEMANTICS)}, got {semantics!r}")
    defaulted = average_windows is None and kv_bytes is None and eps is None
    if defaulted:
        average_windows = (64, 256)
    if sum(x is not None and len(x) > 0 for x in (average_windows, kv_bytes, eps)) != 1:
        raise PlanError("give the budgets as average windows (average_windows, --average-window), as KV bytes (kv_bytes, --kv-bytes) or as "
                        "distortions to reach (eps, --eps), one of the three")
    for a in average_windows or ():
        if not a >= 1:
            raise PlanError(f"average_windows (--average-window) must be at least 1 token, got {a:g}")
    for b in kv_bytes or ():
        if not b > 0:
            raise PlanError(f"kv_bytes (--kv-bytes) must be a positive number of bytes, got {b}")
    for e in eps or ():
        if not e > 0:
            raise PlanError(f"eps (--eps) must be a positive distortion, got {e:g}")
    return average_windows, defaulted


def _split_targets(cfg, loaded, N: int, on_stage=None):
    """The run's documents, and the targets of their first half (the fit set; by run order) and of the rest
    (held out): ``(docs, fit_targets, held_targets)``; ``on_stage``: progress of loading the documents.

    Raises:
        PlanError: fewer than 2 documents long enough for N.
    """
    from truncsens.engine.documents import prepare_documents
    from truncsens.targets import select_targets

    docs = prepare_documents(cfg, loaded, N, on_stage)
    if len(docs.used) < 2:
        raise PlanError(f"a plan needs at least 2 documents long enough for N = {N} (half fit, half validate); "
                        f"found {len(docs.used)}")
    half = (len(docs.used) + 1) // 2
    return (docs, select_targets(docs.used[:half], N, cfg.targets_per_doc, cfg.seed),
            select_targets(docs.used[half:], N, cfg.targets_per_doc, cfg.seed))


def _sweep_windows(sweep, N: int, sinks: int, average_windows, defaulted: bool) -> list[int]:
    """The windows of the per-layer sweep (default :func:`default_sweep`), once the average windows are known to fit N.

    Raises:
        PlanError: an average window leaving nothing to allocate, a sweep window outside [1, N - sinks).
    """
    for a in average_windows or ():
        if a >= N - sinks:
            given = " (one of the default budgets 64,256)" if defaulted else ""
            raise PlanError(f"average window {a:g} (average_windows, --average-window){given} leaves nothing to allocate: every layer would keep its whole "
                            f"context (N - sinks = {N - sinks} keys); use a smaller average window")
    windows = [int(w) for w in (sweep or default_sweep(N))]
    if not windows or min(windows) < 1 or max(windows) + sinks >= N:
        raise PlanError(f"sweep windows (sweep, --sweep) must lie in [1, N - sinks) = [1, {N - sinks}), got {windows}")
    return windows


@dataclass
class _Layers:
    """Each layer's law and KV cost: C and alpha ([L], NaN where fixed), the window a layer is fixed at
    ([L], 0: planned by its law), bytes per token per layer and the cost vector ([L], bytes)."""

    C: np.ndarray
    alpha: np.ndarray
    fixed: np.ndarray
    per_token: int
    cost: np.ndarray

    @property
    def free(self) -> np.ndarray:
        """[L] bool: the layers planned by their laws."""
        return self.fixed == 0


def _fit_layers(run: PlanPasses, fit_targets, windows: list[int], n_boot: int, seed: int, level: float):
    """Each layer alone windowed on the fit set, and its power law: ``(laws, layers)``.

    Raises:
        PlanError: a layer without a decaying law, or every layer at the noise floor.
    """
    from truncsens.engine.layer_windows_pass import layer_sweep_configurations

    n_layers = run.n_layers
    values = run.measure(fit_targets, layer_sweep_configurations(n_layers, windows))
    values = values.reshape(n_layers, len(windows), -1).transpose(0, 2, 1)  # [L, n, W]
    laws = layer_power_laws(values, windows, list(fit_targets.doc), n_boot, seed, level, run.metric)
    fixed = np.array([_floor_fixed(law) for law in laws], dtype=np.int64)  # [L] 0: planned by its law
    for law, f in zip(laws, fixed):
        law["at_floor_from"] = int(f) if f > 0 else None
    bad = [law for law, f in zip(laws, fixed) if f == 0 and (law["status"] != "ok" or law["alpha"]["value"] <= 0)]
    if bad:
        law = bad[0]
        why = law["reason"] or f"alpha = {law['alpha']['value']:.3g} does not decay"
        raise PlanError(f"layer {law['layer']} has no decaying power law on the fit set ({why}); use more targets, "
                        "other --sweep windows or another --metric")
    if fixed.all():
        raise PlanError(f"every layer's {run.metric} lies at the float32 noise floor from its smallest sweep windows on: "
                        "nothing to plan by; use smaller --sweep windows")
    C = np.array([law["C"]["value"] if f == 0 else np.nan for law, f in zip(laws, fixed)])
    alpha = np.array([law["alpha"]["value"] if f == 0 else np.nan for law, f in zip(laws, fixed)])
    per_token = bytes_per_token(run.loaded.model, run.loaded.dtype)
    return laws, _Layers(C, alpha, fixed, per_token, np.full(n_layers, float(per_token)))


def _budgets_in_bytes(layers: _Layers, N: int, sinks: int, average_windows, kv_bytes, eps) -> list[int]:
    """Every budget asked for in KV bytes per sequence (an ε: the least the laws predict to reach it).

    Raises:
        PlanError: an ε out of reach, a budget outside what a plan can allocate.
    """
    cost, fixed, free, n_layers = layers.cost, layers.fixed, layers.free, len(layers.cost)
    lo, hi = 1, N - sinks  # windows count the recent keys; the sinks come on top in every layer
    if eps:
        budgets_bytes = []
        for e in eps:
            room = budget_for(layers.C[free], layers.alpha[free], cost[free], float(e), [lo] * int(free.sum()),
                              [hi] * int(free.sum()))
            if room is None:
                raise PlanError(f"eps = {e:g}: the laws predict more than that even with every layer at its full "
                                f"context of {hi} keys; ask for a larger --eps")
            budgets_bytes.append(int(np.ceil(room + float(cost[~free] @ fixed[~free]) + sinks * float(cost.sum()))))
    else:
        budgets_bytes = ([int(b) for b in kv_bytes] if kv_bytes else
                         [int(round((a + sinks) * n_layers * layers.per_token)) for a in average_windows])
    for budget in budgets_bytes:
        least, most = (1 + sinks) * n_layers * layers.per_token, N * n_layers * layers.per_token
        if not least <= budget < most:
            raise PlanError(f"a KV budget of {budget:,} bytes lies outside what a plan can allocate: at least {least:,} "
                            f"(every layer keeping its sinks and one key) and below {most:,} (every layer keeping all "
                            f"N = {N} keys)")
    return budgets_bytes


def _schedules(layers: _Layers, budgets_bytes: list[int], N: int, sinks: int) -> list[tuple[int, dict]]:
    """For each budget (bytes) the planned, uniform and linear windows per layer: ``[(budget, {name: [L]})]``.

    Raises:
        PlanError: a budget the allocation cannot meet.
    """
    from truncsens.budget.allocation import AllocationError

    lo, hi, out = 1, N - sinks, []
    for budget in budgets_bytes:
        room = budget - sinks * float(layers.cost.sum())  # the bytes left for windows once every layer holds its sinks
        try:
            planned = allocation_with_fixed(layers.C, layers.alpha, layers.cost, room, lo, hi, layers.fixed)
        except AllocationError as exc:
            raise PlanError(f"KV budget {budget:,} bytes: {exc}") from None
        out.append((budget, {"plan": planned, "uniform": uniform_windows(layers.cost, room, lo, hi),
                             "linear": linear_schedule(layers.cost, room, lo, hi)}))
    return out


def _validate(run: PlanPasses, layers: _Layers, held_targets, schedules: list[tuple[int, dict]], N: int, n_boot: int,
              seed: int, level: float) -> list[dict]:
    """Each budget's schedules measured on the held-out set, with each layer alone at its planned window
    (the additivity check): the ``budgets`` entries of the plan."""
    n_layers, sinks, cost = len(layers.cost), run.sinks, layers.cost
    configs, firsts = [], []
    for _, named in schedules:  # per budget: the schedules, then each layer alone at its planned window
        firsts.append(len(configs))
        configs += [list(map(int, s)) for s in named.values()]
        configs += [[int(named["plan"][l]) if i == l else None for i in range(n_layers)] for l in range(n_layers)]
    held_values = run.measure(held_targets, configs)  # [configs, n_held]
    held_doc = list(held_targets.doc)
    budgets_out = []
    for (budget, named), first in zip(schedules, firsts):
        entry = {"kv_bytes": budget, "average_window": budget / (n_layers * layers.per_token) - sinks}
        for i, (name, w) in enumerate(named.items()):
            entry[name] = {"windows": [int(x) for x in w],
                           "predicted": predicted_with_fixed(layers.C, layers.alpha, w, layers.fixed),
                           "measured": _mean_ci(held_values[first + i], held_doc, n_boot, seed, level),
                           "per_target": [float(v) for v in held_values[first + i]],
                           "kv_bytes": int(cost @ (w + sinks))}
        entry["plan"]["kvpress_compression_ratios"] = kvpress_ratios([w + sinks for w in entry["plan"]["windows"]], N)
        entry["ratio_plan_uniform"] = _ratio_ci(held_values[first], held_values[first + 1], held_doc, n_boot, seed, level)
        alone = held_values[first + 3 : first + 3 + n_layers]  # [L, n]
        entry["additivity"] = {"sum_of_layers": float(alone.mean(1).sum()), "joint": float(held_values[first].mean()),
                               "ratio_joint_to_sum": _ratio_ci(held_values[first], alone.sum(0), held_doc, n_boot, seed, level)}
        budgets_out.append(entry)
    return budgets_out
