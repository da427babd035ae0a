"""The configuration of one ``truncsens measure`` run, which validates itself once.

A run sweeps either **windows** (suffix truncation, re-encode semantics: the kept context is
``n_sink`` first tokens plus the last w tokens; arXiv 2605.25085) or **budgets** of one or more
retention **policies** under a chosen semantics. Both are the same computation: a window w with S
sinks is the ``sink_recent`` policy (``suffix`` when S = 0) at budget S + w under ``reencode``
(:mod:`truncsens.engine.sweep`).

Everything that can be checked without loading a model or a corpus is checked in
:meth:`MeasureConfig.__post_init__`, and defaults that depend on other options are resolved there
(sinks, semantics, output path), so the command line only parses and the engine only runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from truncsens.corpora import Corpus
from truncsens.engine.argument_checks import check_values
from truncsens.engine.block.plan import check_policy_blocks
from truncsens.engine.bos import check_rule
from truncsens.engine.errors import MeasureError  # (defined there, imported from here too)
from truncsens.engine.semantics import SEMANTICS, Semantics, SemanticsError, semantics_for
from truncsens.policies import PolicyError, make_policy, policy_class
from truncsens.policies.kvpress_adapter import check_policy_args
from truncsens.engine.options import MeasureOptions, later_dependents, later_options, run_only_fields

DEFAULT_POLICY_SINKS = 4  # StreamingLLM's (arXiv 2309.17453)
PROTOCOLS = ("exact", "block")  # one pass per (target, window), or K targets per pass (truncsens.engine.block.plan)
DEFAULT_BLOCK_FRACTION = MeasureOptions.block_fraction  # declared with the option (truncsens.engine.options)
DEFAULT_BLOCK_SIZE = MeasureOptions.block_size
BLOCK_POLICIES = ("suffix", "sink_recent")  # the policies whose kept set is a window (block protocol)
DEFAULT_PER_LAYER_SEMANTICS = "prefill_evict"  # one prefill per batch serves every layer's windows
# the semantics that run per-layer window sweeps (their per_layer attribute), the default first
PER_LAYER_SEMANTICS = tuple(sorted((n for n, s in SEMANTICS.items() if s.per_layer), key=lambda n: n != DEFAULT_PER_LAYER_SEMANTICS))
DEFAULT_BATCH_TOKENS = {"cpu": 16384, "cuda": 262144}
# fields that say where and how a run executes, not what it measures (free to change on --resume)
RUN_ONLY_FIELDS = run_only_fields(MeasureOptions)
# options added after results files existed, with their defaults: at the default they are left out of a
# run's fingerprint (with the options that only mean something beside them), so an earlier run still resumes
LATER_OPTIONS = later_options(MeasureOptions)
LATER_OPTIONS_DEPENDENTS = later_dependents(MeasureOptions)


def resolved_paths(model: str, corpus: str | None) -> tuple[str, str | None]:
    """``(model, corpus)`` as a resume fingerprint records them: a local checkpoint folder or GGUF file and a
    corpus file or folder as absolute, resolved paths, so a run resumed from another working directory, with
    paths relative to it, matches; a hub id, ``reference``, a manifest name or None as given."""
    from truncsens.models import model_source

    def absolute(spec: str) -> str:
        path = Path(spec).expanduser()
        return str(path.resolve()) if path.exists() else spec

    model = absolute(model) if model and model_source(model).kind in ("local", "gguf") else model
    return model, absolute(corpus) if corpus else corpus


def default_out(model: str, corpus: str | None, domain: str, suffix: str = "") -> Path:
    """``results/<model name>-<corpus stem or domain><suffix>.nc`` (``:`` of synthetic specs as ``-``;
    a synthetic source with its own corpus has no domain in the name). Suffixes in use: "" (window
    sweeps), "-policies" (policy sweeps), "-certify" (``truncsens certify``)."""
    from truncsens.models import model_source

    stem = Path(model.replace(":", "-")).name
    if model_source(model).has_own_corpus and corpus in (None, "synthetic"):
        return Path("results") / f"{stem}{suffix}.nc"
    return Path("results") / f"{stem}-{corpus and Path(corpus).stem or domain}{suffix}.nc"


@dataclass
class MeasureConfig(MeasureOptions):
    """Configuration of one run (token counts in tokens).

    Attributes:
        model: "reference", a Hugging Face id, a local checkpoint folder, or ``synthetic:ALPHA``.
        domain, corpus, split, text_field: the documents (:func:`truncsens.corpora.load_corpus`);
            ``corpus`` may be a :class:`~truncsens.corpora.Corpus` already in memory (the API's ``texts``).
        reference_context: N, tokens of context of the reference distribution (None: the model's maximum).
        windows: window sweep (None with no ``policies``: powers of two from 1 to N/2).
        policies: policy names (:data:`truncsens.policies.POLICIES`) for a budget sweep; they share
            the reference pass. None: a window sweep.
        budgets: kept keys of the target's query, its own included (None: powers of two from 16 to N/2).
        semantics: "reencode", "streaming" or "prefill_evict" (None: reencode for windows,
            streaming for policies).
        n_sink: first tokens kept (None: 0 for windows, 4 for policies).
        bos: "auto", "always", "never" or "document": where a BOS token goes (:mod:`truncsens.engine.bos`).
        positions: "original" (kept tokens keep their position ids) or "reindexed".
        score, per_query, recent_fraction, top_fraction: policy parameters (poisson / random).
        observation_window, pooling_kernel: SnapKV's window w and pooling kernel p (``snapkv``,
            ``snapkv_shared``; None: each policy's default).
        n_summary: ``merge_mean``'s summary slots m (``--summary-slots``; None: its default, 1).
        policy_args: parameters of ``kvpress:<PressClass>`` policies (``--policy-arg key=value``), or None.
        chunk: with ``streaming``, tokens processed between two eviction decisions (1: token by
            token; :mod:`truncsens.policies.streaming`).
        granularity: "token" (one kept set per target, shared by all layers and heads) or "head"
            (one per key/value head, shared by all layers; ``streaming`` and ``prefill_evict`` only;
            :mod:`truncsens.engine.granularity`).
        per_layer: a per-layer window sweep (the measurement behind ``truncsens plan``): for each layer l alone, D_l(w), layer l keeping
            its ``n_sink`` first and last w keys (the query's own among them) while every other layer
            keeps its full cache, under ``prefill_evict`` (default) or ``streaming``
            (:mod:`truncsens.engine.layer_windows_pass`); ``n_sink`` defaults to 4; results gain a
            leading ``layer`` dim.
        draws: R, independent draws of every randomized policy (``random``, ``poisson``); R > 1 adds
            a ``draw`` dim to the results (:func:`truncsens.engine.kernel.measure_draws`).
        policy_seed: seed of the randomized policies' draws (None: ``seed``), separate from the
            target draw so that one set of targets can be measured under several draws.
        targets_per_doc, max_docs, seed: which targets (:func:`truncsens.targets.select_targets`).
        device, dtype, max_batch_tokens: where and how the model runs.
        protocol: "exact" (one pass per target and window) or "block" (K consecutive targets per
            pass, K = max(1, min(block_size, floor(w * block_fraction))): window sweeps under
            ``reencode``, :mod:`truncsens.engine.block.plan`; and policy sweeps under ``streaming``
            (one stream per block of B = K(N) targets) or ``prefill_evict`` (one reference pass and
            one B-query decode per block and budget), :mod:`truncsens.engine.block.policies`).
        block_fraction, block_size: the block protocol's K (fraction in (0, 1], size >= 1).
        docs_per_shard, out, resume, overwrite, progress, command: shards, results file (None: see
            :func:`default_out`; an existing one is replaced only with ``overwrite``), progress
            reports, the command line recorded in the results.

    Raises:
        MeasureError: a count below 1 (``--chunk`` and ``--draws`` included), negative sinks, an unknown
            BOS rule, split or position mode, windows together with policies, budgets or semantics without policies,
            a chunk other than 1 outside ``streaming``, an unknown protocol, a block fraction outside
            (0, 1], a block size below 1, a block fraction or size other than the default without
            ``--protocol block``, ``--protocol block`` with a reencode policy sweep other than
            one of :data:`BLOCK_POLICIES`, or under streaming / prefill_evict with a ``kvpress:``
            policy, ``--positions reindexed``, ``--granularity head`` or ``--chunk`` above 1 (each
            message names ``--protocol exact``), ``granularity`` other than token or
            head, head granularity under ``reencode`` or with a ``kvpress:`` policy (presses keep their
            own per-layer, per-head sets), more than one draw
            without a randomized policy; ``per_layer`` with ``--policy``, a semantics other than
            :data:`PER_LAYER_SEMANTICS`, ``--protocol block``, ``--positions reindexed``, ``--granularity
            head`` or a synthetic source.
        PolicyError: unknown or repeated policy, bad policy parameter, a policy the semantics
            cannot run, ``policy_args`` that no policy of the run takes.
        truncsens.engine.semantics.SemanticsError: unknown semantics or a position mode it lacks.
    """

    def __post_init__(self) -> None:
        check_values({f.name: getattr(self, f.name) for f in fields(self)})
        check_rule(self.bos)
        if self.per_layer:
            self._check_per_layer()
        elif self.policies is None:
            self.semantics = "reencode"
            self.n_sink = 0 if self.n_sink is None else self.n_sink
        else:
            if not self.policies:
                raise PolicyError("no policy given")
            for name in self.policies:
                policy_class(name)
            if len(set(self.policies)) != len(self.policies):
                raise PolicyError(f"a policy is listed twice: {', '.join(self.policies)}")
            self.semantics = self.semantics or "streaming"
            self.n_sink = DEFAULT_POLICY_SINKS if self.n_sink is None else self.n_sink
        semantics = semantics_for(self.semantics)  # the object: every check below reads its attributes
        if self.chunk != 1 and not semantics.streams:
            streaming = " or ".join(semantics.names_where(lambda s: s.streams))
            raise MeasureError(f"chunk (--chunk) is the decision interval of --semantics {streaming}; semantics {self.semantics} "
                               "decides once per target (leave --chunk at 1)")
        self._check_protocol(semantics)
        if self.granularity == "head" and self.policies is None:
            per_head = " or ".join(semantics.names_where(lambda s: s.needs_transformers))  # those with per-head caches
            raise MeasureError(f"granularity='head' (--granularity head) needs --policy NAME with --semantics {per_head} "
                               "(a window sweep re-encodes one sequence, which has a single kept set)")
        try:  # one check of the name and of what the semantics supports
            semantics.check_granularity(self.granularity)
        except (PolicyError, SemanticsError) as exc:
            raise MeasureError(str(exc)) from None
        per_layer_heads = [n for n in self.policies or () if policy_class(n).layer_heads]
        if self.granularity == "head" and per_layer_heads:
            one = len(per_layer_heads) == 1
            raise MeasureError(f"{', '.join(per_layer_heads)} keep{'s its' if one else ' their'} own per-layer, per-head "
                               f"kept sets; leave --granularity at token with {'it' if one else 'them'}")
        self._check_window_options()
        semantics.check_positions(self.positions)
        check_policy_args([policy_class(n) for n in self.policies or ()], self.policy_args)
        policies = self.build_policies()
        for policy in policies:
            semantics.check_policy(policy)
            if policy.merges:  # one merge decision per slot at original positions: refused before the model loads
                try:
                    semantics.check_merging(policy, self.positions, self.granularity)
                except PolicyError as exc:
                    raise MeasureError(str(exc)) from None
        if self.protocol == "block" and semantics.policy_blocks:
            check_policy_blocks(semantics, policies, self.positions, self.granularity, self.chunk)
        if self.draws > 1 and not any(p.randomized for p in policies):
            raise MeasureError(f"draws={self.draws} (--draws {self.draws}) repeats the draws of randomized policies (--policy random or "
                               "poisson); " + ("a window sweep is deterministic" if self.policies is None else
                                              f"{', '.join(self.policies)} decide{'s' if len(self.policies) == 1 else ''} deterministically") + " (leave --draws at 1)")
        if self.out is None:
            suffix = "-per-layer" if self.per_layer else "" if self.policies is None else "-policies"
            self.out = str(default_out(self.model, self.corpus_name, self.domain, suffix))

    def _check_window_options(self) -> None:
        """``--observation-window``, ``--pooling-kernel`` and ``--summary-slots`` need a policy that has
        them (the values themselves are checked by the policies).

        Raises:
            MeasureError: one of them given without such a policy.
        """
        given = [flag for flag, value in (("observation_window (--observation-window)", self.observation_window),
                                          ("pooling_kernel (--pooling-kernel)", self.pooling_kernel)) if value is not None]
        if given and not any({"window", "kernel"} <= {f.name for f in fields(policy_class(n))} for n in self.policies or ()):
            raise MeasureError(f"{' and '.join(given)} {'sets' if len(given) == 1 else 'set'} SnapKV's observation "
                               "window; give --policy snapkv or snapkv_shared")
        if self.n_summary is not None and self.n_summary < 1:
            raise MeasureError(f"summary_slots (--summary-slots) must be >= 1, got {self.n_summary}")
        if self.n_summary is not None and not any("n_summary" in {f.name for f in fields(policy_class(n))}
                                                  for n in self.policies or ()):
            raise MeasureError(f"summary_slots (--summary-slots) sets merge_mean's summary slots; give --policy merge_mean "
                               f"(this run's policies: {', '.join(self.policies) if self.policies else 'none, a window sweep'})")

    def _check_per_layer(self) -> None:
        """Options of a per-layer window sweep, with its defaults (prefill_evict, 4 sinks).

        Raises:
            MeasureError: see the class docstring.
        """
        if self.policies is not None or self.budgets is not None:
            raise MeasureError("per_layer (--per-layer) sweeps windows layer by layer; it takes --windows, not --policy or --budgets")
        self.semantics = self.semantics or DEFAULT_PER_LAYER_SEMANTICS
        if self.semantics not in PER_LAYER_SEMANTICS:
            raise MeasureError(f"per_layer (--per-layer) runs under --semantics {' or '.join(PER_LAYER_SEMANTICS)} (the cache a "
                               f"server keeps per layer), not {self.semantics}")
        if self.protocol != "exact":
            raise MeasureError("per_layer (--per-layer) runs the exact protocol only (leave --protocol at exact)")
        if self.granularity != "token":
            raise MeasureError("per_layer (--per-layer) keeps one window per layer, the same for every head; leave --granularity at token")
        from truncsens.models import model_source

        if model_source(self.model).has_own_corpus:
            raise MeasureError(f"per_layer (--per-layer) windows the attention layers of a transformers model; {self.model} is a "
                               "synthetic source without any (use a model id or checkpoint folder)")
        if self.positions != "original":
            raise MeasureError("per_layer (--per-layer) keeps original positions (each layer's kept keys are those of the full "
                               "prefill); leave --positions at original")
        self.n_sink = DEFAULT_POLICY_SINKS if self.n_sink is None else self.n_sink

    def _check_protocol(self, semantics: Semantics) -> None:
        if self.protocol not in PROTOCOLS:
            raise MeasureError(f"protocol (--protocol) must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not 0 < self.block_fraction <= 1:
            raise MeasureError(f"block_fraction (--block-fraction) must be in (0, 1], got {self.block_fraction}")
        if self.block_size < 1:
            raise MeasureError(f"block_size (--block-size) must be at least 1, got {self.block_size}")
        if self.protocol != "block":
            given = [f"{name} (--{name.replace('_', '-')})" for name, default in
                     (("block_fraction", DEFAULT_BLOCK_FRACTION), ("block_size", DEFAULT_BLOCK_SIZE)) if getattr(self, name) != default]
            if given:
                raise MeasureError(f"{' and '.join(given)} {'sets' if len(given) == 1 else 'set'} the block protocol's passes; they need --protocol block "
                                   f"(this run uses --protocol {self.protocol})")
            return
        window_like = self.policies is None or (len(self.policies) == 1 and self.policies[0] in BLOCK_POLICIES)
        if not semantics.policy_blocks:  # reencode: window-like sweeps only
            if not window_like:
                able = " or ".join(semantics.names_where(lambda s: s.policy_blocks))
                raise MeasureError(
                    "protocol='block' (--protocol block) measures re-encode window sweeps (no policies, or one of --policy "
                    f"{' / '.join(BLOCK_POLICIES)}) and policy sweeps under --semantics {able} "
                    f"(docs/method.md, Block protocol); policy {', '.join(self.policies)} under {semantics.name}: use "
                    "--protocol exact")
            return
        # with policy_blocks (streaming, prefill_evict): checked on the built policies (check_policy_blocks)

    @property
    def sweep_dim(self) -> str:
        """"window" for a window sweep, "budget" for a policy sweep."""
        return "window" if self.policies is None else "budget"

    def policy_params(self) -> dict:
        """The options that configure policies (each policy takes those it has)."""
        window = {k: v for k, v in (("window", self.observation_window), ("kernel", self.pooling_kernel)) if v is not None}
        summary = {} if self.n_summary is None else {"n_summary": self.n_summary}
        return dict(n_sink=self.n_sink, score=self.score, per_query=self.per_query, **summary,
                    recent_fraction=self.recent_fraction, top_fraction=self.top_fraction, policy_args=self.policy_args,
                    **window)

    def build_policies(self) -> list:
        """The configured policies (none for a window sweep, whose policy follows from the sinks)."""
        return [make_policy(name, **self.policy_params()) for name in self.policies or ()]

    def batch_tokens(self, device: str) -> int:
        """Token budget of one forward pass: ``max_batch_tokens`` or :data:`DEFAULT_BATCH_TOKENS` of the device type."""
        import torch

        return self.max_batch_tokens or DEFAULT_BATCH_TOKENS.get(torch.device(device).type, 16384)

    @property
    def corpus_name(self) -> str | None:
        """The corpus's name: the option as given, or the name of a corpus passed in memory."""
        return self.corpus.name if isinstance(self.corpus, Corpus) else self.corpus

    @property
    def draw_seed(self) -> int:
        """The seed of the policies' draws: ``policy_seed``, or ``seed`` when none is given."""
        return self.seed if self.policy_seed is None else self.policy_seed

    def fingerprint(self, **resolved) -> dict:
        """What must match for ``--resume`` to reuse shards: every field except :data:`RUN_ONLY_FIELDS`,
        plus ``resolved`` values (N, corpus hash, the sweep)."""
        keep = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in RUN_ONLY_FIELDS}
        keep["corpus"] = self.corpus_name  # the documents themselves are in the corpus hash (resolved)
        keep["model"], keep["corpus"] = resolved_paths(self.model, keep["corpus"])  # from any working directory
        for name, default in LATER_OPTIONS.items():  # at their default, options added later leave the
            if name in keep and keep[name] == default:  # fingerprint as it was, so earlier runs still resume
                del keep[name]
                for dependent in LATER_OPTIONS_DEPENDENTS.get(name, ()):
                    del keep[dependent]
        if keep.get("policy_seed") in (None, self.seed):  # the same draws as the default
            keep.pop("policy_seed", None)
        if "snapkv" in (self.policies or ()):  # snapkv was one shared kept set before (now snapkv_shared):
            keep["snapkv"] = "per layer and key/value head"  # its earlier shards are not reused
        if any(policy_class(name).randomized for name in self.policies or ()):  # draws common to every budget since --draws:
            keep["draw_seeds"] = "common to every budget"  # shards drawn per budget before are not reused
        keep.update(resolved)
        return keep
