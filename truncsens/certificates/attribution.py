"""Attribution of task failures to eviction, and gated recomputation: pure numpy/scipy statistics of
the per-target records of ``truncsens certify-attribution`` (P. Xie, arXiv 2607.21475: "among
failures, the certificate separates eviction-caused failures from failures the full-cache model
also makes (AUC 0.75 at 6k tokens, 0.73 at 16k) ... certificate-gated recomputation beats random and
confidence-gated recomputation; output confidence predicts failure better than the certificate").

Definitions, fixed before any result was looked at:

- **failure** of a run at a target: its top-1 token is not the target token, or the target's NLL
  exceeds :data:`FAILURE_NLL` = ln 4 nats (probability below 1/4).
- **eviction-caused** failure: the evicted run fails and the full-cache run does not;
  **inherent** failure: both fail.
- **certificate score** of a target (poisson only): the mean over all layers and KV heads of the
  relative empirical-Bernstein radius ``r_EB / ‖ô‖₂`` of the target query (:func:`certificate_score`),
  normalized by the norm of the Hájek output ô the server computed, not by the full-cache ‖o‖ it
  does not have; an infinite radius (fewer than 2 kept random keys) makes it +inf. Higher means
  "more likely eviction-caused". (Files without ``attn_hat_norm``, those written
  before it was stored, fall back to the full-cache ``attn_norm``.) The oracle scores beside it (the true error, the output KL) and the realizable
  candidates are in :mod:`truncsens.certificates.attribution_scores`.
- **confidence**: the largest next-token probability of the evicted run (and, beside it, of the
  full-cache run); *lower* confidence means "more likely failure", so its AUC is that of −confidence.
- **AUC**: the Mann–Whitney statistic ``U / (n₊ n₋)`` (ties count 1/2), scipy.stats.mannwhitneyu.
- **gated recomputation** at a fraction f: the ``ceil(f·n)`` targets with the highest certificate
  (lowest confidence) are recomputed with the full cache; reported is the share of eviction-caused
  failures among them, ties at the cut broken uniformly at random (expected value,
  :func:`gated_removal_curve`); random gating removes ``ceil(f·n)/n`` in expectation.
- intervals: percentile bootstrap over documents (:mod:`truncsens.stats`), paired across statistics
  (every statistic of one resample uses the same documents).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import mannwhitneyu

from truncsens.stats import percentile_interval, resample_weights

FAILURE_NLL = math.log(4.0)  # nats
GATE_FRACTIONS = (0.05, 0.10, 0.20)
PAPER_AUC = {"6k tokens": 0.75, "16k tokens": 0.73}


def failures(argmax: np.ndarray, token_id: np.ndarray, nll: np.ndarray, threshold: float = FAILURE_NLL) -> np.ndarray:
    """[...] bool: top-1 id differs from the target token, or NLL (nats) above ``threshold``.

    Args:
        argmax: [..., n] top-1 token ids; token_id: [n] target tokens (broadcast); nll: [..., n] nats.
    """
    return (np.asarray(argmax) != np.asarray(token_id)) | (np.asarray(nll, float) > threshold)


def certificate_score(radius: np.ndarray, o_norm: np.ndarray) -> np.ndarray:
    """[n] mean over layers and heads of ``radius / norm`` (module docstring: the norm is ‖ô‖₂).

    Args:
        radius: [n, L, H] empirical-Bernstein radii; o_norm: [n, L, H] the output norm they are
            relative to (same units; the run's ``attn_hat_norm``).

    Returns:
        [n] float64 (+inf where some radius is +inf; NaN where ``‖o‖ = 0`` meets a zero radius).
    """
    r = np.asarray(radius, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = r / np.asarray(o_norm, float)  # [n, L, H]
    return rel.reshape(rel.shape[0], -1).mean(axis=1)


def target_records(ds, budget: int | None = None, policy: str = "poisson") -> dict[str, np.ndarray]:
    """Per-target arrays of a certify results Dataset for ``policy`` at one budget (all budgets
    stacked, budget by budget, when None): ``cert`` (:func:`certificate_score`), ``conf_kept``,
    ``conf_ref``, ``fail_kept`` and ``fail_ref`` (:func:`failures` at the file's ``failure_nll``
    attr, else :data:`FAILURE_NLL`) and ``doc``; each [n] (or [K·n]). The certificate is relative to
    ``attn_hat_norm`` (‖ô‖), or to ``attn_norm`` in a file without it."""
    norm = "attn_hat_norm" if "attn_hat_norm" in ds else "attn_norm"  # older files: no ‖ô‖ stored
    threshold = float(ds.attrs.get("failure_nll", FAILURE_NLL))
    budgets = [int(b) for b in ds["budget"].values] if budget is None else [budget]
    token, doc = ds["token_id"].values, np.asarray(ds["doc"].values, dtype=str)
    parts = []
    for k in budgets:
        sel = ds.sel(policy=policy, budget=k)
        parts.append({
            "cert": certificate_score(sel["radius_eb"].values, sel[norm].values),
            "conf_kept": sel["confidence_kept"].values, "conf_ref": ds["confidence_ref"].values,
            "fail_kept": failures(sel["argmax_kept"].values, token, sel["nll_kept"].values, threshold),
            "fail_ref": failures(ds["argmax_ref"].values, token, sel["nll_ref"].values, threshold), "doc": doc})
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Mann–Whitney AUC: P(score of a positive > score of a negative) + ½ P(tie).

    Args:
        scores: [n] (NaN scores are left out; ±inf rank as extremes); positive: [n] bool.

    Returns:
        float in [0, 1]; NaN when a class is empty.
    """
    s, y = np.asarray(scores, float), np.asarray(positive, bool)
    ok = ~np.isnan(s)
    pos, neg = s[ok & y], s[ok & ~y]
    if pos.size == 0 or neg.size == 0:
        return math.nan
    if np.isinf(pos).any() or np.isinf(neg).any():  # mannwhitneyu ranks, but keep inf - inf out of its sums
        order = np.unique(np.concatenate([pos, neg]))
        pos, neg = np.searchsorted(order, pos).astype(float), np.searchsorted(order, neg).astype(float)
    return float(mannwhitneyu(pos, neg, alternative="two-sided").statistic / (pos.size * neg.size))


def gated_removal_curve(scores: np.ndarray, caused: np.ndarray, fractions) -> np.ndarray:
    """Expected share of eviction-caused failures among the ``ceil(f·n)`` highest-scoring targets, at
    every fraction f, ties at the cut broken uniformly at random. The scores are sorted once: groups
    of tied scores, highest first, with cumulative sizes and eviction-caused counts; the first
    ``m = ceil(f·n)`` targets take the whole groups that fit and ``take / size`` of the next one's
    caused failures (the expected share under uniform tie-breaking).

    Args:
        scores: [n] gate scores (higher = recompute first; NaN ranks last, with −inf);
        caused: [n] bool eviction-caused; fractions: [F] shares of targets recomputed, in [0, 1].

    Returns:
        [F] float64 in [0, 1]; all NaN without eviction-caused failures.

    Raises:
        ValueError: a fraction outside [0, 1].
    """
    outside = [x for x in np.atleast_1d(fractions).tolist() if not 0 <= x <= 1]
    if outside:
        raise ValueError(f"a recomputation fraction must lie in [0, 1], got {outside[0]}")
    f = np.atleast_1d(np.asarray(fractions, float))  # [F]
    s = np.nan_to_num(np.asarray(scores, float), nan=-np.inf, posinf=np.inf, neginf=-np.inf)  # [n]
    c = np.asarray(caused, bool)  # [n]
    total = c.sum()
    if total == 0:
        return np.full(f.shape, math.nan)
    _, group = np.unique(s, return_inverse=True)  # [n] rank of the score among the G distinct ones
    size = np.bincount(group)[::-1]  # [G] targets per score, highest score first
    hits = np.bincount(group, weights=c.astype(float))[::-1]  # [G] caused failures per score
    end = np.cumsum(size)  # [G] targets in the groups up to g
    m = np.ceil(f * s.size - 1e-9)  # [F] targets recomputed
    full = np.searchsorted(end, m, side="right")  # [F] whole groups among them
    before = np.concatenate([[0.0], np.cumsum(hits)])[full]  # [F] caused failures of the whole groups
    start = np.concatenate([[0], end])[full]  # [F] targets in the whole groups
    size, hits = np.append(size, 1), np.append(hits, 0.0)  # [G + 1]: an empty group after the last
    partial = (m - start) / size[full] * hits[full]  # [F] expected caused failures of the cut group
    return (before + partial) / total


def random_removal(n: int, fraction: float) -> float:
    """Expected share removed by recomputing ``ceil(fraction·n)`` of n targets at random: ceil(f·n)/n."""
    return math.ceil(fraction * n - 1e-9) / n if n else math.nan


def attribution_statistics(cert: np.ndarray, conf_kept: np.ndarray, conf_ref: np.ndarray, fail_kept: np.ndarray,
                           fail_ref: np.ndarray, fractions=GATE_FRACTIONS) -> dict[str, float]:
    """Every statistic of one set of targets (flat dict name -> float; see the module docstring).

    Args:
        cert: [n] certificate scores; conf_kept, conf_ref: [n] confidences; fail_kept, fail_ref: [n] bool.
    """
    fail_kept, fail_ref = np.asarray(fail_kept, bool), np.asarray(fail_ref, bool)
    caused, inherent = fail_kept & ~fail_ref, fail_kept & fail_ref
    out = {"n": float(fail_kept.size), "n_failures": float(fail_kept.sum()), "n_eviction_caused": float(caused.sum()),
           "n_inherent": float(inherent.sum()), "n_fixed": float((~fail_kept & fail_ref).sum())}
    among = fail_kept
    gates = {"certificate": np.asarray(cert, float), "confidence": -np.asarray(conf_kept, float),
             "confidence_ref": -np.asarray(conf_ref, float)}
    for name, score in gates.items():
        out[f"auc_attribution_{name}"] = auc(score[among], caused[among])
        out[f"auc_failure_{name}"] = auc(score, fail_kept)
    curves = removal_curves(cert, conf_kept, caused, fractions)
    for i, f in enumerate(fractions):
        for name in ("certificate", "confidence", "random"):
            out[f"removed_{name}_{f:g}"] = float(curves[name][i])
    return out


def by_documents(cert, conf_kept, conf_ref, fail_kept, fail_ref, doc, n_boot: int = 200, seed: int = 0,
                 level: float = 0.95, fractions=GATE_FRACTIONS) -> dict[str, dict]:
    """:func:`attribution_statistics` with percentile bootstrap intervals over documents.

    Each resample draws documents with replacement (:func:`truncsens.stats.resample_weights`) and
    repeats their targets; differences (certificate − confidence, certificate − random, ...) are
    taken within a resample (paired).

    Args:
        doc: [n] document id of each target; other arrays as in :func:`attribution_statistics`.

    Returns:
        name -> {"value": float, "ci": [lo, hi]} for every statistic and the differences
        ``diff_auc_attribution``, ``diff_auc_failure`` (certificate − confidence),
        ``diff_removed_random_<f>``, ``diff_removed_confidence_<f>`` (certificate − other).
        Intervals are [NaN, NaN] with fewer than two documents.
    """
    arrays = [np.asarray(a) for a in (cert, conf_kept, conf_ref, fail_kept, fail_ref)]
    docs, index = np.unique(np.asarray(doc, dtype=str), return_inverse=True)
    w = resample_weights(len(docs), n_boot if len(docs) > 1 else 0, seed)  # [1 + n_boot, G]
    rows = []
    for weights in w:
        take = np.repeat(np.arange(index.size), weights[index].astype(int))  # targets of the resample
        s = attribution_statistics(*(a[take] for a in arrays), fractions=fractions)
        s["diff_auc_attribution"] = s["auc_attribution_certificate"] - s["auc_attribution_confidence"]
        s["diff_auc_failure"] = s["auc_failure_certificate"] - s["auc_failure_confidence"]
        for f in fractions:
            for other in ("random", "confidence"):
                s[f"diff_removed_{other}_{f:g}"] = s[f"removed_certificate_{f:g}"] - s[f"removed_{other}_{f:g}"]
        rows.append(s)
    out = {}
    for name in rows[0]:
        samples = np.array([r[name] for r in rows[1:]])
        ci = list(percentile_interval(samples, level)) if samples.size else [math.nan, math.nan]
        out[name] = {"value": rows[0][name], "ci": ci}
    return out


def verdict_above(stat: dict, reference: float = 0.0) -> str:
    """Fixed rule: "holds" when the interval lies above ``reference``; "not shown" when the estimate
    does but the interval does not; "fails" otherwise (NaN: "not measurable")."""
    v, lo = stat["value"], stat["ci"][0]
    if math.isnan(v):
        return "not measurable"
    if v > reference and lo > reference:
        return "holds"
    return f"not shown (interval reaches {reference:g})" if v > reference else "fails"


def removal_curves(cert: np.ndarray, conf_kept: np.ndarray, caused: np.ndarray, fractions) -> dict:
    """Recomputation curves: share of eviction-caused failures removed against the share of targets
    recomputed, for certificate-gated, confidence-gated (lowest first) and random gating
    (:func:`gated_removal_curve`, :func:`random_removal`); the ``removed_*`` statistics of
    :func:`attribution_statistics`.

    Args:
        cert: [n] certificate scores; conf_kept: [n] confidences; caused: [n] bool eviction-caused;
        fractions: [F] shares of targets recomputed, in [0, 1].

    Returns:
        dict name -> [F] float64 ("certificate", "confidence", "random"); NaN without eviction-caused
        failures.

    Raises:
        ValueError: a fraction outside [0, 1].
    """
    caused = np.asarray(caused, bool)
    certificate = gated_removal_curve(cert, caused, fractions)  # checks the fractions first
    f = np.atleast_1d(np.asarray(fractions, float))  # [F]
    return {"certificate": certificate,
            "confidence": gated_removal_curve(-np.asarray(conf_kept, float), caused, f),
            "random": np.array([random_removal(caused.size, x) if caused.any() else math.nan for x in f], dtype=float)}
