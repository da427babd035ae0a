"""Where a BOS token goes in a run's contexts: the ``--bos`` rule (API ``bos``).

A model trained with a BOS at the start of every sequence (Llama, Gemma) reads a context without one
as out of distribution. Following lm-evaluation-harness's rolling windows (a prefix token at the start
of each window), the rules are:

- ``auto`` (default): ``always`` when the tokenizer adds a BOS by default, else no BOS anywhere;
- ``always``: every context, reference and kept, under every semantics, begins with the tokenizer's
  BOS at position 0. The reference context of a target t is the BOS followed by the N - 1 tokens
  x[t-N+1 : t] at positions 1 .. N-1; kept tokens follow the BOS with their positions. The BOS is
  the first sink: a run keeps at least one sink (``--sinks`` below 1 is raised to 1, so a window w
  keeps 1 + w keys), and it counts in budgets and KV bytes like any kept key. A policy without sinks
  could drop it and is refused, as is ``--protocol block`` (its rows are not one context per target);
- ``document`` (the rule before this option): a BOS only as a document's first token, so only a
  reference context that starts at the document's start begins with it;
- ``never``: no BOS anywhere.

Documents are tokenized with the BOS at their start under ``auto``, ``always`` and ``document`` when
there is one (:mod:`truncsens.engine.documents`). Results record ``bos`` (the rule) and
``bos_prepended`` (1 when every context began with the BOS) whenever the rules differ for the model
(its tokenizer adds a BOS, or ``always``); when they cannot differ the file is as before this option.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from truncsens.engine.errors import MeasureError
from truncsens.targets import TargetSet

BOS_RULES = ("auto", "always", "never", "document")
DOCUMENT_RULE_TEXT = ("one BOS at the start of each document when the tokenizer adds one by default, none elsewhere; "
                      "literal special-token text encoded as text (docs/method.md)")


@dataclass(frozen=True)
class BosChoice:
    """The BOS rule of a run, resolved for its tokenizer.

    Attributes:
        rule: one of :data:`BOS_RULES`.
        document_bos: the token id put at each document's start (None: none).
        prepend: the token id put at position 0 of every context (None: none).
        matters: whether the rules give different runs for this tokenizer (it adds a BOS by
            default, or the rule is ``always``); only then are ``bos`` and ``bos_prepended`` recorded.
    """

    rule: str
    document_bos: int | None
    prepend: int | None
    matters: bool

    def attrs(self) -> dict:
        """Results attrs: ``bos``, ``bos_prepended`` (int) and the ``bos_rule`` text when :attr:`matters`, else none."""
        if not self.matters:
            return {}
        if self.prepend is not None:
            text = ("a BOS at position 0 of every context, reference and kept, under every semantics: the reference "
                    "context is the BOS and the N - 1 tokens before the target, kept tokens follow it with their "
                    "positions, and it is the first sink, counted in budgets; literal special-token text encoded as "
                    "text (docs/method.md)")
        elif self.document_bos is None:
            text = "no BOS anywhere; literal special-token text encoded as text (docs/method.md)"
        else:
            text = DOCUMENT_RULE_TEXT
        return {"bos": self.rule, "bos_prepended": int(self.prepend is not None), "bos_rule": text}


def default_special_tokens(tokenizer) -> tuple[str, int | None]:
    """What the tokenizer adds to a text by default: ("bos", "eos", "bos+eos" or "none"), and the BOS
    id it puts in front (None when it adds none)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    adds_bos = bos is not None and len(full) > len(plain) and full[0] == bos and full[1 : 1 + len(plain)] == plain
    adds_eos = eos is not None and len(full) > len(plain) and full[-1] == eos and full[-1 - len(plain) : -1] == plain
    kinds = [k for k, on in (("bos", adds_bos), ("eos", adds_eos)) if on]
    return "+".join(kinds) or "none", (bos if adds_bos else None)


def check_rule(rule: str) -> None:
    """Raises: MeasureError: ``rule`` is not one of :data:`BOS_RULES`."""
    if rule not in BOS_RULES:
        raise MeasureError(f"bos (--bos) must be one of {', '.join(BOS_RULES)}, got {rule!r}")


def resolve_bos(rule: str, tokenizer, model_name: str) -> BosChoice:
    """The :class:`BosChoice` of ``rule`` for ``tokenizer`` (None: a source without one, e.g. synthetic).

    Raises:
        MeasureError: an unknown rule; ``always`` with a tokenizer that has no BOS token (or none at all).
    """
    check_rule(rule)
    added = default_special_tokens(tokenizer)[1] if tokenizer is not None else None
    if rule == "always":
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            raise MeasureError(f"bos='always' (--bos always): model {model_name!r} has no tokenizer with a BOS token; "
                               "use --bos auto or never")
        return BosChoice(rule, bos, bos, True)
    if rule == "never":
        return BosChoice(rule, None, None, added is not None)
    if rule == "document":
        return BosChoice(rule, added, None, added is not None)
    return BosChoice(rule, added, added, added is not None)


def with_bos_sinks(cfg, choice: BosChoice, policies):
    """``cfg`` with at least one sink when every context begins with the BOS (the BOS is the first sink).

    Args:
        cfg: the run's :class:`~truncsens.engine.config.MeasureConfig`.
        policies: the policies ``cfg`` builds (checked to have sinks).

    Raises:
        MeasureError: a policy without sinks, or ``--protocol block``, while every context begins with the BOS.
    """
    if choice.prepend is None:
        return cfg
    why = f"bos={choice.rule!r} (--bos {choice.rule}) begins every context with the BOS token, kept as the first sink"
    if cfg.protocol == "block":
        raise MeasureError(f"{why}; protocol='block' (--protocol block) shares one sequence between targets, so it cannot; use "
                           "--protocol exact, or --bos document")
    sinkless = [p.name for p in policies if getattr(p, "n_sink", None) is None]
    if sinkless:
        raise MeasureError(f"{why}; policy {', '.join(sinkless)} keeps no sinks and could evict it: use a policy with "
                           "sinks (sink_recent, poisson, topk), or --bos document or never")
    if cfg.n_sink is not None and cfg.n_sink >= 1:
        return cfg
    raised = copy.copy(cfg)  # not dataclasses.replace: the config's checks fill in defaults and would run again
    raised.n_sink = 1
    return raised


def starting_with(targets: TargetSet, token: int) -> TargetSet:
    """``targets`` whose reference contexts [n, N] begin with ``token``: column 0 replaced, so each is the
    token followed by the N - 1 tokens before its target."""
    context = targets.context.clone()
    if context.numel():
        context[:, 0] = torch.as_tensor(token, dtype=context.dtype)
    return dataclasses.replace(targets, context=context)


def select_starting_with(select, token: int):
    """A target selection (``(docs, N, targets_per_doc, seed) -> TargetSet``) whose contexts begin with ``token``."""

    def chosen(*args, **kwargs) -> TargetSet:
        return starting_with(select(*args, **kwargs), token)

    return chosen
