"""The report of ``truncsens plan`` (:func:`truncsens.api.plan.plan`): its JSON, the table printed and
the figure of each layer's law with the planned windows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from truncsens.fits.fit_file import check_new_files, sanitize
from truncsens.report.plots import figure_paths
from truncsens.results.paths import write_atomic


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
        from truncsens.report.tables import Column, fmt_count, render_table

        d = self.doc
        lines = [f"plan: {d['model']} on {d['corpus']}, N = {d['reference_context']}, semantics {d['semantics']}, "
                 f"metric {d['metric']}, sinks {d['sinks']}; laws fitted on {fmt_count(d['n_fit_targets'], 'target')} "
                 f"({fmt_count(d['n_fit_docs'], 'document')}), validated on "
                 f"{fmt_count(d['n_heldout_targets'], 'held-out target')} ({fmt_count(d['n_heldout_docs'], 'document')})", ""]
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


def _num(v) -> str:
    return "n/a" if v is None or not np.isfinite(v) else f"{v:.4g}"


def _est(e) -> str:
    if e is None:
        return "-"
    ci = e.get("ci") or [np.nan, np.nan]
    return f"{e['value']:.4g} [{ci[0]:.4g}, {ci[1]:.4g}]"
