"""Where attribution is lost, and realizable attribution scores of ``truncsens certify-attribution`` [ours].

Everything here is ours, not the paper's (P. Xie, arXiv 2607.21475, states only the certificate's
attribution AUC). Two kinds of score of a target, each [n] per (policy, budget), higher meaning
"more likely eviction-caused" (definitions of failure and AUC: :mod:`truncsens.certificates.attribution`):

- **oracle** scores read what a server does not have, the full-cache attention output or the
  full-cache next-token distribution: ``oracle_error`` = mean over layers and heads of ‖ô − o‖/‖o‖
  (the true error of that very draw, aggregated as the certificate), ``oracle_kl`` = the output
  KL(full ‖ evicted). They say how well the draw's own error attributes, never a score a server can
  compute; they are not an upper limit on what a realizable score can reach.
- **realizable** candidates (:data:`CANDIDATES`) read only :data:`SERVER_SIDE` variables: the kept
  set's certificate records and what the server knew when it drew the design
  (:mod:`truncsens.certificates.design_records`). Each declares its inputs and receives only those.

The registry below was written before any result was looked at. Selection rule, fixed in advance
(:func:`document_split`): documents in order of first appearance in the results file; even
positions (0, 2, ...) are **development**, odd ones **held-out**. The candidate with the largest
attribution AUC (poisson, pooled over budgets) on development documents is chosen (ties: the
first in the registry); it is reported on held-out documents with a percentile bootstrap over
held-out documents (:mod:`truncsens.stats`). In a file with task kinds (``task_kind``) the AUC that
chooses is the kind-stratified one (:mod:`truncsens.certificates.attribution_strata`), so a score
cannot be chosen for telling copy from key–value targets; every AUC is then also reported within
each kind and stratified, beside the "task kind alone" baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from truncsens.certificates.attribution import auc, certificate_score
from truncsens.certificates.attribution_strata import kind_aucs_by_documents, kind_score, stratified_auc
from truncsens.stats import percentile_interval, resample_weights

SERVER_SIDE = frozenset({  # results variables a server that drew the design has (no full-cache quantity)
    "radius_eb", "radius_normal", "attn_variance", "value_range", "n_random", "has_tail", "kept_tokens",
    "attn_hat_norm", "kept_share_hat", "evicted_share", "evicted_share_expected", "evicted_share_var",
    "evicted_share_max", "confidence_kept",
})
ORACLE = {"oracle_error": ("attn_error", "attn_norm"), "oracle_kl": ("kl",)}  # name -> full-cache inputs
AIM = 0.70  # held-out attribution AUC aimed at, at N = 2,048 (the oracle error gets 0.73 there)
SPLIT_RULE = "documents in order of first appearance: even positions development, odd positions held-out"


def _heads(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, float).reshape(len(x), -1)  # [n, L, H] -> [n, L·H]


def _ratio(a: np.ndarray, b: np.ndarray, zero_over_zero: float) -> np.ndarray:
    """a / b elementwise; a/0 = +inf for a > 0 and ``zero_over_zero`` for a = 0."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.where(a > 0, np.inf, zero_over_zero))


def relative_radius(radius_eb: np.ndarray, attn_hat_norm: np.ndarray) -> np.ndarray:
    """[n, L, H] ``r_EB / ‖ô‖`` (+inf with an infinite radius or ‖ô‖ = 0 under a positive radius)."""
    return _ratio(radius_eb, attn_hat_norm, 0.0)


@dataclass(frozen=True)
class Candidate:
    """A realizable attribution score: ``fn(**{input: [n, L, H] array})`` -> [n] float64."""

    name: str
    inputs: tuple[str, ...]
    fn: Callable[..., np.ndarray]
    description: str


