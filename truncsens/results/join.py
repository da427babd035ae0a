"""Policy sweeps of the same targets, measured in separate runs, joined along the ``policy`` dim.

Score-reading policies under ``streaming`` run token by token and take far longer than the others,
so they are often measured in runs of their own. Two runs measured the same thing, and can be compared
side by side, exactly when they agree on everything but the policies: the model and its revision, the
corpus (hash), N, the semantics, positions, sinks, chunk, granularity, the draws, the budgets and
the targets (document, position, token). :func:`join_policy_runs` checks that and concatenates the
runs along ``policy``; nothing is recomputed or altered.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import xarray as xr

from truncsens.results import ResultsError

# attrs that must agree for two policy runs to be one measurement; an attr a file lacks (it was written before
# the option existed) reads as the option's default. The policies' own seeds (policy_seed) may differ: they
# belong to the policies, and the joined file keeps each run's command.
# Sinks are a policy parameter (suffix keeps none, sink_recent its --sinks): each policy's are in the
# policy_params attr, merged over the runs.
SAME_MEASUREMENT = ("model", "model_revision", "model_sha256", "tokenizer", "dtype", "semantics", "positions",
                    "reference_context", "corpus", "corpus_sha256", "split", "seed", "chunk", "granularity",
                    "bos_rule", "tokenizer_adds", "protocol", "block_fraction", "block_size", "block_length",
                    "block_extra_context")
# what a file without these attrs (written before their options existed) measured: the options' defaults
# (declared with them in truncsens.engine.options, which lies above this layer; tests/test_run_options.py
# checks that the two agree). block_*: absent from exact runs alike.
ATTR_DEFAULTS = {"chunk": 1, "granularity": "token", "protocol": "exact"}
# the weights' content hash (truncsens.models.identity) came after results files existed: a file without it
# is not compared on it (nothing says its weights differ)
UNKNOWN_WHEN_ABSENT = ("model_sha256",)
WEIGHTS = ("model", "model_revision", "model_sha256")  # what two files must share to come from the same weights
TARGET_COORDS = ("doc", "position", "token_id", "actual_context")  # actual_context: block-protocol runs
# what a window run must share with a policy run to be its truncation yardstick (compare-policies --truncation):
# the model, its inputs and the target draw; semantics, positions and protocol may differ
SAME_SOURCE = ("model", "model_revision", "model_sha256", "tokenizer", "dtype", "reference_context", "corpus", "corpus_sha256",
               "split", "seed", "bos_rule", "tokenizer_adds")


def attr_differences(a: xr.Dataset, b: xr.Dataset, keys: Sequence[str]) -> list[tuple[str, object, object]]:
    """(key, value in ``a``, value in ``b``) of every attr of ``keys`` that differs; an attr a file lacks
    reads as its option's default (:data:`ATTR_DEFAULTS`), or None."""
    out = []
    for key in keys:
        if key in UNKNOWN_WHEN_ABSENT and (key not in a.attrs or key not in b.attrs):
            continue  # a file from before the attr existed: its weights are unknown, not different
        va, vb = (ds.attrs.get(key, ATTR_DEFAULTS.get(key)) for ds in (a, b))
        if va != vb:
            out.append((key, _plain(va), _plain(vb)))
    return out


def check_same_weights(a: xr.Dataset, b: xr.Dataset, name_a: str, name_b: str) -> None:
    """Raise :class:`ResultsError` when ``a`` and ``b`` were made from different weights: another
    ``model``, ``model_revision`` or content hash ``model_sha256`` (:data:`WEIGHTS`)."""
    differ = attr_differences(a, b, WEIGHTS)
    if differ:
        key, va, vb = differ[0]
        raise ResultsError(f"{name_b} and {name_a} were made from different weights: {key} is {vb!r} there and "
                           f"{va!r} here; compare only results of one model")


