"""The configuration of one ``truncsens certify`` run, which validates itself once.

Budgets are token counts (``"128"``) or percentages of the reference context N (``"12.5%"``), kept
keys of the target's query, its own token included; a percentage p gives ``round(p/100 · N)``
tokens. Everything checkable without a model is checked at construction; budgets against N in
:meth:`CertifyConfig.resolve_budgets`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from truncsens.certificates.designs import CertifyDesign, DesignError
from truncsens.certificates.options import CertifyCommandOptions, CertifyOptions
from truncsens.certificates.semantics import CertifySemantics, CertifySemanticsError, certify_semantics
from truncsens.engine.config import MeasureConfig, default_out, resolved_paths
from truncsens.engine.options import later_options, run_only_fields

MEASURE_FIELDS = frozenset(f.name for f in fields(MeasureConfig) if f.init)  # what a certify field passes on


class CertifyError(ValueError):
    """A certify run cannot run as configured; the message names the problem and the fix."""


def parse_budgets(text: str, option: str = "budgets (--budgets)") -> list[tuple[float, bool]]:
    """``"12.5%,256"`` -> [(12.5, True), (256, False)]; ``option`` is named in the errors.

    Raises:
        CertifyError: empty, not a number, a count below 1, a percentage outside (0, 100].
    """
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        percent = item.endswith("%")
        try:
            value = float(item[:-1]) if percent else int(item)
        except ValueError:
            raise CertifyError(f"{option}: {item!r} is neither a token count (128) nor a percentage (12.5%)") from None
        if percent and not 0 < value <= 100:
            raise CertifyError(f"{option}: a percentage of the reference context must lie in (0%, 100%], got {item}")
        if not percent and value < 1:
            raise CertifyError(f"{option}: a token count must be at least 1, got {item}")
        out.append((value, percent))
    if not out:
        raise CertifyError(f"{option} is empty; give token counts or percentages such as 12.5%,25%,50%")
    return out


def resolve_budgets(parsed: list[tuple[float, bool]], reference_context: int, n_sink: int,
                    option: str = "budgets (--budgets)") -> list[int]:
    """Sorted unique budgets in tokens of :func:`parse_budgets` output for a reference context of N
    tokens: a percentage p gives ``round(p/100 · N)``.

    Raises:
        CertifyError: a budget at or above N (nothing would be evicted), or at most ``n_sink``; the
            message names ``option``.
    """
    N = reference_context
    out = []
    for value, percent in parsed:
        k = int(round(value / 100 * N)) if percent else int(value)
        shown = f"{option}: {value:g}% of N = {k} tokens" if percent else f"{option}: {k} tokens"
        if k >= N:
            raise CertifyError(f"budget {shown} is at or above the reference context of {N} tokens: nothing would be "
                               "evicted; use budgets below the context")
        if k <= n_sink:
            raise CertifyError(f"budget {shown} leaves no room after the {n_sink} sinks; use larger budgets")
        out.append(k)
    return sorted(set(out))


@dataclass
class CertifyBase(CertifyOptions):
    """The fields, defaults and checks that ``truncsens certify`` (:class:`CertifyConfig`) and
    ``truncsens certify-attribution`` (:class:`~truncsens.certificates.attribution_driver.AttributionConfig`)
    share, declared once; token counts in tokens.

    Attributes:
        model, domain, corpus, split, reference_context: as in
            :class:`~truncsens.engine.config.MeasureConfig` (N: None = the model's maximum).
        budgets: comma-separated token counts or percentages of N (default 12.5%,25%,50%).
        delta: miss probability of the certificates, in (0, 1) (nominal coverage 1 − δ).
        n_sink: sinks of poisson and topk.
        max_docs, seed: documents used (at most; None: all) and the seed of targets and Poisson draws.
        device, dtype, max_batch_tokens, out, overwrite, progress, command: where and how it runs;
            ``out`` defaults to ``results/<model>-<corpus or domain><OUT_SUFFIX>.nc``.
        docs_per_shard, resume: the run is written in shards of this many documents next to ``out``
            (:func:`truncsens.engine.run.skeleton.run_sharded`); ``resume`` continues an interrupted
            run from them.
        top_fraction: share of the budget poisson and topk keep surely as the top keys by score (the
            poisson policy's ``top_fraction``; the recent share stays 1/4).
        granularity, score, obs_window, temper: the sampling design (:class:`~truncsens.certificates.designs.CertifyDesign`:
            per layer and key/value head from the head's observation-window score by default;
            ``granularity="token"`` is the shared design, the ablation).
        parsed_budgets: :func:`parse_budgets` of ``budgets`` (set at construction).

    Raises:
        CertifyError: δ outside (0, 1), a bad budget.
        MeasureError: a run option that :meth:`measure_config` refuses (counts, sinks, split).
    """

    OUT_SUFFIX: ClassVar[str] = ""  # the default results file's suffix, per command
    POLICY_SET: ClassVar[str] = "certify_policies"  # the semantics' default policies of this command

    parsed_budgets: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise CertifyError(f"delta (--delta) must lie strictly between 0 and 1, got {self.delta}")
        try:
            self.design
        except DesignError as exc:
            raise CertifyError(str(exc)) from None
        try:
            self.rule.check_policies(self.policy_names())
        except CertifySemanticsError as exc:
            raise CertifyError(str(exc)) from None
        if not 0 <= self.top_fraction <= 0.75:
            raise CertifyError(f"top_fraction (--top-fraction) must lie in [0, 0.75] (the recent keys take the first quarter of the "
                               f"budget), got {self.top_fraction}")
        self.parsed_budgets = parse_budgets(self.budgets)
        self.check_run_options()
        if self.out is None:
            self.out = str(default_out(self.model, self.corpus, self.domain, self.OUT_SUFFIX))

    @property
    def rule(self) -> CertifySemantics:
        """The semantics of the run (:mod:`truncsens.certificates.semantics`; raises CertifyError for reencode or an unknown name)."""
        try:
            return certify_semantics(self.semantics)
        except CertifySemanticsError as exc:
            raise CertifyError(str(exc)) from None

    def policy_names(self) -> list[str]:
        """``--policies`` as a list, or the semantics' default for this command."""
        if self.policies is None:
            return list(getattr(self.rule, self.POLICY_SET))
        return [t.strip() for t in self.policies.split(",") if t.strip()]

    @property
    def design(self) -> CertifyDesign:
        """The sampling design of the run (raises DesignError for a bad option)."""
        return CertifyDesign(self.granularity, self.score, self.obs_window, self.temper)

    def check_run_options(self) -> None:
        """Check the run options (counts, sinks, split, policies) once, by building the command's
        equivalent MeasureConfig; each command says how."""
        raise NotImplementedError

    def shared_fields(self) -> dict:
        """The values of this class's own fields (those every certify command has), by name."""
        return {f.name: getattr(self, f.name) for f in fields(CertifyOptions)}

    def resolve_budgets(self, reference_context: int) -> list[int]:
        """Sorted unique budgets in tokens for a reference context of N tokens
        (:func:`resolve_budgets` of ``--budgets``).

        Raises:
            CertifyError: a budget at or above N (nothing would be evicted), or at most ``n_sink``.
        """
        return resolve_budgets(self.parsed_budgets, reference_context, self.n_sink)

    def fingerprint(self, **resolved) -> dict:
        """What must match for ``--resume``: every field but those of where/how it runs, plus ``resolved``."""
        later = later_options(type(self))  # at their defaults, options added later leave earlier runs resumable
        keep = {k: v for k, v in asdict(self).items() if k not in (*run_only_fields(self), "parsed_budgets")
                and not (k in later and v == later[k])}
        keep["model"], keep["corpus"] = resolved_paths(self.model, self.corpus)  # from any working directory
        keep.update(resolved)
        return keep

    def check_before_loading(self) -> None:
        """What the options say wrong without a model, said before one loads (a real model takes
        minutes): the corpus or domain, and with ``reference_context`` given, a budget at or above N.

        Raises:
            truncsens.corpora.CorpusError, MeasureError, CertifyError: as the run would, later.
        """
        from truncsens.engine.documents import check_documents_before_loading
        from truncsens.engine.config import MeasureError

        check_documents_before_loading(self.measure_config())
        if self.reference_context:
            if self.reference_context < 2:
                raise MeasureError(f"reference_context (--reference-context) must be at least 2 tokens, got {self.reference_context}")
            self.resolve_budgets(self.reference_context)


@dataclass
class CertifyConfig(CertifyCommandOptions, CertifyBase):
    """Configuration of one certify run (token counts in tokens).

    Attributes:
        the fields of :class:`CertifyBase` (reference_context default: the model's maximum), and
        text_field: as in :class:`~truncsens.engine.config.MeasureConfig`.
        targets_per_doc: targets drawn per document (a small default: 2 per document, 16 documents);
            ``out`` defaults to ``results/<model>-<corpus or domain>-certify.nc``.
        draws: D >= 1 independent Poisson draws per target (:func:`~truncsens.certificates.driver.draw_seeds`).
        variance: the radii's variance estimate (:data:`~truncsens.certificates.estimator.VARIANCES`).

    Raises:
        CertifyError: δ outside (0, 1), a bad budget, draws below 1, an unknown variance, or either
            of them other than its default under streaming.
        MeasureError: a count below 1, negative sinks, an unknown split (:class:`MeasureConfig`).
    """

    OUT_SUFFIX: ClassVar[str] = "-certify"
    # fields named as MeasureConfig's that mean something else there (a budgets text; the sampling design's)
    OTHER_MEANING: ClassVar[tuple[str, ...]] = ("budgets", "granularity", "score", "policies", "draws")

    def check_run_options(self) -> None:
        """Checked by building :meth:`measure_config`; ``draws`` and ``variance`` here."""
        from truncsens.certificates.estimator import VARIANCES

        if isinstance(self.draws, bool) or not isinstance(self.draws, int) or self.draws < 1:
            raise CertifyError(f"draws (--draws) must be at least 1, got {self.draws!r}")
        if self.variance not in VARIANCES:
            raise CertifyError(f"variance (--variance) must be one of {', '.join(VARIANCES)}, got {self.variance!r}")
        if (self.draws > 1 or self.variance != "hajek") and self.rule.streams:
            raise CertifyError(f"draws (--draws) and variance (--variance) are measured under prefill_evict only, not under "
                               f"{self.semantics}; use --semantics prefill_evict")
        self.measure_config()

    def measure_config(self, budgets: list[int] | None = None) -> MeasureConfig:
        """The equivalent :class:`MeasureConfig` (documents, targets and provenance are shared with
        ``truncsens measure``): the run's policies under its semantics."""
        shared = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.init and f.name in MEASURE_FIELDS and f.name not in self.OTHER_MEANING}
        return MeasureConfig(**{**shared, "out": self.out or "unused.nc"}, policies=self.policy_names(), budgets=budgets)