def _excess(evicted_share, evicted_share_expected):
    return np.asarray(evicted_share, float) - np.asarray(evicted_share_expected, float)


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("certificate", ("radius_eb", "attn_hat_norm"),
              lambda radius_eb, attn_hat_norm: certificate_score(radius_eb, attn_hat_norm), "mean over heads of r_EB/||o_hat|| (the certificate score)"),
    Candidate("certificate_median", ("radius_eb", "attn_hat_norm"),
              lambda radius_eb, attn_hat_norm: np.median(_heads(relative_radius(radius_eb, attn_hat_norm)), 1),
              "median over heads of r_EB/||o_hat||"),
    Candidate("evicted_share", ("evicted_share",), lambda evicted_share: _heads(evicted_share).mean(1),
              "mean over heads of the design-score share the draw evicted, E"),
    Candidate("evicted_excess", ("evicted_share", "evicted_share_expected"),
              lambda **a: _heads(_excess(**a)).mean(1), "mean over heads of E - E[E]"),
    Candidate("evicted_excess_max", ("evicted_share", "evicted_share_expected"),
              lambda **a: _heads(_excess(**a)).max(1), "largest over heads of E - E[E]"),
    Candidate("evicted_ratio", ("evicted_share", "evicted_share_expected"),
              lambda evicted_share, evicted_share_expected: _heads(_ratio(evicted_share, evicted_share_expected, 1.0)).mean(1),
              "mean over heads of E / E[E]"),
    Candidate("evicted_ratio_pooled", ("evicted_share", "evicted_share_expected"),
              lambda evicted_share, evicted_share_expected: _ratio(_heads(evicted_share).sum(1),
                                                                   _heads(evicted_share_expected).sum(1), 1.0),
              "sum over heads of E / sum of E[E] (heads weighted by the share they were expected to evict)"),
    Candidate("evicted_z", ("evicted_share", "evicted_share_expected", "evicted_share_var"),
              lambda evicted_share_var, **a: _heads(_ratio(_excess(**a), np.sqrt(evicted_share_var), 0.0)).mean(1),
              "mean over heads of (E - E[E]) / sd(E)"),
    Candidate("evicted_max_share", ("evicted_share_max",), lambda evicted_share_max: _heads(evicted_share_max).mean(1),
              "mean over heads of the largest design-score share among evicted keys"),
    Candidate("hajek_evicted", ("kept_share_hat",), lambda kept_share_hat: 1 - _heads(kept_share_hat).mean(1),
              "1 - mean over heads of the Hajek share of the query's attention on kept keys"),
    Candidate("certificate_x_ratio", ("radius_eb", "attn_hat_norm", "evicted_share", "evicted_share_expected"),
              lambda radius_eb, attn_hat_norm, evicted_share, evicted_share_expected: _heads(
                  relative_radius(radius_eb, attn_hat_norm) * _ratio(evicted_share, evicted_share_expected, 1.0)).mean(1),
              "mean over heads of r_EB/||o_hat|| times E / E[E]"),
)
REGISTRY = {c.name: c for c in CANDIDATES}


def candidate_score(candidate: Candidate, sel) -> np.ndarray:
    """[n] score of ``candidate`` on one (policy, budget) selection of a results Dataset, given only
    the variables it declares.

    Raises:
        ValueError: an input outside :data:`SERVER_SIDE`; KeyError: a variable the file lacks.
    """
    outside = [v for v in candidate.inputs if v not in SERVER_SIDE]
    if outside:
        raise ValueError(f"candidate {candidate.name} reads {outside}, which a server does not have")
    return np.asarray(candidate.fn(**{v: sel[v].values for v in candidate.inputs}), float)


def oracle_scores(sel) -> dict[str, np.ndarray]:
    """[n] oracle scores (module docstring) of one (policy, budget) selection."""
    rel = _ratio(sel["attn_error"].values, sel["attn_norm"].values, 0.0)  # [n, L, H] ||o_hat - o|| / ||o||
    return {"oracle_error": _heads(rel).mean(1), "oracle_kl": np.asarray(sel["kl"].values, float)}


