"""``truncsens.certify``: coverage and tightness of the Hájek error certificates of certainty-plus-Poisson
eviction, measured against topk and random (arXiv 2607.21475; :mod:`truncsens.certificates`).

Keyword names are ``truncsens certify``'s options in snake_case. The run writes a results file
(:func:`truncsens.certificates.driver.run_certify`): with ``out=`` it is kept, without it the run goes to a
temporary folder and only the Dataset comes back. ``truncsens certify`` calls :func:`certify_config`
and :func:`run_certification` (its default paths are :class:`~truncsens.certificates.config.CertifyConfig`'s).
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
from truncsens.certificates.config import CertifyConfig
from truncsens.certificates.coverage_report import certify_figure_paths, format_summary, save_figures, summarize
from truncsens.certificates.driver import run_certify
from truncsens.corpora.local import not_measured_notes
from truncsens.engine.options import config_fields
from truncsens.fits.fit_file import check_new_files, sanitize
from truncsens.models import LoadedModel
from truncsens.models.caller_state import keeps_caller_state


@dataclass
class Certification:
    """A finished certify run.

    Attributes:
        dataset: its results (:mod:`truncsens.certificates.driver`).
        summary: coverage, Spearman, relative errors and output KL per policy and budget
            (:func:`truncsens.certificates.coverage_report.summarize`), with ``files``: what was written.
        path: the results file kept (None: held in memory only).
        figures: the figures written.
    """

    dataset: xr.Dataset
    summary: dict
    path: Path | None
    figures: list[Path]

    @classmethod
    def load(cls, path: str | Path, seed: int = 0) -> "Certification":
        """The certification of a results file written by ``truncsens certify`` (summarized with the
        bootstrap ``seed`` of the run, 0 by default; no figure drawn).

        Raises:
            FileNotFoundError, truncsens.results.ResultsError: as :func:`truncsens.load`.
        """
        ds = results.load(path)
        summary = summarize(ds, seed=seed)
        summary["files"] = [str(path)]
        return cls(ds, summary, Path(path), [])

    def table(self) -> str:
        """The text ``truncsens certify`` prints after its first line (:func:`truncsens.certificates.coverage_report.format_summary`)."""
        return format_summary(self.summary)

    def notes(self) -> list[str]:
        """What ``truncsens certify`` says on stderr, as ``measure`` does: the corpus files left out
        (``"3 corpus files skipped (3 empty), not measured"``, from the attr ``files_skipped``); empty
        when none was."""
        return not_measured_notes(self.dataset.attrs.get("files_skipped"))

    def to_json(self) -> dict:
        """The summary as JSON-safe values (what ``truncsens certify --json`` prints)."""
        return sanitize(self.summary)

    def plot(self, stem: str | Path) -> list[Path]:
        """Write the reliability, certificate-against-error and recomputation figures as ``<stem>-*.png``
        (:func:`truncsens.certificates.coverage_report.save_figures`) and return their paths."""
        return save_figures(self.dataset, self.summary, stem)


def certify_config(model: str = "reference", *, domain: str = "code", corpus: str | None = None, split: str = "auto",
                   reference_context: int | None = None, budgets: str = "12.5%,25%,50%", delta: float = 0.05,
                   sinks: int = 4, targets_per_doc: int = 2, max_docs: int | None = 16, seed: int = 0,
                   device: str = DEFAULT_DEVICE, dtype: str = "float32", batch_tokens: int | None = None,
                   out: str | Path | None = None, resume: bool = False, overwrite: bool = False, progress: bool = True,
                   granularity: str = "head", score: str = "window", obs_window: int = DEFAULT_OBS_WINDOW,
                   temper: float = DEFAULT_TEMPER, top_fraction: float = 0.25, semantics: str = "prefill_evict",
                   policies: str | None = None, draws: int = 1, variance: str = "hajek",
                   command: str = "") -> CertifyConfig:
    """The validated :class:`~truncsens.certificates.config.CertifyConfig` from ``truncsens certify``'s options
    (``out=None``: ``results/<model>-<corpus or domain>-certify.nc``).

    Raises:
        truncsens.certificates.config.CertifyError, truncsens.engine.config.MeasureError: as the config.
    """
    options = {**locals(), "out": None if out is None else str(out)}  # the run options, by API keyword
    return CertifyConfig(**config_fields(CertifyConfig, options))


def run_certification(cfg: CertifyConfig, plot_out: str | Path | None = None, loaded: LoadedModel | None = None,
                      keep: bool = True) -> Certification:
    """Run ``cfg`` (:func:`truncsens.certificates.driver.run_certify`), load and summarize its results, and
    draw the figures to ``plot_out`` (None: none).

    Args:
        keep: whether ``cfg.out`` is kept (False: a temporary file, recorded nowhere).

    Raises:
        FileExistsError: the results file (unless resuming) or a figure exists and not ``cfg.overwrite``,
            checked before anything is computed.
        as :func:`truncsens.certificates.driver.run_certify`.
    """
    check_new_files([*([] if cfg.resume else [cfg.out]), *(certify_figure_paths(plot_out) if plot_out is not None else [])],
                    cfg.overwrite)
    done = run_certify(cfg, loaded)
    ds = results.load(done.path)
    summary = summarize(ds, seed=cfg.seed)
    figures = save_figures(ds, summary, plot_out) if plot_out is not None else []
    summary["files"] = [*([str(done.path)] if keep else []), *map(str, figures)]
    return Certification(ds, summary, Path(done.path) if keep else None, figures)


@keeps_caller_state
def certify(model: Any = "reference", tokenizer: Any = None, *, domain: str = "code", corpus: str | None = None,
            split: str = "auto", reference_context: int | None = None, budgets: str = "12.5%,25%,50%",
            delta: float = 0.05, sinks: int = 4, targets_per_doc: int = 2, max_docs: int | None = 16, seed: int = 0,
            device: str | None = None, dtype: str | None = None, batch_tokens: int | None = None, out: str | Path | None = None,
            plot_out: str | Path | None = None, resume: bool = False, overwrite: bool = False, progress: bool = True,
            granularity: str = "head", score: str = "window", obs_window: int = DEFAULT_OBS_WINDOW,
                   temper: float = DEFAULT_TEMPER, top_fraction: float = 0.25, semantics: str = "prefill_evict",
                   policies: str | None = None, draws: int = 1, variance: str = "hajek",
            command: str | None = None) -> Certification:
    """Measure the certificates of poisson eviction (and its comparisons) at every budget.

    Args:
        model: a spec ("reference", a hub id, a checkpoint folder) or a transformers causal LM object
            with its ``tokenizer`` (as :func:`truncsens.measure`).
        device, dtype: None: auto (CUDA when present, else cpu) and float32 for a spec, the model object's own otherwise.
        budgets: token counts or percentages of N, comma-separated ("12.5%,25%,50%").
        granularity, score, obs_window: the sampling design (:mod:`truncsens.certificates.designs`): one
            per layer and key/value head from its ``score`` ("window" of the last ``obs_window`` prefill
            queries, "h2o", "key_norm"), or ``granularity="token"``: one shared design (the ablation).
        semantics: "prefill_evict" (keys computed with the full prompt, then evicted) or "streaming"
            (a cache that evicts as the stream goes, per layer and key/value head; poisson thins its
            tail with known inclusion probabilities); "reencode" is refused (no cache to certify).
        policies: comma-separated, poisson among them (None: poisson, topk, random under
            prefill_evict; poisson under streaming, where sink_recent is the comparison).
        draws: D >= 1 independent Poisson draws per target (prefill_evict; D >= 2 adds the records of
            every draw and the squared error over them against V̂ to the summary).
        variance: "hajek" (the linearized Poisson variance) or "hajek_bias" (plus the squared estimated
            bias of the Hájek ratio) for the radii (prefill_evict).
        out: keep the results file here; plot_out: write the figures as ``<plot_out>-*.png``.
        the others: ``truncsens certify``'s options (``truncsens certify --help``).

    Returns:
        a :class:`Certification`.

    Raises:
        ValueError: as :func:`truncsens.measure` for the model; ``resume`` without ``out``.
        as :func:`run_certification` and :func:`certify_config`.
    """
    options = {k: v for k, v in locals().items() if k not in ("model", "tokenizer", "command", "plot_out")}
    if command is None:
        command = python_call("truncsens.certify", certify, model, tokenizer, {**options, "plot_out": plot_out})
    model, device, options["dtype"], loaded = model_argument(model, tokenizer, device, dtype)
    options["device"] = device or DEFAULT_DEVICE
    if out is not None:
        return run_certification(certify_config(model, command=command, **options), plot_out, loaded)
    if resume:
        raise ValueError("resume continues an interrupted results file: give out=PATH")
    with tempfile.TemporaryDirectory(prefix="truncsens-certify-") as folder:
        options["out"] = Path(folder) / "certify.nc"
        return run_certification(certify_config(model, command=command, **options), plot_out, loaded, keep=False)
