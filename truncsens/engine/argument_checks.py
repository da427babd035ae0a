"""The checks of a run's arguments that read their values alone (no model, corpus or file), in a module
that imports no torch: ``truncsens measure`` refuses a bad value or combination with them before it
imports the engine, and :class:`truncsens.engine.config.MeasureConfig` runs the same checks first.
"""

from __future__ import annotations

from typing import Any, Mapping

from truncsens.corpora.document import SPLITS
from truncsens.engine.errors import MeasureError

POSITIVE = ("docs_per_shard", "max_docs", "targets_per_doc", "max_batch_tokens", "reference_context", "chunk", "draws")
"""Config fields that must be at least 1 when given."""

KEYWORD = {"max_batch_tokens": "batch_tokens"}
"""A field whose API keyword differs from its name (the keyword is what the message names, its flag after it)."""


def check_values(f: Mapping[str, Any]) -> None:
    """Refuse what :class:`~truncsens.engine.config.MeasureConfig`'s fields ``f`` (field name -> value;
    absent names count as not given) say on their own: an unknown split, a count below 1, negative
    sinks or seed, a window below 1 token, budgets or a semantics without policies (a window sweep is
    re-encode), windows beside policies.

    Raises:
        MeasureError: the first of those found; the message names the API keyword and its flag.
    """
    split = f.get("split", "auto")
    if split not in ("auto", *SPLITS):
        raise MeasureError(f"split (--split) must be one of auto, {', '.join(SPLITS)}; got {split!r}")
    for name in POSITIVE:
        value = f.get(name)
        if value is not None and value < 1:
            keyword = KEYWORD.get(name, name)
            raise MeasureError(f"{keyword} (--{keyword.replace('_', '-')}) must be at least 1, got {value}")
    if f.get("n_sink") is not None and f["n_sink"] < 0:
        raise MeasureError(f"sinks (--sinks) must be >= 0, got {f['n_sink']}")
    if f.get("seed") is not None and f["seed"] < 0:  # numpy's generators take no negative seed
        raise MeasureError(f"seed (--seed) must be >= 0, got {f['seed']}")
    bad = [w for w in f.get("windows") or () if w < 1]
    if bad:
        raise MeasureError(f"windows (--windows) must be at least 1 token each, got {', '.join(map(str, bad))}")
    if f.get("per_layer"):
        return
    if f.get("policies") is None:
        given = [f"{name} (--{name})" for name in ("budgets", "semantics") if f.get(name) is not None]
        if given:
            raise MeasureError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} policies (--policy NAME): window "
                               "sweeps are re-encode; for a suffix window under another semantics use --policy suffix")
    elif f.get("windows"):
        raise MeasureError("windows (--windows) is for suffix truncation; with policies (--policy) give budgets "
                           "(--budgets) instead")