def stacked_scores(ds, policy: str = "poisson") -> dict[str, np.ndarray]:
    """name -> [K·n] (budget by budget, as :func:`truncsens.certificates.attribution.target_records`) for
    every candidate and oracle score."""
    parts = []
    for k in ds["budget"].values:
        sel = ds.sel(policy=policy, budget=k)
        parts.append({**{c.name: candidate_score(c, sel) for c in CANDIDATES}, **oracle_scores(sel)})
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def head_aucs(ds, among: np.ndarray, caused: np.ndarray, policy: str = "poisson") -> dict[str, list]:
    """Attribution AUC of each (layer, head), pooled over budgets, of the oracle ‖ô − o‖/‖o‖ and of the
    certificate r_EB/‖ô‖ of that head alone.

    Args:
        among: [K·n] bool the records the AUC runs over (the evicted run's failures);
        caused: [K·n] bool eviction-caused.

    Returns:
        {"oracle_error": [L][H] floats, "certificate": [L][H] floats} (NaN: a class is empty).
    """
    err, cert = [], []
    for k in ds["budget"].values:
        sel = ds.sel(policy=policy, budget=k)
        err.append(_ratio(sel["attn_error"].values, sel["attn_norm"].values, 0.0))
        cert.append(relative_radius(sel["radius_eb"].values, sel["attn_hat_norm"].values))
    out = {}
    for name, parts in (("oracle_error", err), ("certificate", cert)):
        x = np.concatenate(parts)[among]  # [m, L, H]
        out[name] = [[auc(x[:, layer, h], caused[among]) for h in range(x.shape[2])] for layer in range(x.shape[1])]
    return out


def document_split(doc: np.ndarray) -> dict:
    """The development / held-out split of :data:`SPLIT_RULE`.

    Args:
        doc: [m] document id of each record.

    Returns:
        {"rule": str, "development": [ids], "held_out": [ids], "development_mask": [m] bool array}.
    """
    doc = np.asarray(doc, dtype=str)
    _, first = np.unique(doc, return_index=True)
    order = [str(doc[i]) for i in sorted(first)]
    dev, held = order[0::2], order[1::2]
    return {"rule": SPLIT_RULE, "development": dev, "held_out": held, "development_mask": np.isin(doc, dev)}


def auc_by_documents(scores: dict[str, np.ndarray], caused: np.ndarray, among: np.ndarray, doc: np.ndarray,
                     n_boot: int = 200, seed: int = 0, level: float = 0.95) -> dict[str, dict]:
    """Attribution AUC of every score over the records ``among``, with a paired percentile bootstrap
    over the documents of all records (the resamples of
    :func:`truncsens.certificates.attribution.by_documents` at the same seed).

    Args:
        scores: name -> [m] scores; caused: [m] bool eviction-caused; among: [m] bool the records the
            AUC runs over (failures); doc: [m] document ids.

    Returns:
        name -> {"value": float, "ci": [lo, hi]} ([NaN, NaN] with fewer than two documents).

    Raises:
        ValueError: arrays of different lengths.
    """
    docs, index = np.unique(np.asarray(doc, dtype=str), return_inverse=True)
    caused, among = np.asarray(caused, bool), np.asarray(among, bool)
    if any(np.shape(a) != index.shape for a in (caused, among, *scores.values())):
        raise ValueError("every score, caused and among need one value per record of doc")
    w = resample_weights(len(docs), n_boot if len(docs) > 1 else 0, seed)  # [1 + n_boot, G]
    takes = [t[among[t]] for t in (np.repeat(np.arange(index.size), weights[index].astype(int)) for weights in w)]
    out = {}
    for name, s in scores.items():
        s = np.asarray(s, float)
        values = [auc(s[t], caused[t]) for t in takes]
        ci = list(percentile_interval(np.array(values[1:]), level)) if len(values) > 1 else [math.nan, math.nan]
        out[name] = {"value": values[0], "ci": ci}
    return out


def choose_candidate(dev_aucs: dict[str, float]) -> str:
    """The candidate with the largest development AUC (NaN counts as lowest; ties: registry order)."""
    best = max(CANDIDATES, key=lambda c: (-math.inf if math.isnan(dev_aucs[c.name]) else dev_aucs[c.name],
                                          -CANDIDATES.index(c)))
    return best.name


