"""Attribution AUCs within task kinds, and stratified over them, for ``truncsens certify-attribution`` [ours].

The task set mixes two kinds of target (copy and key–value recall) whose failures differ in cause:
on the reference model key–value failures are mostly eviction-caused and copy failures mostly
inherent. A pooled AUC (eviction-caused against inherent failures) can then be earned by a score
that tells the kinds apart and nothing else. Three readings keep the kind out:

- **within a kind**: the Mann–Whitney AUC over the failures of that kind alone;
- **stratified**: the Mann–Whitney statistic summed over kinds, each kind's pairs only, divided by
  the number of such pairs, ``Σ_s U_s / Σ_s n⁺_s·n⁻_s`` — the probability that an eviction-caused
  failure outranks an inherent one *of the same kind*. A score constant within each kind gets 0.5;
- **the task kind alone** (:func:`kind_score`): each failure scored by the share of eviction-caused
  failures of its kind on development documents, the baseline any pooled AUC is set beside.

Intervals: a percentile bootstrap over documents, the same resamples for every score and reading
(:func:`truncsens.stats.resample_weights`). Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np

from truncsens.certificates.attribution import auc
from truncsens.stats import percentile_interval, resample_weights


def stratified_auc(scores: np.ndarray, positive: np.ndarray, strata: np.ndarray) -> float:
    """``Σ_s U_s / Σ_s n⁺_s·n⁻_s`` over strata ``s`` (module docstring); ties count ½.

    Args:
        scores: [n] (NaN left out); positive: [n] bool; strata: [n] labels (any dtype).

    Returns:
        float in [0, 1]; NaN when no stratum has both classes.

    Raises:
        ValueError: arrays of different lengths.
    """
    s, y, g = np.asarray(scores, float), np.asarray(positive, bool), np.asarray(strata)
    if not s.shape == y.shape == g.shape:
        raise ValueError("scores, positive and strata need one value per record")
    num = pairs = 0.0
    for k in np.unique(g):
        m = (g == k) & ~np.isnan(s)
        p = float((m & y).sum()) * float((m & ~y).sum())
        if p:
            num, pairs = num + auc(s[m], y[m]) * p, pairs + p
    return num / pairs if pairs else math.nan


def kind_score(kind: np.ndarray, caused: np.ndarray, among: np.ndarray, development: np.ndarray) -> np.ndarray:
    """[n] the "task kind alone" score: the share of eviction-caused failures among the development
    failures of each record's kind (NaN for a kind without development failures).

    Args:
        kind: [n] task kind; caused: [n] bool eviction-caused; among: [n] bool failures;
        development: [n] bool records of development documents.
    """
    kind = np.asarray(kind)
    out = np.full(kind.shape, math.nan)
    for k in np.unique(kind):
        m = (kind == k) & among & development
        if m.any():
            out[kind == k] = float(caused[m].mean())
    return out


def _reading(s: np.ndarray, caused: np.ndarray, kind: np.ndarray, kinds: list[str]) -> list[float]:
    """[pooled, stratified, one AUC per kind] of one (resampled) set of failures."""
    return [auc(s, caused), stratified_auc(s, caused, kind), *(auc(s[kind == k], caused[kind == k]) for k in kinds)]


def kind_aucs_by_documents(scores: dict[str, np.ndarray], caused: np.ndarray, among: np.ndarray, kind: np.ndarray,
                           doc: np.ndarray, n_boot: int = 200, seed: int = 0, level: float = 0.95) -> dict[str, dict]:
    """Pooled, stratified and within-kind attribution AUCs of every score over the records ``among``,
    each with a percentile bootstrap over the documents of all records (paired: one set of resamples).

    Args:
        scores: name -> [m] scores (higher: more likely eviction-caused); caused: [m] bool;
        among: [m] bool the failures the AUCs run over; kind: [m] task kind; doc: [m] document ids.

    Returns:
        name -> {"pooled": {"value", "ci"}, "stratified": {...}, "by_kind": {kind: {...}}}; intervals
        [NaN, NaN] with fewer than two documents.

    Raises:
        ValueError: arrays of different lengths.
    """
    docs, index = np.unique(np.asarray(doc, dtype=str), return_inverse=True)
    caused, among, kind = np.asarray(caused, bool), np.asarray(among, bool), np.asarray(kind, dtype=str)
    if any(np.shape(a) != index.shape for a in (caused, among, kind, *scores.values())):
        raise ValueError("every score, caused, among and kind need one value per record of doc")
    kinds = sorted(set(kind[among]))
    w = resample_weights(len(docs), n_boot if len(docs) > 1 else 0, seed)  # [1 + n_boot, G]
    takes = [t[among[t]] for t in (np.repeat(np.arange(index.size), weights[index].astype(int)) for weights in w)]
    out = {}
    for name, s in scores.items():
        s = np.asarray(s, float)
        values = np.array([_reading(s[t], caused[t], kind[t], kinds) for t in takes])  # [1 + n_boot, 2 + kinds]

        def stat(j: int) -> dict:
            boot = values[1:, j]
            ci = list(percentile_interval(boot, level)) if len(boot) else [math.nan, math.nan]
            return {"value": float(values[0, j]), "ci": [float(c) for c in ci]}

        out[name] = {"pooled": stat(0), "stratified": stat(1), "by_kind": {k: stat(2 + i) for i, k in enumerate(kinds)}}
    return out
