"""Which process a certify run simulates, declared once per semantics: the policies it certifies, the
passes that compute the records, and the words the results record (docs/method.md, section 3).

- ``prefill_evict``: keys and values of the prompt come from the full context, then evicted before
  the target's query reads them (:func:`truncsens.certificates.passes.certify_batch`); poisson is
  certified, topk and random are its deterministic and uniform comparisons.
- ``streaming``: each layer and key/value head evicts as the stream goes, keys never re-admitted,
  scores only from this run (:func:`truncsens.certificates.stream_passes.certify_stream_batch`);
  poisson thins its tail with known inclusion probabilities, sink_recent is the uncertified
  recency comparison.

``reencode`` has no cache to certify and is refused by name. Light: no torch at import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

CERTIFIED = "poisson"  # the policy whose certificate is measured: it has a known sampling design


class CertifySemanticsError(ValueError):
    """A semantics or policy list certify cannot run; the message names the fix."""


@dataclass(frozen=True)
class CertifySemantics:
    """One semantics certify runs under.

    Attributes:
        name: the ``--semantics`` value.
        process: the process simulated, in words (the ``certified_process`` attr, through
            :meth:`process_for`).
        certify_policies, attribution_policies: the default policies of ``certify`` and
            ``certify-attribution`` (poisson first).
        allowed: every policy this semantics accepts (poisson and its comparisons).
        batch_path: ``module:function`` of the batch passes (imported on use).
        streams: True when each (policy, budget) is its own run over the whole context (the
            progress counts N tokens per run), False when it is one decoded token.
        names_design: the process's words end with how many designs the run draws (per head or shared).
    """

    name: str
    process: str
    certify_policies: tuple[str, ...]
    attribution_policies: tuple[str, ...]
    allowed: tuple[str, ...]
    batch_path: str
    streams: bool
    names_design: bool = False

    def process_for(self, design) -> str:
        """The process in words for a run drawing ``design`` (a
        :class:`~truncsens.certificates.designs.CertifyDesign`): ``process``, then, where
        ``names_design``, whether one design serves each layer and key/value head or all of them."""
        if not self.names_design:
            return self.process
        shared = design.granularity == "token"
        return f"{self.process} ({'one design shared by every layer and head' if shared else 'one design per layer and key/value head'})"

    def batch(self) -> Callable:
        """The batch function (``certify_batch`` or ``certify_stream_batch``)."""
        module, name = self.batch_path.split(":")
        return getattr(importlib.import_module(module), name)

    def tokens_per_target(self, N: int, runs: int) -> int:
        """Forward tokens of one target: its N-token reference and, per (policy, budget) run, one
        decoded token (prefill-evict) or the N tokens of a streaming run."""
        return N + runs * (N if self.streams else 1)

    def check_policies(self, names: list[str]) -> None:
        """Raise :class:`CertifySemanticsError` unless every name is allowed and poisson is among them."""
        for name in names:
            if name not in self.allowed:
                raise CertifySemanticsError(
                    f"policies (--policies) {name} under semantics={self.name!r} (--semantics {self.name}): a certificate needs a known sampling design; "
                    f"certify runs {CERTIFIED} (certainty-plus-Poisson) with the comparisons "
                    f"{', '.join(p for p in self.allowed if p != CERTIFIED)}")
        if CERTIFIED not in names:
            raise CertifySemanticsError(f"policies (--policies) must include {CERTIFIED}, the certified policy; got {','.join(names)}")
        if len(set(names)) != len(names):
            raise CertifySemanticsError(f"policies (--policies) lists a policy twice: {','.join(names)}")


CERTIFY_SEMANTICS = {s.name: s for s in (
    CertifySemantics("prefill_evict", "prefill-evict: keys computed with the full prompt, then evicted before the "
                     "target's query reads them", ("poisson", "topk", "random"), ("poisson", "topk", "random"),
                     ("poisson", "topk", "random"), "truncsens.certificates.passes:certify_batch", False, names_design=True),
    CertifySemantics("streaming", "streaming: every layer and key/value head evicts as the stream goes, token by "
                     "token, keys never re-admitted, scores from this run only; poisson thins its tail with known "
                     "inclusion probabilities (budget in expectation)",
                     ("poisson",), ("poisson", "sink_recent"), ("poisson", "sink_recent"),
                     "truncsens.certificates.stream_passes:certify_stream_batch", True),
)}
REFUSED = {"reencode": "a re-encoded context has no cache to certify (the model reads only the kept tokens: no "
                       "evicted key and no Hájek output)"}


def certify_semantics(name: str) -> CertifySemantics:
    """The :class:`CertifySemantics` named ``name``.

    Raises:
        CertifySemanticsError: ``reencode`` (with why) or an unknown name.
    """
    if name in REFUSED:
        raise CertifySemanticsError(f"semantics={name!r} (--semantics {name}): {REFUSED[name]}; use {' or '.join(CERTIFY_SEMANTICS)}")
    if name not in CERTIFY_SEMANTICS:
        raise CertifySemanticsError(f"semantics (--semantics) must be one of {', '.join(CERTIFY_SEMANTICS)}, got {name!r}")
    return CERTIFY_SEMANTICS[name]