def decomposition(ds, n_boot: int = 200, seed: int = 0, policy: str = "poisson") -> dict:
    """Where attribution is lost and the realizable score chosen on development documents (module
    docstring), poisson, pooled over budgets, among the evicted run's failures.

    Returns:
        {"all_documents": name -> {"value", "ci"} for certificate, oracle_error, oracle_kl, confidence
        (−confidence of the evicted run) and every candidate; "split": rule and document ids;
        "counts": eviction-caused / inherent failures on development and held-out documents;
        "development": candidate -> AUC; "chosen": its name; "held_out": name -> {"value", "ci"} of
        "chosen", certificate, oracle_error, oracle_kl, confidence on held-out documents;
        "held_out_every_candidate": candidate -> AUC (not used for the choice); "aim": :data:`AIM`;
        "heads": :func:`head_aucs`; "candidates": name -> description and inputs; "chosen_by";
        "within_kind": None without ``task_kind``, else {"kinds", "counts" per kind, "kind_only" (what
        the baseline is), "all_documents" and "held_out": name ->
        :func:`~truncsens.certificates.attribution_strata.kind_aucs_by_documents` for every score above
        and "kind_only"}, and "development_stratified": candidate -> stratified development AUC (the choice)}.
    """
    from truncsens.certificates.attribution import target_records

    r = target_records(ds, None, policy)
    s = stacked_scores(ds, policy)
    among, caused, doc = r["fail_kept"], r["fail_kept"] & ~r["fail_ref"], r["doc"]
    fixed = {"certificate": s["certificate"], "oracle_error": s["oracle_error"], "oracle_kl": s["oracle_kl"],
             "confidence": -np.asarray(r["conf_kept"], float)}
    everything = {**fixed, **{c.name: s[c.name] for c in CANDIDATES[1:]}}
    all_docs = auc_by_documents(everything, caused, among, doc, n_boot, seed)
    split = document_split(doc)
    dev = split.pop("development_mask")
    dev_aucs = {c.name: auc(s[c.name][among & dev], caused[among & dev]) for c in CANDIDATES}
    kind = np.tile(np.asarray(ds["task_kind"].values, dtype=str), ds.sizes["budget"]) if "task_kind" in ds else None
    dev_strat = (None if kind is None else
                 {c.name: stratified_auc(s[c.name][among & dev], caused[among & dev], kind[among & dev]) for c in CANDIDATES})
    chosen = choose_candidate(dev_aucs if dev_strat is None else dev_strat)
    held = among & ~dev
    held_out = auc_by_documents({k: v[~dev] for k, v in {"chosen": s[chosen], **fixed}.items()}, caused[~dev],
                                among[~dev], doc[~dev], n_boot, seed)
    counts = {name: {"eviction_caused": int((caused & m).sum()), "inherent": int((among & ~caused & m).sum())}
              for name, m in (("development", dev), ("held_out", ~dev))}
    out = {"all_documents": all_docs, "split": split, "counts": counts, "development": dev_aucs, "chosen": chosen,
           "chosen_by": "pooled development AUC" if dev_strat is None else "kind-stratified development AUC",
           "held_out": held_out, "aim": AIM,
           "held_out_every_candidate": {c.name: auc(s[c.name][held], caused[held]) for c in CANDIDATES},
           "heads": head_aucs(ds, among, caused, policy),
           "candidates": {c.name: {"description": c.description, "inputs": list(c.inputs)} for c in CANDIDATES},
           "within_kind": None}
    if kind is not None:
        base = kind_score(kind, caused, among, dev)
        every = {**everything, "kind_only": base}
        out["development_stratified"] = dev_strat
        out["within_kind"] = {
            "kinds": sorted(set(kind[among])),
            "counts": {k: {"eviction_caused": int((caused & (kind == k)).sum()),
                           "inherent": int((among & ~caused & (kind == k)).sum())} for k in sorted(set(kind[among]))},
            "kind_only": "each failure scored by the share of eviction-caused failures of its task kind on development "
                         "documents: what telling the kinds apart earns",
            "all_documents": kind_aucs_by_documents(every, caused, among, kind, doc, n_boot, seed),
            "held_out": kind_aucs_by_documents({k: v[~dev] for k, v in {"chosen": s[chosen], **fixed, "kind_only": base}.items()},
                                               caused[~dev], among[~dev], kind[~dev], doc[~dev], n_boot, seed)}
    return out