def target_difference(a: xr.Dataset, b: xr.Dataset, coords: Sequence[str] = TARGET_COORDS) -> str | None:
    """The first target coord of ``coords`` that ``a`` and ``b`` do not share equal (present in one
    only, or other values), or None when they measured the same targets."""
    for coord in coords:
        if (coord in a.coords) != (coord in b.coords) or (
                coord in a.coords and not np.array_equal(a[coord].values, b[coord].values)):
            return coord
    return None


def _plain(value):
    """A numpy scalar as the Python value it holds (for messages)."""
    return value.item() if isinstance(value, np.generic) else value


def policy_names(ds: xr.Dataset) -> list[str]:
    """The policies of a budget sweep: its ``policy`` coord, or the ``policy`` attr of a one-policy file."""
    if "policy" in ds.dims:
        return [str(p) for p in ds["policy"].values]
    return [str(ds.attrs.get("policy", ""))]


def with_policy_dim(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with a leading ``policy`` dim (a one-policy file gets one of length 1)."""
    if "policy" in ds.dims:
        return ds
    return ds.expand_dims(policy=policy_names(ds)).transpose("policy", ...)


def join_policy_runs(runs: Sequence[xr.Dataset], sources: Sequence[str] | None = None) -> xr.Dataset:
    """Join budget sweeps of the same targets along ``policy``.

    Args:
        runs: results Datasets of ``truncsens measure --policy ...`` (one or more policies each).
        sources: their file names, for error messages and the ``joined_from`` attr.

    Returns:
        One Dataset with every run's policies in order, the first run's attrs plus ``policy`` (all
        names, comma-separated), ``policy_params`` (every run's, merged) and ``joined_from`` (the sources and their ``command`` attrs); a single
        run is returned unchanged.

    Raises:
        ResultsError: a run is not a budget sweep, a policy appears twice, or two runs differ in a
            measurement attr (:data:`SAME_MEASUREMENT`), the budgets, the draws or the targets.
    """
    sources = list(sources or [f"run {i + 1}" for i in range(len(runs))])
    if len(runs) == 1:
        return runs[0]
    first, name0 = runs[0], sources[0]
    seen: list[str] = []
    for ds, name in zip(runs, sources):
        if "budget" not in ds.dims:
            raise ResultsError(f"{name} is not a policy sweep (no budget dim): join only runs of truncsens measure --policy")
        differ = attr_differences(first, ds, SAME_MEASUREMENT)
        if differ:
            key, a, b = differ[0]
            raise ResultsError(f"{name} and {name0} are different measurements: {key} is {b!r} there and {a!r} here")
        if not np.array_equal(ds["budget"].values, first["budget"].values):
            raise ResultsError(f"{name} and {name0} have different budgets: {ds['budget'].values.tolist()} "
                               f"and {first['budget'].values.tolist()}")
        if ds.sizes.get("draw") != first.sizes.get("draw"):
            raise ResultsError(f"{name} and {name0} have different numbers of draws: "
                               f"{ds.sizes.get('draw', 1)} and {first.sizes.get('draw', 1)}")
        coord = target_difference(ds, first)
        if coord is not None:
            raise ResultsError(f"{name} and {name0} measure different targets (coord {coord} differs): "
                               "join only runs with the same corpus, N, seed and targets per document")
        for policy in policy_names(ds):
            if policy in seen:
                raise ResultsError(f"policy {policy} appears in more than one run ({name})")
            seen.append(policy)
    joined = xr.concat([with_policy_dim(ds) for ds in runs], dim="policy", data_vars="minimal", coords="minimal",
                       compat="override", join="exact", combine_attrs="override")
    params: dict = {}
    for ds in runs:
        given = ds.attrs.get("policy_params") or {}
        params.update(json.loads(given) if isinstance(given, str) else given)
    joined.attrs = {**first.attrs, "policy": ",".join(seen), "policy_params": json.dumps(params, sort_keys=True),
                    "joined_from": [{"file": s, "command": ds.attrs.get("command", "")} for ds, s in zip(runs, sources)]}
    return joined
