"""Where attribution is lost and the realizable attribution scores (truncsens.certificates.attribution_scores,
design_records): hand-computed AUCs, plain-loop recomputations on tiny tensors and a tiny model, the
development / held-out split, and the rule that no realizable score reads a full-cache quantity."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
import xarray as xr
from typer.testing import CliRunner

from truncsens.certificates.attribution_scores import (
    CANDIDATES, REGISTRY, SERVER_SIDE, Candidate, auc_by_documents, candidate_score, choose_candidate,
    decomposition, document_split, stacked_scores,
)
from truncsens.certificates.design_records import design_records, per_head, score_shares
from truncsens.certificates.estimator import attention_records
from truncsens.cli.main import app

FULL_CACHE = {"attn_error", "attn_norm", "kl", "tv", "top1_agree", "nll_ref", "argmax_ref", "confidence_ref",
              "attn_floor_error"}  # read the full cache (or the target token): never a realizable input

ERR = [[0.8, 0.4], [0.1, 0.1], [0.2, 0.2], [0.0, 0.2], [0.5, 0.3], [0.9, 0.9]]  # [n=6, H=2], L = 1
NORM = [[2.0, 2.0]] + [[1.0, 1.0]] * 5
KL = [2.0, 1.0, 0.5, 1.5, 0.1, 0.0]


def hand_dataset() -> xr.Dataset:
    """6 targets in 3 documents, one budget, 1 layer x 2 heads: targets 0, 1 eviction-caused failures,
    2, 3, 4 inherent ones, 5 a success."""
    n, dims5, dims3 = 6, ("policy", "target", "budget", "layer", "head"), ("policy", "target", "budget")
    five = lambda a: (dims5, np.asarray(a, float).reshape(1, n, 1, 1, 2))  # noqa: E731
    three = lambda a: (dims3, np.asarray(a, float).reshape(1, n, 1))  # noqa: E731
    rng = np.random.default_rng(0)
    server = {v: five(rng.random((n, 2)) + 0.1) for v in ("radius_eb", "attn_hat_norm", "kept_share_hat", "evicted_share",
                                                           "evicted_share_expected", "evicted_share_var", "evicted_share_max")}
    return xr.Dataset(
        {**server, "attn_error": five(ERR), "attn_norm": five(NORM), "kl": three(KL), "nll_kept": three(np.zeros(n)),
         "nll_ref": three(np.zeros(n)), "argmax_kept": three([0, 0, 0, 0, 0, 1]), "confidence_kept": three(np.linspace(.1, .6, n)),
         "argmax_ref": ("target", [1, 1, 0, 0, 0, 1]), "confidence_ref": ("target", np.full(n, 0.5)),
         "token_id": ("target", np.ones(n, int)), "doc": ("target", ["d0", "d0", "d1", "d1", "d2", "d2"])},
        coords={"policy": ["poisson"], "budget": [8]})


def mann_whitney(pos, neg) -> float:
    return sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg) / (len(pos) * len(neg))


def test_oracle_aucs_equal_hand_computed_mann_whitney():
    d = decomposition(hand_dataset(), n_boot=20)
    # oracle error per target: mean over heads of err/norm = 0.3, 0.1 (caused) vs 0.2, 0.1, 0.4 (inherent)
    assert d["all_documents"]["oracle_error"]["value"] == pytest.approx(2.5 / 6)
    assert mann_whitney([0.3, 0.1], [0.2, 0.1, 0.4]) == pytest.approx(2.5 / 6)
    # KL: caused {2, 1} vs inherent {0.5, 1.5, 0.1}: 3 + 2 of 6
    assert d["all_documents"]["oracle_kl"]["value"] == pytest.approx(5 / 6)
    # -confidence: caused {-0.1, -0.2} vs inherent {-0.3, -0.4, -0.5}: all 6 pairs
    assert d["all_documents"]["confidence"]["value"] == 1.0


def test_split_is_recorded_and_deterministic():
    s = document_split(np.array(["b", "a", "b", "c", "d", "a"]))
    assert (s["development"], s["held_out"]) == (["b", "c"], ["a", "d"])  # order of first appearance, parity
    assert s["development_mask"].tolist() == [True, False, True, True, False, False]
    d = decomposition(hand_dataset(), n_boot=20)
    assert (d["split"]["development"], d["split"]["held_out"]) == (["d0", "d2"], ["d1"])
    assert "even positions development" in d["split"]["rule"]
    assert d["counts"] == {"development": {"eviction_caused": 2, "inherent": 1}, "held_out": {"eviction_caused": 0, "inherent": 2}}
    again = decomposition(hand_dataset(), n_boot=20)
    assert json.dumps(again, default=str) == json.dumps(d, default=str)


def test_choice_uses_development_aucs_only():
    aucs = {c.name: 0.5 for c in CANDIDATES}
    assert choose_candidate(aucs) == CANDIDATES[0].name  # ties: registry order
    aucs["evicted_z"], aucs["hajek_evicted"] = 0.8, math.nan
    assert choose_candidate(aucs) == "evicted_z"


def test_no_realizable_score_reads_a_full_cache_quantity():
    assert not SERVER_SIDE & FULL_CACHE
    for c in CANDIDATES:
        assert set(c.inputs) <= SERVER_SIDE, c.name

    class Guard(dict):  # a selection that fails on any variable the candidate did not declare
        def __init__(self, allowed):
            super().__init__()
            self.allowed = allowed

        def __getitem__(self, name):
            assert name in self.allowed, name
            return xr.DataArray(np.random.default_rng(1).random((3, 2, 2)) + 0.1)

    for c in CANDIDATES:
        assert candidate_score(c, Guard(set(c.inputs))).shape == (3,)
    with pytest.raises(ValueError, match="attn_norm"):
        candidate_score(Candidate("cheat", ("radius_eb", "attn_norm"), lambda **a: a["radius_eb"], ""), Guard(set()))


def test_design_records_equal_a_plain_loop():
    g = torch.Generator().manual_seed(2)
    T = 9
    raw = torch.rand(2, 3, T, generator=g) * (torch.rand(2, 3, T, generator=g) > 0.3)
    pi = torch.rand(2, 3, T, generator=g).clamp(0.05, 1)
    pi[..., :2] = 1.0  # certain keys
    kept = torch.rand(2, 3, T, generator=g) < pi
    share = score_shares(raw)
    got = design_records(kept, pi, share)
    for b, h in itertools.product(range(2), range(3)):
        total = float(raw[b, h].sum())
        p = [float(raw[b, h, i]) / total for i in range(T)]
        out = [i for i in range(T) if not bool(kept[b, h, i])]
        assert float(got["evicted_share"][b, h]) == pytest.approx(sum(p[i] for i in out))
        assert float(got["evicted_share_expected"][b, h]) == pytest.approx(sum((1 - float(pi[b, h, i])) * p[i] for i in range(T)))
        assert float(got["evicted_share_var"][b, h]) == pytest.approx(
            sum(float(pi[b, h, i]) * (1 - float(pi[b, h, i])) * p[i] ** 2 for i in range(T)))
        assert float(got["evicted_share_max"][b, h]) == pytest.approx(max([p[i] for i in out], default=0.0))
    assert score_shares(torch.zeros(1, 4)).tolist() == [[0.25] * 4]  # no score: uniform
    assert per_head(torch.tensor([[[1.0, 2.0]]]), 3, 4)[0].tolist() == [[1, 1, 2, 2]] * 3  # GQA groups, shared layer


def test_kept_share_equals_a_plain_loop():
    g = torch.Generator().manual_seed(4)
    n = 7
    logits, values = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)
    pi = torch.tensor([1, 1, .5, .3, .8, .2, .6], dtype=torch.float64)
    kept = torch.tensor([1, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    tail = pi < 1
    rec = attention_records(logits, values, torch.ones(n, dtype=torch.bool), kept, pi, tail)
    w = [math.exp(float(x)) for x in logits]
    s = [i for i in range(n) if kept[i]]
    assert float(rec.kept_share) == pytest.approx(sum(w[i] for i in s) / sum(w[i] / float(pi[i]) for i in s))
    o_hat = sum(w[i] / float(pi[i]) * values[i] for i in s) / sum(w[i] / float(pi[i]) for i in s)
    assert float(rec.o_hat_norm) == pytest.approx(float(o_hat.norm()))


def test_design_records_of_a_tiny_model_equal_a_plain_loop(tiny_llama_dir):
    from truncsens.certificates.designs import CertifyDesign
    from truncsens.certificates.passes import certify_batch, design_of
    from truncsens.models import load_model
    from truncsens.policies import make_policy

    model = load_model(tiny_llama_dir).model
    B, T, k = 2, 32, 12
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(5))
    policy, seeds = make_policy("poisson", n_sink=2), [3, 4]
    out = certify_batch(model, ids, [policy], [k], [[seeds]], 0.05, CertifyDesign("token"))  # one shared design
    kept, pi, _ = design_of(policy, T, k, seeds, out.scores)  # [B, T]
    for b in range(B):
        s = [float(x) for x in out.scores[b].double()]
        p = [x / sum(s) for x in s]
        evicted = sum(p[i] for i in range(T) if not bool(kept[b, i]))
        expected = sum((1 - float(pi[b, i])) * p[i] for i in range(T))
        assert evicted > 0
        np.testing.assert_allclose(out.records["evicted_share"][0, 0, b].numpy(), evicted, rtol=1e-6)  # every layer, head
        np.testing.assert_allclose(out.records["evicted_share_expected"][0, 0, b].numpy(), expected, rtol=1e-6)
    hat = out.records["o_hat_norm"][0, 0]  # [B, L, H]
    assert torch.isfinite(hat).all() and (hat > 0).all()


def test_realizable_scores_of_a_tiny_run_equal_a_plain_loop(tmp_path, tiny_llama_dir, corpus_dir):
    from truncsens import results

    out = tmp_path / "a.nc"
    res = CliRunner().invoke(app, [
        "certify-attribution", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
        "--budgets", "25%", "--copy-rule", "token", "--kv-docs", "2", "--max-docs", "3", "--copy-per-doc", "2",
        "--out", str(out), "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert {p.rsplit(".", 1)[-1] for p in summary["files"]} == {"nc", "png", "pdf"}
    ds = results.load(out)
    assert SERVER_SIDE <= set(ds.data_vars)  # every declared server-side input is a real results variable
    got = stacked_scores(ds)  # one budget: [n]
    sel = ds.sel(policy="poisson", budget=int(ds["budget"].values[0]))
    n, L, H = sel["radius_eb"].shape
    for t in range(n):
        rel = [float(sel["radius_eb"][t, layer, h]) / float(sel["attn_hat_norm"][t, layer, h])
               for layer in range(L) for h in range(H)]
        excess = [float(sel["evicted_share"][t, layer, h]) - float(sel["evicted_share_expected"][t, layer, h])
                  for layer in range(L) for h in range(H)]
        kept = [float(sel["kept_share_hat"][t, layer, h]) for layer in range(L) for h in range(H)]
        err = [float(sel["attn_error"][t, layer, h]) / float(sel["attn_norm"][t, layer, h]) for layer in range(L) for h in range(H)]
        assert got["certificate"][t] == pytest.approx(sum(rel) / len(rel))
        assert got["evicted_excess"][t] == pytest.approx(sum(excess) / len(excess))
        assert got["evicted_excess_max"][t] == pytest.approx(max(excess))
        assert got["hajek_evicted"][t] == pytest.approx(1 - sum(kept) / len(kept))
        assert got["oracle_error"][t] == pytest.approx(sum(err) / len(err))
    d = summary["decomposition"]
    assert d["chosen"] in REGISTRY and set(d["development"]) == set(REGISTRY)
    assert sorted(d["split"]["development"] + d["split"]["held_out"]) == sorted(set(ds["doc"].values.astype(str)))
    assert len(d["heads"]["oracle_error"]) == L and len(d["heads"]["certificate"][0]) == H


def test_auc_by_documents_matches_plain_auc_and_checks_lengths():
    rng = np.random.default_rng(3)
    m = 40
    s, caused, among = rng.random(m), rng.random(m) < 0.4, rng.random(m) < 0.7
    doc = np.repeat([f"d{i}" for i in range(8)], 5)
    out = auc_by_documents({"s": s}, caused, among, doc, n_boot=30)
    assert out["s"]["value"] == pytest.approx(mann_whitney(s[among & caused], s[among & ~caused]))
    lo, hi = out["s"]["ci"]
    assert 0 <= lo < hi <= 1
    with pytest.raises(ValueError, match="one value per record"):
        auc_by_documents({"s": s[:-1]}, caused, among, doc)


def kind_dataset() -> xr.Dataset:
    """:func:`hand_dataset` with task kinds: caused 0 (kv), 1 (copy); inherent 2 (kv), 3, 4 (copy); the
    design share E is the task kind alone (1.0 on kv targets, 0.2 on copy), in both heads."""
    ds = hand_dataset()
    kind = np.array(["kv", "copy", "kv", "copy", "copy", "kv"])
    ds["task_kind"] = ("target", kind)
    share = np.where(kind == "kv", 1.0, 0.2)[None, :, None, None, None] * np.ones((1, 6, 1, 1, 2))
    ds["evicted_share"] = (("policy", "target", "budget", "layer", "head"), share)
    return ds


def test_a_score_that_is_the_task_kind_alone_gets_stratified_auc_one_half():
    from truncsens.certificates.attribution_report import format_decomposition

    d = decomposition(kind_dataset(), n_boot=50)
    w = d["within_kind"]
    assert w["kinds"] == ["copy", "kv"]
    assert w["counts"] == {"copy": {"eviction_caused": 1, "inherent": 2}, "kv": {"eviction_caused": 1, "inherent": 1}}
    e = w["all_documents"]["evicted_share"]  # caused {1, 0.2} vs inherent {1, 0.2, 0.2}: 3.5 of 6 pairs pooled
    assert e["pooled"]["value"] == pytest.approx(mann_whitney([1, 0.2], [1, 0.2, 0.2])) == pytest.approx(3.5 / 6)
    assert e["stratified"] == {"value": 0.5, "ci": [0.5, 0.5]}  # only ties within a kind, in every resample
    assert e["by_kind"]["kv"]["value"] == 0.5 and e["by_kind"]["copy"]["value"] == 0.5
    # the baseline: development documents d0, d2 hold failures 0 (kv, caused), 1 (copy, caused), 4 (copy,
    # inherent): kv scored 1, copy 1/2; the same ranking as E
    base = w["all_documents"]["kind_only"]
    assert base["pooled"]["value"] == pytest.approx(3.5 / 6) and base["stratified"]["value"] == 0.5
    # KL: kv 2.0 vs 0.5 (1 of 1), copy 1.0 vs {1.5, 0.1} (1 of 2): stratified 2 / 3; pooled 5 / 6
    kl = w["all_documents"]["oracle_kl"]
    assert kl["stratified"]["value"] == pytest.approx(2 / 3) and kl["pooled"]["value"] == pytest.approx(5 / 6)
    assert (kl["by_kind"]["kv"]["value"], kl["by_kind"]["copy"]["value"]) == (1.0, 0.5)
    lo, hi = kl["stratified"]["ci"]
    assert 0 <= lo <= hi <= 1
    assert d["chosen_by"] == "kind-stratified development AUC"
    assert d["chosen"] == choose_candidate(d["development_stratified"])
    assert set(w["held_out"]) >= {"chosen", "certificate", "oracle_error", "oracle_kl", "confidence", "kind_only"}
    text = "\n".join(format_decomposition(d))
    assert "task kind alone (baseline)" in text and "stratified" in text and "ceiling" not in text
    assert "the true error of that draw" in text
    assert "realizable candidates, kind-stratified development AUC: " in text  # the AUCs the choice was made on
    json.dumps(d, default=str)


def test_stratified_auc_by_hand_and_without_kinds():
    from truncsens.certificates.attribution_strata import stratified_auc

    s, y = np.array([3.0, 1.0, 2.0, 0.0, 5.0, np.nan]), np.array([True, False, True, False, False, True])
    g = np.array(["a", "a", "b", "b", "b", "a"])
    # a: 3 vs 1 (1 pair, won); b: 2 vs {0, 5} (1 of 2): 2 of 3 pairs; the NaN score is left out
    assert stratified_auc(s, y, g) == pytest.approx(2 / 3)
    assert math.isnan(stratified_auc(s[:2], np.array([True, True]), g[:2]))
    with pytest.raises(ValueError, match="strata"):
        stratified_auc(s, y, g[:3])
    assert decomposition(hand_dataset(), n_boot=5)["within_kind"] is None  # a file without task kinds
