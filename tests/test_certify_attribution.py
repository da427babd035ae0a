"""Attribution of failures and gated recomputation (truncsens.certificates.tasks / attribution /
trajectory): hand-made token sequences, hand-computed AUCs and removals, and a greedy trajectory of
the reference model checked against the certify passes run on their own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import requires_reference
from scipy.stats import mannwhitneyu
from typer.testing import CliRunner

from truncsens.cli.main import app

from truncsens.certificates.attribution import (
    FAILURE_NLL, attribution_statistics, auc, by_documents, certificate_score, failures, gated_removal_curve,
    random_removal, removal_curves, verdict_above,
)
from truncsens.certificates.tasks import COPY_RULES, TaskError, copy_positions, copy_rule, copy_vocabulary, kv_document

TOKEN, SPAN = COPY_RULES["token"], COPY_RULES["span"]

# index:       0  1  2  3  4  5  6  7  8  9 10 11 12
HAND_IDS = [9, 7, 1, 2, 3, 4, 5, 2, 7, 1, 2, 0, 2]
ALL_BUT_0 = np.array([False] + [True] * 9)  # token 0 is not an identifier


def test_copy_positions_token_rule_exact():
    # N = 8, D = 3: t=8 (7 last at 1, distance 7), t=9 (1 at 2, distance 7), t=10 (2 at 7, distance 3);
    # t=11 is token 0 (not eligible); t=12 is token 2 again at distance 2 < D.
    assert copy_positions(HAND_IDS, ALL_BUT_0, 8, 3, TOKEN)[0].tolist() == [8, 9, 10]
    assert copy_positions(HAND_IDS, ALL_BUT_0, 8, 4, TOKEN)[0].tolist() == [8, 9]  # t=10 is 3 < 4 back
    # N = 6: t=7 (2 last at 3, distance 4) now counts; t=8 and t=9 are 7 back, beyond N
    assert copy_positions(HAND_IDS, ALL_BUT_0, 6, 3, TOKEN)[0].tolist() == [7, 10]
    assert copy_positions(HAND_IDS, ALL_BUT_0, 8, 8, TOKEN)[0].tolist() == []


def test_copy_positions_induction_rule_exact():
    # only t=9 has the same preceding token as its source: ids[8] = ids[1] = 7
    assert copy_positions(HAND_IDS, ALL_BUT_0, 8, 3)[0].tolist() == [9]
    assert copy_positions(HAND_IDS, ALL_BUT_0, 8, 3, TOKEN)[1].tolist() == [1, 2, 7]  # sources of 8, 9, 10


def test_copy_positions_source_at_zero_has_no_predecessor():
    ids = [5, 1, 1, 1, 5]  # 5 at 0 and 4; ids[-1] must not be read as the token before position 0
    assert copy_positions(ids, np.ones(6, bool), 4, 2, TOKEN)[0].tolist() == [4]
    assert copy_positions(ids, np.ones(6, bool), 4, 2)[0].tolist() == []


def test_copy_positions_span_rule_exact():
    # 0..4 = 1 2 3 4 5, filler, then 1 2 3 4 5 again: at t = 12 the four tokens before 5 repeat those
    # before its source s = 4, and 1 2 3 4 occurred nowhere in between
    ids = [1, 2, 3, 4, 5, 8, 8, 8, 1, 2, 3, 4, 5]
    assert copy_positions(ids, np.ones(9, bool), 8, 3, SPAN)[0].tolist() == [12]
    assert copy_positions(ids, np.ones(9, bool), 8, 3, SPAN)[1].tolist() == [4]
    # 2, 3, 4 at t = 9..11 have their preceding token repeated (induction) but fewer than 4 tokens
    # before their sources 1..3; 1 at t = 8 has none before its source 0
    assert copy_positions(ids, np.ones(9, bool), 8, 3)[0].tolist() == [9, 10, 11, 12]
    assert copy_positions(ids, np.ones(9, bool), 8, 3, TOKEN)[0].tolist() == [8, 9, 10, 11, 12]


def test_copy_positions_span_rule_refuses_a_nearer_copy_of_the_context():
    # 1 2 3 4 recurs at 5..8 followed by 6: the target 5 at t = 15 (source 4) is an induction target,
    # but the nearest earlier 1 2 3 4 continues with 6, so a four-token induction head would copy 6
    ids = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 8, 1, 2, 3, 4, 5]
    assert copy_positions(ids, np.ones(9, bool), 15, 5)[0].tolist() == [15]
    assert copy_positions(ids, np.ones(9, bool), 15, 5, SPAN)[0].tolist() == []
    # one differing token three back is enough to refuse it too: only 3 of the 4 tokens repeat
    ids = [1, 2, 3, 4, 5, 8, 8, 8, 7, 2, 3, 4, 5]
    assert copy_positions(ids, np.ones(9, bool), 8, 3)[0].tolist() == [10, 11, 12]
    assert copy_positions(ids, np.ones(9, bool), 8, 3, SPAN)[0].tolist() == []


def test_copy_rule_registry_and_error():
    assert (copy_rule("span").match, copy_rule("span").nearest) == (4, True)
    assert [(r.name, r.match) for r in COPY_RULES.values()] == [("induction", 1), ("span", 4), ("token", 0)]
    with pytest.raises(TaskError, match=r"copy_rule \(--copy-rule\) must be one of induction, span, token, got 'bigram'"):
        copy_rule("bigram")


@pytest.mark.parametrize("distance", [0, 9])
def test_copy_positions_refuses_distance_outside_context(distance):
    with pytest.raises(TaskError, match="min-distance"):
        copy_positions(HAND_IDS, ALL_BUT_0, 8, distance)


def test_copy_vocabulary():
    tokens = ["Ġfoo", "if", "12", "(", "a", "Ġ_x1", "▁bar", "Ġ", "ĠNone"]
    assert copy_vocabulary(tokens).tolist() == [True, False, True, False, False, True, True, False, False]


@requires_reference
def test_kv_documents_hold_the_key_earlier_and_the_value_at_the_target():
    from truncsens.models import load_model

    tok = load_model("reference").tokenizer
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    N, D = 128, 32
    ids, source = kv_document(encode, N, D, seed=3)
    assert len(ids) == N + 1 and ids[source] == ids[N] and N - source >= D
    text_before_source = tok.decode(ids[:source])
    query = tok.decode(ids[:N])
    key = query.rsplit("assert ", 1)[1].split(" ==")[0]
    assert query.endswith(f'assert {key} == "') and text_before_source.endswith(f'{key} = "')
    assert kv_document(encode, N, D, seed=3) == (ids, source)  # deterministic
    assert kv_document(encode, N, D, seed=4)[0] != ids


def test_failures_top1_or_nll():
    argmax = np.array([3, 3, 4, 3])
    nll = np.array([0.1, FAILURE_NLL + 1e-6, 0.1, FAILURE_NLL])
    assert failures(argmax, np.array([3, 3, 3, 3]), nll).tolist() == [False, True, True, False]


def test_certificate_score_mean_relative_radius():
    radius = np.array([[[1.0, 2.0]], [[np.inf, 1.0]]])  # [n=2, L=1, H=2]
    norm = np.array([[[2.0, 4.0]], [[1.0, 1.0]]])
    assert certificate_score(radius, norm).tolist() == [0.5, math.inf]


def test_auc_hand_examples_with_ties():
    # positives {0.9, 0.5}, negatives {0.5, 0.1}: 1 + 1 + 1/2 + 1 out of 4 pairs
    assert auc(np.array([0.9, 0.5, 0.5, 0.1]), np.array([1, 1, 0, 0], bool)) == 0.875
    # +inf ranks above everything and ties with +inf: 1 (vs 1) + 1/2 (vs inf) + 1 (vs 0) out of 3
    assert auc(np.array([np.inf, 1.0, np.inf, 0.0]), np.array([1, 0, 0, 0], bool)) == pytest.approx(2.5 / 3)
    assert auc(np.array([np.nan, 2.0, 1.0]), np.array([1, 1, 0], bool)) == 1.0  # NaN left out
    assert math.isnan(auc(np.array([1.0, 2.0]), np.array([1, 1], bool)))
    rng = np.random.default_rng(0)
    s, y = rng.integers(0, 5, 40).astype(float), rng.random(40) < 0.4
    assert auc(s, y) == pytest.approx(mannwhitneyu(s[y], s[~y]).statistic / (y.sum() * (~y).sum()))


def test_gated_removal_hand_example():
    scores = np.array([5.0, 4.0, 4.0, 3.0, 1.0])
    caused = np.array([0, 1, 0, 1, 1], bool)
    # 40 %: 2 targets: the 5 (not caused), then one of the two tied 4s (one of them caused): 1/2 of 1 of 3
    assert gated_removal_curve(scores, caused, [0.4])[0] == pytest.approx(1 / 6)
    assert gated_removal_curve(scores, caused, [0.2])[0] == 0.0
    assert gated_removal_curve(scores, caused, [0.6])[0] == pytest.approx(1 / 3)  # both 4s
    assert gated_removal_curve(scores, caused, [1.0])[0] == 1.0
    assert math.isnan(gated_removal_curve(scores, np.zeros(5, bool), [0.4])[0])
    assert random_removal(5, 0.4) == 0.4 and random_removal(5, 0.3) == 0.4  # ceil(1.5) = 2 of 5
    curves = removal_curves(scores, -scores, caused, np.array([0.0, 0.4, 1.0]))
    assert curves["certificate"].tolist() == pytest.approx([0, 1 / 6, 1])
    # confidence = -scores: lowest confidence first is the same order as the highest score
    assert curves["confidence"].tolist() == pytest.approx([0, 1 / 6, 1])
    assert curves["random"].tolist() == pytest.approx([0, 0.4, 1])


def test_attribution_statistics_hand_example():
    fail_kept = np.array([1, 1, 1, 0, 1], bool)
    fail_ref = np.array([0, 0, 1, 0, 1], bool)  # eviction-caused: 0, 1; inherent: 2, 4
    cert = np.array([3.0, 1.0, 2.0, 0.0, 0.5])
    conf = np.array([0.2, 0.9, 0.1, 0.8, 0.3])
    s = attribution_statistics(cert, conf, conf, fail_kept, fail_ref, fractions=(0.2,))
    assert (s["n_eviction_caused"], s["n_inherent"], s["n_fixed"]) == (2, 2, 0)
    # certificate among failures: caused {3, 1} vs inherent {2, 0.5}: 1 + 1 + 0 + 1 of 4
    assert s["auc_attribution_certificate"] == 0.75
    # -confidence: caused {-0.2, -0.9} vs inherent {-0.1, -0.3}: 0 + 1 + 0 + 0 of 4
    assert s["auc_attribution_confidence"] == 0.25
    # 20 %: one target: the highest certificate is target 0 (caused): 1 of 2; lowest confidence is 2 (inherent)
    assert s["removed_certificate_0.2"] == 0.5 and s["removed_confidence_0.2"] == 0.0 and s["removed_random_0.2"] == 0.2


def test_by_documents_intervals():
    rng = np.random.default_rng(1)
    n = 30
    doc = np.repeat([f"d{i}" for i in range(10)], 3)
    cert, conf = rng.random(n), rng.random(n)
    fail_ref = rng.random(n) < 0.3
    fail_kept = fail_ref | (rng.random(n) < 0.4)
    out = by_documents(cert, conf, conf, fail_kept, fail_ref, doc, n_boot=50, seed=0, fractions=(0.1,))
    direct = attribution_statistics(cert, conf, conf, fail_kept, fail_ref, fractions=(0.1,))
    for name, value in direct.items():  # the point values are those of the whole sample
        assert out[name]["value"] == pytest.approx(value, nan_ok=True)
    lo, hi = out["auc_attribution_certificate"]["ci"]
    assert 0 <= lo < hi <= 1  # 10 documents resampled: a real interval, not a point
    diff = out["diff_removed_random_0.1"]["value"]
    assert diff == pytest.approx(direct["removed_certificate_0.1"] - direct["removed_random_0.1"])
    one = by_documents(cert, conf, conf, fail_kept, fail_ref, np.full(n, "d0"), n_boot=50, fractions=(0.1,))
    assert all(math.isnan(v) for v in one["auc_failure_certificate"]["ci"])


def test_verdict_rule():
    assert verdict_above({"value": 0.7, "ci": [0.55, 0.8]}, 0.5) == "holds"
    assert verdict_above({"value": 0.7, "ci": [0.45, 0.8]}, 0.5).startswith("not shown")
    assert verdict_above({"value": 0.4, "ci": [0.3, 0.6]}, 0.5) == "fails"
    assert verdict_above({"value": math.nan, "ci": [math.nan, math.nan]}) == "not measurable"


@requires_reference
def test_trajectory_eprocess_on_the_reference_model():
    from truncsens.certificates.eprocess import step_levels
    from truncsens.certificates.estimator import eb_sum_radius
    from truncsens.certificates.passes import certify_batch
    from truncsens.certificates.trajectory import greedy_trajectory, trajectory_summary
    from truncsens.models import load_model
    from truncsens.policies import PoissonPolicy
    from truncsens.targets import doc_seed

    model = load_model("reference").model
    prefix = torch.randint(5, 4000, (32,), generator=torch.Generator().manual_seed(0))
    policy, delta = PoissonPolicy(n_sink=4), 0.05
    traj = greedy_trajectory(model, prefix, policy, 16, 2, delta, seed=7)
    # step 1 run on its own: same next token, same errors, radius at delta_1 = delta / 2
    first = certify_batch(model, prefix.unsqueeze(0), [policy], [16], [[[doc_seed(7, "trajectory:1")]]], delta)
    assert int(traj.tokens[0]) == int(first.logprobs[0, 0, 0].argmax())
    rec = {k: v[0, 0, 0] for k, v in first.records.items()}  # [L, H]
    assert np.allclose(traj.error[0], rec["error"].numpy())
    r1 = eb_sum_radius(rec["variance"], rec["value_range"], rec["n_random"], rec["has_tail"] > 0, delta / 2)
    assert np.allclose(traj.radius_step[0], r1.numpy()) and step_levels(2, delta)[0] == delta / 2
    r_naive = eb_sum_radius(rec["variance"], rec["value_range"], rec["n_random"], rec["has_tail"] > 0, delta)
    assert np.allclose(traj.radius_naive[0], r_naive.numpy())
    # step 2 continues the evicted run's greedy token
    second = certify_batch(model, torch.cat([prefix, traj.tokens[:1]]).unsqueeze(0), [policy], [16],
                           [[[doc_seed(7, "trajectory:2")]]], delta)
    assert np.allclose(traj.error[1], second.records["error"][0, 0, 0].numpy())
    # a miss adds w_t / delta_t = 1 / delta: E_n = (number of misses) / delta per stream
    e = traj.e_values()  # [L, H, n]
    assert np.allclose(e[..., -1], traj.misses.sum(0) / delta)
    s = trajectory_summary(traj)
    assert s["violated_streams"] == int(traj.misses.any(0).sum())
    assert s["naive_violated_streams"] == int(traj.naive_misses.any(0).sum()) >= s["violated_streams"]


def test_cli_bad_input_one_error_line(tmp_path):

    out = tmp_path / "a.nc"
    for args, message in ((["--delta", "1.5"], "--delta"), (["--copy-rule", "bigram"], "--copy-rule"),
                          (["--copy-per-doc", "0", "--kv-docs", "0"], "no attribution targets"),
                          (["--budgets", "150%"], "percentage"),
                          (["--trajectory-budget", "25%,50%"], "takes one budget")):
        result = CliRunner().invoke(app, ["certify-attribution", "--out", str(out), *args])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and message in lines[0]
        assert not out.exists()


def test_small_run_on_a_tiny_llama(tmp_path, tiny_llama_dir, corpus_dir):
    import json

    from truncsens import results

    out = tmp_path / "a.nc"
    res = CliRunner().invoke(app, [
        "certify-attribution", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
        "--budgets", "25%,32", "--copy-rule", "token", "--kv-docs", "0", "--max-docs", "3", "--copy-per-doc", "2",
        "--trajectory", "2", "--trajectory-budget", "16", "--out", str(out), "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    ds = results.load(out)
    assert dict(ds.sizes) == {"policy": 3, "target": 6, "budget": 2, "layer": 2, "head": 4, "step": 2}
    assert set(ds["task_kind"].values.tolist()) == {"copy"} and int(ds.attrs["min_distance"]) == 16
    distance = ds["position"].values - ds["source_position"].values
    assert ((16 <= distance) & (distance <= 64)).all()
    # the stored top-1 ids agree with the stored metrics
    agree = ds["argmax_kept"].values == ds["argmax_ref"].values[None, :, None]
    np.testing.assert_array_equal(agree, ds["top1_agree"].values.astype(bool))
    right = ds["argmax_ref"].values == ds["token_id"].values
    nll_ref = ds["nll_ref"].sel(policy="poisson", budget=16).values
    np.testing.assert_allclose(ds["confidence_ref"].values[right], np.exp(-nll_ref[right]), rtol=1e-5)
    # failure counts follow from the file
    sel = ds.sel(policy="topk", budget=32)
    fail = (sel["argmax_kept"].values != ds["token_id"].values) | (sel["nll_kept"].values > FAILURE_NLL)
    fail_ref = ~right | (nll_ref > FAILURE_NLL)
    counts = summary["budgets"][1]["counts"]["topk"]
    assert (counts["failures"], counts["eviction_caused"], counts["inherent"]) == (
        int(fail.sum()), int((fail & ~fail_ref).sum()), int((fail & fail_ref).sum()))
    traj = summary["trajectory"]
    assert traj["n_steps"] == 2 and traj["streams"] == 8 and traj["prefix_tokens"] == 62 and traj["budget"] == 16
    assert all((tmp_path / p.split("/")[-1]).is_file() for p in summary["files"])


def test_pooled_statistics_within_each_kind(tmp_path, tiny_llama_dir, corpus_dir):
    """pooled_by_kind equals the pooled statistics recomputed on one kind's records alone. The tiny
    model fails everywhere, so the failures are set by hand (seeded) on its real certificates."""
    from truncsens import results
    from truncsens.certificates.attribution import target_records
    from truncsens.certificates.attribution_report import format_attribution, summarize_attribution

    out = tmp_path / "k.nc"
    res = CliRunner().invoke(app, [
        "certify-attribution", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
        "--budgets", "25%,50%", "--copy-rule", "token", "--kv-docs", "4", "--max-docs", "3", "--copy-per-doc", "2",
        "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    ds = results.load(out)
    n, token = ds.sizes["target"], ds["token_id"].values
    rng = np.random.default_rng(5)
    right_ref = np.arange(n) % 2 == 0  # the full cache is right on every other target
    ds["argmax_ref"] = ("target", np.where(right_ref, token, token + 1))
    ds["nll_ref"] = ds["nll_ref"] * 0.0
    kept_right = rng.random(ds["argmax_kept"].shape) < 0.5  # [policy, target, budget]
    ds["argmax_kept"] = (ds["argmax_kept"].dims, np.where(kept_right, token[None, :, None], token[None, :, None] + 1))
    ds["nll_kept"] = ds["nll_kept"] * 0.0
    summary = summarize_attribution(ds)
    kind = np.tile(ds["task_kind"].values.astype(str), 2)  # [2·n], budget by budget
    r = target_records(ds)  # every budget stacked, poisson
    assert set(summary["pooled_by_kind"]) == {"copy", "kv"}
    finite = 0
    for k, got in summary["pooled_by_kind"].items():
        m = kind == k
        fk, fr = r["fail_kept"][m], r["fail_ref"][m]
        assert got["eviction_caused"] == int((fk & ~fr).sum())
        expected = auc(r["cert"][m][fk], (fk & ~fr)[fk])  # over the evicted run's failures
        value = got["poisson"]["auc_attribution_certificate"]["value"]
        assert value == pytest.approx(expected, nan_ok=True)
        finite += math.isfinite(value)
    assert finite >= 1  # at least one kind has both eviction-caused and inherent failures
    total = sum(t["eviction_caused"] for t in summary["pooled_by_kind"].values())
    assert total == sum(b["counts"]["poisson"]["eviction_caused"] for b in summary["budgets"])
    assert "pooled, copy only" in format_attribution(summary) and "pooled, kv only" in format_attribution(summary)


def test_the_trajectory_budget_is_checked_only_with_a_trajectory(tiny_llama_dir, corpus_dir, tmp_path):
    """Without --trajectory, a --trajectory-budget that would not fit (25% of 64 = 16 <= 16 sinks) is not
    an error; with one, the error names --trajectory-budget."""
    base = ["certify-attribution", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "64",
            "--budgets", "50%", "--sinks", "16", "--max-docs", "1", "--copy-per-doc", "1", "--kv-docs", "1",
            "--no-progress"]
    with_trajectory = CliRunner().invoke(app, [*base, "--trajectory", "2", "--out", str(tmp_path / "t.nc")])
    assert with_trajectory.exit_code == 2 and "trajectory_budget (--trajectory-budget): 25% of N = 16 tokens leaves no room after the 16 sinks" \
        in with_trajectory.stderr, with_trajectory.output
    without = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "n.nc")])
    assert without.exit_code == 0 and (tmp_path / "n.nc").is_file(), without.output


def test_a_streaming_run_with_a_streamed_trajectory(tmp_path, tiny_llama_dir, corpus_dir):
    """Under streaming the comparison is sink_recent, the attrs name the process, and the trajectory
    is the streamed one (its prefix and steps as asked)."""
    import json

    from truncsens import results

    out = tmp_path / "s.nc"
    res = CliRunner().invoke(app, [
        "certify-attribution", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "48",
        "--budgets", "16", "--copy-rule", "token", "--kv-docs", "0", "--max-docs", "2", "--copy-per-doc", "1",
        "--semantics", "streaming", "--trajectory", "2", "--trajectory-budget", "16", "--out", str(out),
        "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    ds = results.load(out)
    assert list(ds["policy"].values) == ["poisson", "sink_recent"] and ds.attrs["semantics"] == "streaming"
    assert ds.attrs["certified_process"].startswith("streaming: ")
    assert np.isnan(ds["radius_eb"].sel(policy="sink_recent")).all()
    traj = summary["trajectory"]
    assert traj["n_steps"] == 2 and traj["prefix_tokens"] == 46 and traj["budget"] == 16
    # answerable: the targets the full cache gets right, from the file
    nll_ref = ds["nll_ref"].sel(policy="poisson", budget=16).values
    fail_ref = (ds["argmax_ref"].values != ds["token_id"].values) | (nll_ref > FAILURE_NLL)
    assert summary["answerable"] == int((~fail_ref).sum())
