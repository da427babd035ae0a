"""The three semantics of a kept context, one object each (docs/method.md, "Semantics"), and their registry.

Every result says which one produced it (the ``semantics`` attr), and they are never mixed:

- ``reencode`` (:mod:`.reencode`): the model reads only the kept tokens of the target's query, as a
  fresh sequence (positions ``original`` or ``reindexed``);
- ``streaming`` (:mod:`.streaming`): one cache that evicts as it goes, decisions from online scores;
- ``prefill_evict`` (:mod:`.prefill_evict`): keys and values computed with the full context, then
  evicted before the target's query reads them (the kvpress convention).

A semantics (:class:`~truncsens.engine.semantics.base.Semantics`) declares what it needs from the
model (``needs_transformers``), which position modes it supports, what it provides to policies
(:data:`truncsens.policies.base.CAPABILITIES`), which options and protocols it runs (``streams``,
``policy_blocks``), the texts of its results and reports (``score_source``, ``block_passes``), which
query rows a policy decides for, its cost in forward tokens, and how it computes the kept next-token
log-probabilities of a batch. The engine (:mod:`truncsens.engine.kernel`) only calls these; callers
read these attributes, never compare names.

Sliding-window models (:mod:`truncsens.engine.attention_windows`): in every semantics a layer of window
W reads key j from query q only if the policy keeps j for q and ``q - j < W`` on original positions
(reindexed positions under ``reencode``). A model whose layers have different windows gets a dict
``{layer type: 4D mask}``; a model with layers that are neither full nor sliding-window attention
is refused with an error naming its windows.

Granularity (docs/method.md, "Granularity"): ``token`` gives one kept set per target shared by all
layers and heads; ``head`` (``streaming`` and ``prefill_evict`` only) one per key/value head, shared
by all layers. The policy runs unchanged on B·Hkv folded rows (scores of KV head h: mean over layers
and over the query heads of h's group; one seed per row, :func:`truncsens.policies.base.head_seeds`),
and the kept pass masks each query head with its KV head's kept set ([B, H, Tq, Tk] masks).

May import: the engine modules below it (forward passes, masks, caches), policies, models and the math modules.
"""

from __future__ import annotations

from truncsens.engine.semantics.base import Semantics, SemanticsError, windows_of
from truncsens.engine.semantics.prefill_evict import PrefillEvict, decode_kept
from truncsens.engine.semantics.reencode import Reencode
from truncsens.engine.semantics.streaming import Streaming
from truncsens.results import SEMANTICS as SEMANTICS_NAMES  # the results file's vocabulary

__all__ = ["SEMANTICS", "PrefillEvict", "Reencode", "Semantics", "SemanticsError", "Streaming", "decode_kept",
           "semantics_for", "windows_of"]

SEMANTICS: dict[str, Semantics] = {}
SEMANTICS.update((s.name, s) for s in (Reencode(SEMANTICS), Streaming(SEMANTICS), PrefillEvict(SEMANTICS)))
if tuple(SEMANTICS) != SEMANTICS_NAMES:  # pragma: no cover - a new semantics must be named in the results schema too
    raise ImportError(f"semantics registry {tuple(SEMANTICS)} differs from the results schema {SEMANTICS_NAMES}")


def semantics_for(name: str) -> Semantics:
    """The semantics registered under ``name``.

    Raises:
        SemanticsError: unknown name (the message lists the known ones).
    """
    if name not in SEMANTICS:
        raise SemanticsError(f"unknown semantics {name!r}; choose one of {', '.join(SEMANTICS)}")
    return SEMANTICS[name]
