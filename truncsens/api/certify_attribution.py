"""``truncsens.certify_attribution``: do error certificates attribute task failures to eviction, and
does certificate-gated recomputation pay (arXiv 2607.21475)? Long-range copy targets and synthetic
key-value recall, measured with the passes of :func:`truncsens.certify` (:mod:`truncsens.certificates.attribution_driver`).

Keyword names are ``truncsens certify-attribution``'s options in snake_case. Without ``out=`` the run
goes to a temporary folder and only the Dataset comes back. ``truncsens certify-attribution`` calls
:func:`attribution_config` and :func:`run_attribution_report`.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xarray as xr

from truncsens.certificates.designs import DEFAULT_OBS_WINDOW, DEFAULT_TEMPER
from truncsens import DEFAULT_DEVICE, results
from truncsens.api.measure import model_argument, python_call
from truncsens.certificates.attribution_figures import heads_paths, save_heads
from truncsens.certificates.attribution_report import curves_path, format_attribution, save_curves, summarize_attribution
from truncsens.certificates.attribution_driver import AttributionConfig, run_attribution
from truncsens.engine.options import config_fields
from truncsens.fits.fit_file import check_new_files, sanitize
from truncsens.models import LoadedModel
from truncsens.models.caller_state import keeps_caller_state
from truncsens.corpora.local import not_measured_notes


@dataclass
class Attribution:
    """A finished certify-attribution run.

    Attributes:
        dataset: its results (task set, certificates, trajectory).
        summary: attribution AUCs, gated recomputation and verdicts
            (:func:`truncsens.certificates.attribution_report.summarize_attribution`), with ``files``: what was written.
        path: the results file kept (None: held in memory only).
        figure: the recomputation curves' figure, or None.
        head_figures: the per-head attribution figure (PNG, PDF;
            :mod:`truncsens.certificates.attribution_figures`), or empty.
    """

    dataset: xr.Dataset
    summary: dict
    path: Path | None
    figure: Path | None
    head_figures: tuple[Path, ...] = ()

    @classmethod
    def load(cls, path: str | Path, seed: int = 0) -> "Attribution":
        """The attribution of a results file written by ``truncsens certify-attribution`` (summarized with
        the bootstrap ``seed`` of the run, 0 by default; no figure drawn).

        Raises:
            FileNotFoundError, truncsens.results.ResultsError: as :func:`truncsens.load`.
        """
        ds = results.load(path)
        summary = summarize_attribution(ds, seed=seed)
        summary["files"] = [str(path)]
        return cls(ds, summary, Path(path), None)

    def table(self) -> str:
        """The text ``truncsens certify-attribution`` prints after its first line."""
        return format_attribution(self.summary)

    def notes(self) -> list[str]:
        """What ``truncsens certify-attribution`` says on stderr, as ``measure`` and ``certify`` do: the
        corpus files left out (from the attr ``files_skipped``); empty when none was."""
        return not_measured_notes(self.dataset.attrs.get("files_skipped"))

    def to_json(self) -> dict:
        """The summary as JSON-safe values (what ``--json`` prints)."""
        return sanitize(self.summary)

    def plot(self, stem: str | Path) -> Path:
        """Write the gated-recomputation curves to ``<stem>-curves.png`` and return the path."""
        return save_curves(self.dataset, stem)


def attribution_config(model: str = "reference", *, domain: str = "code", corpus: str | None = None, split: str = "auto",
                       reference_context: int = 512, budgets: str = "12.5%,25%,50%", delta: float = 0.05, sinks: int = 4,
                       max_docs: int | None = 16, copy_per_doc: int = 4, copy_rule: str = "induction", kv_docs: int = 8,
                       min_distance: int | None = None, trajectory: int = 0, trajectory_budget: str = "25%", seed: int = 0,
                       device: str = DEFAULT_DEVICE, dtype: str = "float32", batch_tokens: int | None = None,
                       out: str | Path | None = None, resume: bool = False,
                       overwrite: bool = False, progress: bool = True,
                       granularity: str = "head", score: str = "window", obs_window: int = DEFAULT_OBS_WINDOW,
                   temper: float = DEFAULT_TEMPER, top_fraction: float = 0.25, semantics: str = "prefill_evict",
                   policies: str | None = None,
                       command: str = "") -> AttributionConfig:
    """The validated :class:`~truncsens.certificates.attribution_driver.AttributionConfig` from the command's
    options (``out=None``: ``results/<model>-<corpus or domain>-attribution.nc``).

    Raises:
        truncsens.certificates.config.CertifyError, truncsens.engine.config.MeasureError: as the config.
    """
    options = {**locals(), "out": None if out is None else str(out)}  # the run options, by API keyword
    return AttributionConfig(**config_fields(AttributionConfig, options))


def run_attribution_report(cfg: AttributionConfig, plot_out: str | Path | None = None,
                           loaded: LoadedModel | None = None, keep: bool = True) -> Attribution:
    """Run ``cfg`` (:func:`truncsens.certificates.attribution_driver.run_attribution`), summarize it, and draw the
    curves and the per-head figure next to ``plot_out`` (None: none).

    Args:
        keep: whether ``cfg.out`` is kept (False: a temporary file, recorded nowhere).

    Raises:
        FileExistsError: the results file (unless resuming) or a figure exists and not ``cfg.overwrite``,
            checked first.
        as :func:`truncsens.certificates.attribution_driver.run_attribution`.
    """
    figures = [curves_path(plot_out), *heads_paths(plot_out)] if plot_out is not None else []
    check_new_files([*([] if cfg.resume else [cfg.out]), *figures], cfg.overwrite)
    done = run_attribution(cfg, loaded)
    summary = summarize_attribution(done.dataset, seed=cfg.seed)
    figure = save_curves(done.dataset, plot_out) if plot_out is not None else None
    heads = tuple(save_heads(summary["decomposition"]["heads"], plot_out)) if plot_out is not None else ()  # new runs: always
    summary["files"] = [*([str(done.path)] if keep else []), *([str(figure)] if figure is not None else []),
                        *(str(p) for p in heads)]
    return Attribution(done.dataset, summary, Path(done.path) if keep else None, figure, heads)


@keeps_caller_state
def certify_attribution(model: Any = "reference", tokenizer: Any = None, *, domain: str = "code",
                        corpus: str | None = None, split: str = "auto", reference_context: int = 512,
                        budgets: str = "12.5%,25%,50%", delta: float = 0.05, sinks: int = 4, max_docs: int | None = 16,
                        copy_per_doc: int = 4, copy_rule: str = "induction", kv_docs: int = 8,
                        min_distance: int | None = None, trajectory: int = 0, trajectory_budget: str = "25%",
                        seed: int = 0, device: str | None = None, dtype: str | None = None,
                        batch_tokens: int | None = None, out: str | Path | None = None,
                        plot_out: str | Path | None = None, resume: bool = False,
                        overwrite: bool = False, progress: bool = True,
                        granularity: str = "head", score: str = "window", obs_window: int = DEFAULT_OBS_WINDOW,
                   temper: float = DEFAULT_TEMPER, top_fraction: float = 0.25, semantics: str = "prefill_evict",
                   policies: str | None = None,
                        command: str | None = None) -> Attribution:
    """Attribution AUCs and gated recomputation of poisson eviction's certificates (vs confidence, random).

    Args:
        model, tokenizer, device, dtype, semantics: as :func:`truncsens.certify`.
        policies: comma-separated, poisson among them (None: poisson, topk, random under prefill_evict;
            poisson, sink_recent under streaming).
        out: keep the results file here; plot_out: write the curves to ``<plot_out>-curves.png``.
        resume: continue an interrupted run from the shards it left next to ``out`` (needs ``out``).
        the others: ``truncsens certify-attribution``'s options (``--help``).

    Returns:
        an :class:`Attribution`.

    Raises:
        ValueError: as :func:`truncsens.measure` for the model; ``resume`` without ``out``.
        as :func:`run_attribution_report` and :func:`attribution_config`.
    """
    options = {k: v for k, v in locals().items() if k not in ("model", "tokenizer", "command", "plot_out")}
    if command is None:
        command = python_call("truncsens.certify_attribution", certify_attribution, model, tokenizer,
                              {**options, "plot_out": plot_out})
    model, device, options["dtype"], loaded = model_argument(model, tokenizer, device, dtype)
    options["device"] = device or DEFAULT_DEVICE
    if out is not None:
        return run_attribution_report(attribution_config(model, command=command, **options), plot_out, loaded)
    if resume:
        raise ValueError("resume continues an interrupted results file: give out=PATH")
    with tempfile.TemporaryDirectory(prefix="truncsens-attribution-") as folder:
        options["out"] = Path(folder) / "attribution.nc"
        return run_attribution_report(attribution_config(model, command=command, **options), plot_out, loaded, keep=False)
