"""Retention policies, one module each, found by name.

>>> from truncsens.policies import make_policy
>>> make_policy("sink_recent", n_sink=4).name
'sink_recent'

Each policy is a small dataclass with a ``keep(context_len, budget, queries, seeds, scores)`` method
returning, per query position, which earlier keys are kept and each kept key's additive logit offset
(:class:`~truncsens.policies.base.Kept`).

May import: models, metrics and the math modules; never the engine (what the kvpress adapter reads is passed in).
"""

from __future__ import annotations

import dataclasses

from truncsens.policies.base import CAPABILITIES, Kept, Policy, PolicyError
from truncsens.policies.h2o import H2OPolicy
from truncsens.policies.key_norm import KeyNormPolicy
from truncsens.policies.merge_mean import MergeMeanPolicy
from truncsens.policies.merge_nearest import MergeNearestPolicy
from truncsens.policies.kvpress_adapter import PREFIX as KVPRESS_PREFIX, KVPressPolicy, kvpress_policy_class
from truncsens.policies.poisson import SCORES, PoissonPolicy
from truncsens.policies.random import RandomPolicy
from truncsens.policies.sink_recent import SinkRecentPolicy
from truncsens.policies.snapkv import SnapKVPolicy
from truncsens.policies.snapkv_shared import SnapKVSharedPolicy
from truncsens.policies.suffix import SuffixPolicy
from truncsens.policies.topk import TopKPolicy
from truncsens.policies.tova import TOVAPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SuffixPolicy, SinkRecentPolicy, RandomPolicy, PoissonPolicy, H2OPolicy, TOVAPolicy,
                              SnapKVPolicy, SnapKVSharedPolicy, KeyNormPolicy, TopKPolicy, MergeMeanPolicy,
                              MergeNearestPolicy)
}


def policy_class(name: str) -> type[Policy]:
    """The policy class registered under ``name``, or a kvpress press's for ``kvpress:<PressClass>``
    (:mod:`truncsens.policies.kvpress_adapter`, resolved on demand, not listed in :data:`POLICIES`).

    Raises:
        PolicyError: unknown name (the message lists the known ones); for ``kvpress:`` names, kvpress
            not importable or no such score-based press (the message names the press and the install).
    """
    if name.startswith(KVPRESS_PREFIX):
        return kvpress_policy_class(name)
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)} or {KVPRESS_PREFIX}<PressClass>")
    return POLICIES[name]


def make_policy(name: str, **params) -> Policy:
    """Build a policy by name; parameters it does not have are ignored (so one set of options,
    e.g. ``n_sink``, ``per_query``, ``score``, can configure several policies).

    Raises:
        PolicyError: unknown name or a bad parameter value.
    """
    cls = policy_class(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in params.items() if k in fields})


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names -> list, each checked against the registry (order kept, no repeats).

    Raises:
        PolicyError: empty list, unknown or repeated name.
    """
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise PolicyError("no policy given; choose from " + ", ".join(POLICIES))
    for n in names:
        policy_class(n)
    if len(set(names)) != len(names):
        raise PolicyError(f"policy listed twice in {text!r}")
    return names


def policy_params(policy: Policy) -> dict:
    """The dataclass fields of a policy instance (for provenance attrs)."""
    return dataclasses.asdict(policy)


__all__ = [
    "CAPABILITIES", "H2OPolicy", "KVPressPolicy", "KeyNormPolicy", "Kept", "MergeMeanPolicy", "MergeNearestPolicy", "POLICIES", "PoissonPolicy", "Policy", "PolicyError",
    "RandomPolicy", "SCORES", "SinkRecentPolicy", "SnapKVPolicy", "SnapKVSharedPolicy", "SuffixPolicy", "TOVAPolicy", "TopKPolicy", "make_policy", "parse_policies", "policy_class", "policy_params",
]
