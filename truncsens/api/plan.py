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

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from truncsens import DEFAULT_DEVICE
from truncsens.budget.allocation import (
    allocation_with_fixed, budget_for, kvpress_ratios, linear_schedule, predicted_with_fixed, uniform_windows,
)
from truncsens.fits.fit_file import check_new_files, sanitize
from truncsens.report.plots import figure_paths
from truncsens.results.paths import write_atomic
from truncsens.fits.per_layer import floor_window, layer_power_laws
from truncsens.stats import cluster_mean_se, percentile_interval, resample_weights


class PlanError(ValueError):
    """A plan cannot be made as asked; the message names the input and the fix."""


@dataclass
class PlanReport:
    """A finished plan: ``doc`` is the JSON (:meth:`to_json`), with a table and a figure;
    ``written``: the files :func:`plan` wrote (JSON, then the figure's PNG and PDF)."""

    doc: dict
    written: list[Path] = field(default_factory=list)

    def to_json(self) -> dict:
        return sanitize(self.doc)

    def table(self) -> str:
        """The text ``truncsens plan`` prints."""
        from truncsens.report.tables import Column, render_table

        d = self.doc
        lines = [f"plan: {d['model']} on {d['corpus']}, N = {d['reference_context']}, semantics {d['semantics']}, "
                 f"metric {d['metric']}, sinks {d['sinks']}; laws fitted on {d['n_fit_targets']} targets "
                 f"({d['n_fit_docs']} documents), validated on {d['n_heldout_targets']} held-out targets "
                 f"({d['n_heldout_docs']} documents)", ""]
        cols = [Column("layer", ">"), Column("C [CI]", ">"), Column("alpha [CI]", ">")]
        rows = [[str(law["layer"]), _est(law["C"]), _est(law["alpha"])] for law in d["layers"]]
        lines += [render_table(cols, rows)]
        for law in d["layers"]:
            floor = (law.get("excluded") or {}).get("noise_floor") or []
            if floor:
                lines.append(f"  note: layer {law['layer']}: windows {floor} lie at the float32 noise floor of {d['metric']} "
                             "and are left out of its law (as truncsens fit does)")
            if law.get("at_floor_from"):
                lines.append(f"  note: layer {law['layer']}: too few windows above the noise floor for a law; alone, it "
                             f"loses nothing measurable from window {law['at_floor_from']} on, so every plan keeps it "
                             "there and gives the other layers the rest")
            if law.get("n_boot_failed"):
                lines.append(f"  note: layer {law['layer']}: {law['n_boot_failed']} of {d['n_boot']} bootstrap refits failed "
                             "(too few windows above the floor in those resamples); its interval is over the rest")
        lines.append("")
        for b in d["budgets"]:
            lines.append(f"average window {b['average_window']:g} ({b['kv_bytes']:,} KV bytes per sequence):")
            cols = [Column("schedule"), Column("windows"), Column("predicted", ">"), Column(f"measured {d['metric']} [doc CI]", ">")]
            rows = [[name, " ".join(str(w) for w in b[name]["windows"]), _num(b[name]["predicted"]),
                     _est(b[name]["measured"])] for name in ("plan", "uniform", "linear")]
            lines.append(render_table(cols, rows))
            r, a = b["ratio_plan_uniform"], b["additivity"]
            lines.append(f"  plan / uniform: {_est(r)}; additivity: sum of layers alone {a['sum_of_layers']:.4g} "
                         f"against all at once {a['joint']:.4g}")
            lines.append("")
        return "\n".join(lines)

    def write(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the JSON to ``path`` atomically (FileExistsError unless ``overwrite`` when it exists;
        NoSpaceError, an ``OSError`` naming the path, when the disk is full)."""
        check_new_files([path], overwrite)
        return write_atomic(path, json.dumps(self.to_json(), indent=1, allow_nan=False).encode())

    def plot(self, out: str | Path, overwrite: bool = False) -> list[Path]:
        """D_l(w) per layer (fit set, log-log) with its law and each plan's windows marked:
        ``<out>.png`` and ``<out>.pdf`` (:func:`truncsens.report.plots.figure_paths`).

        Raises:
            FileExistsError: a figure exists and ``overwrite`` is false.
        """
        from matplotlib.figure import Figure  # no pyplot: no global figure state

        paths = figure_paths(out)
        check_new_files(paths, overwrite)
        fig = Figure(figsize=(6, 4.5))
        ax = fig.subplots()
        for law in self.doc["layers"]:
            x, y = np.asarray(law["windows"]), np.asarray(law["mean"])
            line, = ax.loglog(x, np.where(y > 0, y, np.nan), "o-", ms=3, label=f"layer {law['layer']}")
            for b, marker in zip(self.doc["budgets"], ("v", "s", "D", "^")):
                w = b["plan"]["windows"][law["layer"]]
                ax.loglog([w], [np.interp(np.log(w), np.log(x), y)], marker, color=line.get_color(), ms=8, mfc="none")
        marks = ", ".join(f"{m} average window {b['average_window']:g}"
                          for b, m in zip(self.doc["budgets"], ("triangle", "square", "diamond", "up-triangle")))
        ax.set_title(f"planned windows: {marks}", fontsize=8)
        ax.set_xlabel("window of one layer (tokens)")
        ax.set_ylabel(f"mean {self.doc['metric']} (that layer alone)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(paths[0], dpi=120)
        fig.savefig(paths[1])
        return paths


def _floor_fixed(law: dict) -> int:
    """The window a layer is fixed at because its fit failed for lack of windows above the noise floor
    (:func:`truncsens.fits.per_layer.floor_window`), or 0 when it is planned by its law."""
    if law["status"] == "ok":
        return 0
    return floor_window(law) or 0


def _num(v) -> str:
    return "n/a" if v is None or not np.isfinite(v) else f"{v:.4g}"


def _est(e) -> str:
    if e is None:
        return "-"
    ci = e.get("ci") or [np.nan, np.nan]
    return f"{e['value']:.4g} [{ci[0]:.4g}, {ci[1]:.4g}]"


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
    import torch

    from truncsens.api.measure import measure_config, model_argument
    from truncsens.budget.allocation import AllocationError
    from truncsens.engine.attention_windows import layer_windows
    from truncsens.engine.config import PER_LAYER_SEMANTICS
    from truncsens.engine.documents import prepare_documents
    from truncsens.engine.layer_windows_pass import layer_sweep_configurations, measure_layer_windows
    from truncsens.engine.measure import resolve_reference_context
    from truncsens.metrics import metric as metric_record
    from truncsens.models import load_model
    from truncsens.targets import select_targets

    metric_record(metric)  # an unknown metric fails here, before any pass
    if semantics not in PER_LAYER_SEMANTICS:
        raise PlanError(f"--semantics must be one of {', '.join(PER_LAYER_SEMANTICS)}, got {semantics!r}")
    defaulted = average_windows is None and kv_bytes is None and eps is None
    if defaulted:
        average_windows = (64, 256)
    if sum(x is not None and len(x) > 0 for x in (average_windows, kv_bytes, eps)) != 1:
        raise PlanError("give the budgets as average windows (--average-window), as KV bytes (--kv-bytes) or as "
                        "distortions to reach (--eps), one of the three")
    for a in average_windows or ():
        if not a >= 1:
            raise PlanError(f"--average-window must be at least 1 token, got {a:g}")
    for b in kv_bytes or ():
        if not b > 0:
            raise PlanError(f"--kv-bytes must be a positive number of bytes, got {b}")
    for e in eps or ():
        if not e > 0:
            raise PlanError(f"--eps must be a positive distortion, got {e:g}")
    check_new_files(([Path(out)] if out is not None else []) + (figure_paths(plot_out) if plot_out is not None else []), overwrite)
    spec, device, dtype_, loaded = model_argument(model, tokenizer, device, dtype)
    cfg = measure_config(spec, corpus=corpus, domain=domain, split=split, reference_context=reference_context,
                         windows=[1], sinks=sinks, targets_per_doc=targets_per_doc, max_docs=max_docs, seed=seed,
                         device=device or DEFAULT_DEVICE, dtype=dtype_ or "float32", batch_tokens=batch_tokens, out="unused.nc",
                         progress=progress)
    loaded = loaded or load_model(cfg.model, cfg.device, cfg.dtype)
    N = resolve_reference_context(cfg, loaded)
    docs = prepare_documents(cfg, loaded, N)
    if len(docs.used) < 2:
        raise PlanError(f"a plan needs at least 2 documents long enough for N = {N} (half fit, half validate); "
                        f"found {len(docs.used)}")
    half = (len(docs.used) + 1) // 2
    fit_targets = select_targets(docs.used[:half], N, cfg.targets_per_doc, cfg.seed)
    held_targets = select_targets(docs.used[half:], N, cfg.targets_per_doc, cfg.seed)
    for a in average_windows or ():
        if a >= N - sinks:
            given = " (one of the default budgets 64,256)" if defaulted else ""
            raise PlanError(f"--average-window {a:g}{given} leaves nothing to allocate: every layer would keep its whole "
                            f"context (N - sinks = {N - sinks} keys); use a smaller average window")
    windows = [int(w) for w in (sweep or default_sweep(N))]
    if not windows or min(windows) < 1 or max(windows) + sinks >= N:
        raise PlanError(f"sweep windows must lie in [1, N - sinks) = [1, {N - sinks}), got {windows}")
    n_layers = len(layer_windows(loaded.model).windows)
    batch = cfg.batch_tokens(loaded.device)
    with torch.no_grad():
        sweep_metrics, _ = measure_layer_windows(loaded.model, fit_targets, layer_sweep_configurations(n_layers, windows),
                                                 sinks, loaded.device, batch, semantics=semantics)
    values = sweep_metrics[metric].astype(np.float64).reshape(n_layers, len(windows), -1).transpose(0, 2, 1)  # [L, n, W]
    laws = layer_power_laws(values, windows, list(fit_targets.doc), n_boot, seed, level, metric)
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
        raise PlanError(f"every layer's {metric} lies at the float32 noise floor from its smallest sweep windows on: "
                        "nothing to plan by; use smaller --sweep windows")
    free = fixed == 0  # [L]
    C = np.array([law["C"]["value"] if f == 0 else np.nan for law, f in zip(laws, fixed)])
    alpha = np.array([law["alpha"]["value"] if f == 0 else np.nan for law, f in zip(laws, fixed)])
    per_token = bytes_per_token(loaded.model, loaded.dtype)
    cost = np.full(n_layers, float(per_token))
    lo, hi = 1, N - sinks  # windows count the recent keys; the sinks come on top in every layer
    if eps:
        budgets_bytes = []
        for e in eps:
            room = budget_for(C[free], alpha[free], cost[free], float(e), [lo] * int(free.sum()), [hi] * int(free.sum()))
            if room is None:
                raise PlanError(f"eps = {e:g}: the laws predict more than that even with every layer at its full "
                                f"context of {hi} keys; ask for a larger --eps")
            budgets_bytes.append(int(np.ceil(room + float(cost[~free] @ fixed[~free]) + sinks * float(cost.sum()))))
    else:
        budgets_bytes = ([int(b) for b in kv_bytes] if kv_bytes else
                         [int(round((a + sinks) * n_layers * per_token)) for a in average_windows])
    for budget in budgets_bytes:
        least, most = (1 + sinks) * n_layers * per_token, N * n_layers * per_token
        if not least <= budget < most:
            raise PlanError(f"a KV budget of {budget:,} bytes lies outside what a plan can allocate: at least {least:,} "
                            f"(every layer keeping its sinks and one key) and below {most:,} (every layer keeping all "
                            f"N = {N} keys)")
    configs, entries = [], []
    for budget in budgets_bytes:
        room = budget - sinks * float(cost.sum())  # the bytes left for windows once every layer holds its sinks
        try:
            planned = allocation_with_fixed(C, alpha, cost, room, lo, hi, fixed)
        except AllocationError as exc:
            raise PlanError(f"KV budget {budget:,} bytes: {exc}") from None
        schedules = {"plan": planned, "uniform": uniform_windows(cost, room, lo, hi),
                     "linear": linear_schedule(cost, room, lo, hi)}
        entries.append((budget, schedules, len(configs)))
        configs += [list(map(int, s)) for s in schedules.values()]
        configs += [[int(planned[l]) if i == l else None for i in range(n_layers)] for l in range(n_layers)]
    with torch.no_grad():
        held, _ = measure_layer_windows(loaded.model, held_targets, configs, sinks, loaded.device, batch,
                                        semantics=semantics)
    held_values = held[metric].astype(np.float64)  # [configs, n_held]
    held_doc = list(held_targets.doc)
    budgets_out = []
    for budget, schedules, first in entries:
        entry = {"kv_bytes": budget, "average_window": budget / (n_layers * per_token) - sinks}
        for i, (name, w) in enumerate(schedules.items()):
            entry[name] = {"windows": [int(x) for x in w], "predicted": predicted_with_fixed(C, alpha, w, fixed),
                           "measured": _mean_ci(held_values[first + i], held_doc, n_boot, seed, level),
                           "per_target": [float(v) for v in held_values[first + i]],
                           "kv_bytes": int(cost @ (w + sinks))}
        entry["plan"]["kvpress_compression_ratios"] = kvpress_ratios([w + sinks for w in entry["plan"]["windows"]], N)
        entry["ratio_plan_uniform"] = _ratio_ci(held_values[first], held_values[first + 1], held_doc, n_boot, seed, level)
        alone = held_values[first + 3 : first + 3 + n_layers]  # [L, n]
        entry["additivity"] = {"sum_of_layers": float(alone.mean(1).sum()), "joint": float(held_values[first].mean()),
                               "ratio_joint_to_sum": _ratio_ci(held_values[first], alone.sum(0), held_doc, n_boot, seed, level)}
        budgets_out.append(entry)
    doc = {"kind": "truncsens-plan", "schema": 1, "model": loaded.name, "model_revision": loaded.revision,
           "model_sha256": loaded.content_sha256, "corpus": docs.corpus, "corpus_sha256": docs.sha256,
           "domain": docs.domain, "semantics": semantics, "positions": "original", "reference_context": N,
           "sinks": sinks, "metric": metric, "bytes_per_token_per_layer": per_token, "sweep": windows,
           "n_fit_targets": len(fit_targets), "n_fit_docs": half, "n_heldout_targets": len(held_targets),
           "n_heldout_docs": len(docs.used) - half,
           "heldout_targets": {"doc": [str(d) for d in held_targets.doc],
                               "position": [int(p) for p in held_targets.position]}, "seed": seed, "n_boot": n_boot, "level": level,
           "layers": laws, "budgets": budgets_out}
    report = PlanReport(doc)
    if out is not None:
        report.written.append(report.write(out, overwrite))
    if plot_out is not None:
        report.written += report.plot(plot_out, overwrite)
    return report
