"""Document-clustered statistics: per-document sums, bootstrap resamples of documents, the
cluster-robust (CR1) mean and standard error, and the percentile interval.

Targets of one document are dependent, so every standard error and every bootstrap in truncsens
treats **documents** as the independent units (clusters):

- standard error: CR1 cluster-robust variance of the mean (Cameron & Miller, "A Practitioner's
  Guide to Cluster-Robust Inference", J. Human Resources 50(2), 2015, with the G/(G-1)
  small-sample factor); with one target per document it equals the textbook s^2/n;
- bootstrap: documents drawn with replacement (the cluster bootstrap), each resample a vector of
  multiplicities;
- interval: the percentile interval (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993,
  ch. 13).

Pure numpy; no file or model access.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def doc_sums(values: np.ndarray, doc: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Per-document sums and counts of the finite values.

    Args:
        values: [n_targets, S] metric values.
        doc: [n_targets] document id of each target.

    Returns:
        (sums [G, S] float64, counts [G, S] float64, doc ids [G] in order of first appearance).
    """
    values = np.asarray(values, dtype=np.float64)
    ids, first, codes = np.unique(np.asarray(doc).astype(str), return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    codes = rank[codes.ravel()]  # [n_targets] document rank in order of first appearance
    finite = np.isfinite(values)
    G, S = order.size, values.shape[1]
    sums = np.zeros((G, S))
    counts = np.zeros((G, S))
    np.add.at(sums, codes, np.where(finite, values, 0.0))
    np.add.at(counts, codes, finite.astype(np.float64))
    return sums, counts, [str(ids[i]) for i in order]


def resampled_mean_se(multiplicity: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and cluster-robust (CR1) standard error of the mean for document resamples.

    ``mean = sum_g m_g S_g / sum_g m_g n_g``; ``se^2 = G/(G-1) sum_g m_g (S_g - n_g mean)^2 / n^2``
    with ``m_g`` the number of times document g is drawn, ``S_g``, ``n_g`` its sum and count,
    ``n = sum_g m_g n_g`` and ``G = sum m_g`` (Cameron & Miller 2015; it is s^2/n for one
    target per document).

    Args:
        multiplicity: [B, G] draws of each document per resample (all ones: the sample itself).
        sums, counts: [G, S] from :func:`doc_sums`.

    Returns:
        (mean [B, S], se [B, S]); NaN where a window has no values (se NaN when G < 2).
    """
    m = np.asarray(multiplicity, dtype=np.float64)
    n = m @ counts  # [B, S]
    total = m @ sums
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / n
        dev2 = m @ (sums**2) - 2 * mean * (m @ (sums * counts)) + mean**2 * (m @ (counts**2))
        g = m.sum(1, keepdims=True)  # [B, 1]
        se = np.sqrt(np.clip(dev2, 0, None) * g / (g - 1)) / n
    se = np.where(g > 1, se, np.nan)
    return mean, se


def cluster_mean_se(values: np.ndarray, doc: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Mean and CR1 standard error (:func:`resampled_mean_se`) of each column, documents as clusters.

    Args:
        values: [n_targets, S] (NaN/inf entries are left out of both); doc: [n_targets] ids.

    Returns:
        (mean [S], se [S]); se NaN with fewer than two documents.
    """
    sums, counts, ids = doc_sums(values, doc)
    mean, se = resampled_mean_se(np.ones((1, len(ids))), sums, counts)  # [1, S] each
    return mean[0], se[0]


def bootstrap_multiplicities(n_docs: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n_docs] int: how often each document is drawn in each resample (with replacement)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_docs, np.full(n_docs, 1.0 / n_docs), size=n_boot)


def resample_weights(n_docs: int, n_boot: int, seed: int) -> np.ndarray:
    """[1 + n_boot, n_docs]: a row of ones (the sample itself), then :func:`bootstrap_multiplicities`."""
    boot = bootstrap_multiplicities(n_docs, n_boot, seed) if n_boot else np.zeros((0, n_docs))
    return np.vstack([np.ones((1, n_docs)), boot])


def percentile_interval(samples: np.ndarray, level: float = 0.95, keep_inf: bool = False) -> tuple[float, float]:
    """Percentile bootstrap interval (Efron & Tibshirani 1993, ch. 13): the (1-level)/2 and
    (1+level)/2 quantiles of the samples, linearly interpolated between order statistics.

    NaN samples (resamples that could not be computed) are always dropped. Infinite samples are
    dropped too unless ``keep_inf`` (e.g. w(eps) = +inf where a resampled law does not decrease);
    an end that falls next to an infinite order statistic is that infinity.

    Returns:
        (lo, hi); (nan, nan) when no sample is left.
    """
    s = np.asarray(samples, dtype=np.float64).ravel()
    s = s[~np.isnan(s)] if keep_inf else s[np.isfinite(s)]
    if s.size == 0:
        return (math.nan, math.nan)
    q = (1 - level) / 2
    if np.all(np.isfinite(s)):
        lo, hi = np.percentile(s, [100 * q, 100 - 100 * q])
        return float(lo), float(hi)
    s = np.sort(s)
    out = []
    for x in (q * (s.size - 1), (1 - q) * (s.size - 1)):
        a, b = int(math.floor(x)), int(math.ceil(x))
        if math.isinf(s[a]) or math.isinf(s[b]):
            out.append(float(s[b]) if x - a > 0 else float(s[a]))
        else:
            out.append(float(s[a] + (s[b] - s[a]) * (x - a)))
    return out[0], out[1]


def quantiles_with_inf(values: np.ndarray, q: Sequence[float]) -> list[float]:
    """Quantiles (in %, linear interpolation between order statistics, as ``np.percentile``) of
    values that may hold +inf or -inf; NaN values are dropped.

    ``np.percentile`` interpolates ``inf - inf`` to NaN; here an interpolation that touches an
    infinite order statistic is that infinity (the limit of the linear rule), and one that falls
    exactly on a finite order statistic is that value.

    Args:
        values: [n] numbers; q: percentages in [0, 100].

    Returns:
        one float per ``q``; NaN for every ``q`` when no value is left.
    """
    s = np.sort(np.asarray(values, dtype=np.float64).ravel())
    s = s[~np.isnan(s)]
    if s.size == 0:
        return [math.nan for _ in q]
    if np.all(np.isfinite(s)):
        return [float(v) for v in np.percentile(s, list(q))]
    out = []
    for pct in q:
        x = pct / 100 * (s.size - 1)
        a, b = int(math.floor(x)), int(math.ceil(x))
        frac = x - a
        if frac == 0 or s[a] == s[b]:
            out.append(float(s[a]))
        elif math.isinf(s[b]):
            out.append(float(s[b]))
        elif math.isinf(s[a]):
            out.append(float(s[a]))
        else:
            out.append(float(s[a] + (s[b] - s[a]) * frac))
    return out


def mean_with_inf(finite_mean: np.ndarray, n_posinf: np.ndarray, n_neginf: np.ndarray) -> np.ndarray:
    """The mean of a set from the mean of its finite values and its counts of +inf and -inf values:
    +inf when it holds +inf (and no -inf), -inf for the reverse, NaN when it holds both, else the
    finite mean (IEEE arithmetic of a sum that contains infinities).

    Args:
        finite_mean, n_posinf, n_neginf: broadcastable arrays [...].

    Returns:
        [...] float64.
    """
    pos = np.asarray(n_posinf) > 0
    neg = np.asarray(n_neginf) > 0
    m = np.asarray(finite_mean, dtype=np.float64)
    return np.where(pos & neg, np.nan, np.where(pos, np.inf, np.where(neg, -np.inf, m)))


def interval_or_none(samples: np.ndarray | None, level: float, keep_inf: bool = False) -> list[float] | None:
    """:func:`percentile_interval` as a list, or None when there are no resamples (``samples`` None or empty)."""
    if samples is None or np.asarray(samples).size == 0:
        return None
    return list(percentile_interval(samples, level, keep_inf))
