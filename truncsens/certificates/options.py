"""The options of ``truncsens certify`` and ``truncsens certify-attribution``, declared once as run
options (:func:`truncsens.engine.options.option`): what each means, its default, its flag and help.

:class:`CertifyOptions` holds those both commands share, :class:`CertifyCommandOptions` and
:class:`AttributionOptions` each command's own; the configs that validate them are
:class:`~truncsens.certificates.config.CertifyConfig` and
:class:`~truncsens.certificates.attribution_driver.AttributionConfig`. Light: the command line reads it
to build ``--help``.
"""

from __future__ import annotations

from dataclasses import dataclass

from truncsens.certificates.designs import DEFAULT_OBS_WINDOW, DEFAULT_TEMPER
from truncsens import DEFAULT_DEVICE
from truncsens.engine.options import corpus_help_text, option

DEFAULT_BUDGETS = "12.5%,25%,50%"  # the paper's budgets (arXiv 2607.21475)


@dataclass
class CertifyOptions:
    """The options both certify commands take (token counts in tokens; meanings:
    :class:`~truncsens.certificates.config.CertifyBase`)."""

    model: str = option("reference", "'reference' (bundled), a Hugging Face id or a local checkpoint folder (a transformers model that uses the attention interface).", metavar="MODEL")
    domain: str = option("code", "code or nl: picks the default corpus of the domain.", metavar="DOMAIN")
    corpus: str | None = option(None, lambda: f"Override the corpus: {corpus_help_text()}.", metavar="CORPUS")
    split: str = option("auto", "heldout, train, all, or auto (held-out for builtin corpora).", metavar="SPLIT")
    reference_context: int | None = option(None, "N: tokens of context (default: model maximum).")
    budgets: str = option(DEFAULT_BUDGETS, "Budgets, repeated or comma-separated: token counts or percentages of N.", metavar="LIST", listed=True)
    delta: float = option(0.05, "Miss probability of the certificates, in (0, 1); nominal coverage 1 - delta.", metavar="DELTA")
    n_sink: int = option(4, "Sinks of poisson and topk.", keyword="sinks")
    max_docs: int | None = option(16, "Use at most this many (long enough) documents.")
    seed: int = option(0, "Seed of the target draw and the Poisson draws.", metavar="SEED")
    device: str = option(DEFAULT_DEVICE, "auto (CUDA when present, else cpu), cpu, cuda, cuda:N or mps.", metavar="DEVICE", run_only=True)
    dtype: str = option("float32", "float32, bfloat16, float16 or float64.", metavar="DTYPE")
    max_batch_tokens: int | None = option(None, "Token budget of one forward pass.", keyword="batch_tokens", run_only=True)
    out: str | None = option(None, "Results file (default results/<model>-<domain>-certify.nc).", metavar="PATH", run_only=True)
    docs_per_shard: int = 8  # the run is written in shards of this many documents next to --out
    resume: bool = option(False, "Continue an interrupted run from its shards.", run_only=True)
    overwrite: bool = option(False, "Replace an existing results file.", run_only=True)
    progress: bool = option(True, "Progress on stderr.", run_only=True)
    command: str = option("", "The command line recorded in the results.", cli=False, run_only=True)
    granularity: str = option("head", "Sampling design: 'head' (one per layer and key/value head, from the head's own score) or 'token' (one shared by every layer and head, from one score averaged over them: the ablation).", metavar="NAME")
    score: str = option("window", "Per-head score of the design: 'window' (attention of the last --obs-window prefill queries), 'h2o' (attention of every prefill query) or 'key_norm'.", metavar="NAME")
    obs_window: int = option(DEFAULT_OBS_WINDOW, "W: prefill queries of the 'window' score.", metavar="W")
    temper: float = option(DEFAULT_TEMPER, "gamma > 0: inclusion probabilities from score^gamma (below 1 spreads them).", metavar="GAMMA")
    top_fraction: float = option(0.25, "Share of the budget poisson and topk keep surely as the top keys by score.", metavar="FRACTION")
    semantics: str = option("prefill_evict", "prefill_evict (keys computed with the full prompt, evicted before the target's query) or streaming (every layer and key/value head evicts as the stream goes; reencode has no cache to certify).", metavar="NAME", later=True)
    policies: str | None = option(None, "Policies, repeated or comma-separated: poisson (certified) and its comparisons: topk, random under prefill_evict; sink_recent under streaming (default: all of them; certify under streaming: poisson).", metavar="LIST", later=True, listed=True)


@dataclass
class CertifyCommandOptions(CertifyOptions):
    """``truncsens certify``'s own options (and two fields it sets itself)."""

    text_field: str = "text"
    targets_per_doc: int = option(2, "Targets drawn per document.")
    draws: int = option(1, "D: independent Poisson draws per target (the same certain set, independent uniforms); D >= 2 records every draw and reports the squared error measured over them against the variance estimate.", metavar="D", later=True)
    variance: str = option("hajek", "Variance estimate of the radii: hajek (the linearized Poisson variance) or hajek_bias (plus the squared estimated bias of the Hajek ratio; the plain one is recorded beside it).", metavar="NAME", later=True)


@dataclass
class AttributionOptions(CertifyOptions):
    """``truncsens certify-attribution``'s own options (and those whose help or default differ)."""

    corpus: str | None = option(None, lambda: f"Override the corpus searched for copy targets: {corpus_help_text()}.", metavar="CORPUS")
    reference_context: int | None = option(512, "N: tokens of context of every target.")
    max_docs: int | None = option(16, "Held-out documents searched for copy targets.")
    seed: int = option(0, "Seed of the target draw, the key-value documents and the Poisson draws.", metavar="SEED")
    out: str | None = option(None, "Results file (default results/<model>-<domain>-attribution.nc).", metavar="PATH", run_only=True)
    copy_per_doc: int = option(4, "Copy targets drawn per document.")
    copy_rule: str = option("induction", "induction (the token before the target also precedes its earlier occurrence), span (the 4 tokens before it do, and nowhere nearer) or token (the token alone).", metavar="RULE")
    kv_docs: int = option(8, "Synthetic key-value recall documents (one target each).")
    min_distance: int | None = option(None, "D: the copied token lies at least D tokens back and not in the last D - 1 (default N/4).", metavar="D")
    trajectory: int = option(0, "Also run a greedy trajectory of this many steps under poisson eviction and report its e-process (0: none).")
    trajectory_budget: str = option("25%", "Budget of the trajectory: a token count or a percentage of N.", metavar="BUDGET")
