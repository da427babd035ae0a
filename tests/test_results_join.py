"""Joining policy runs of the same targets (truncsens.results.join) and compare-policies over several files."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.divergences import METRICS
from truncsens.results import ResultsError
from truncsens.results.join import join_policy_runs, policy_names, with_policy_dim

BUDGETS = [16, 32, 64]


def run(policies, offset=0.0, n=4, positions=None, **over):
    """A policy sweep of n targets from n/2 documents; metric m of policy p, target i, budget j is
    (offset + 10·p + i + j/10 + (index of m)) / 1000 (inside every metric's range)."""
    P = len(policies)
    base = offset + 10 * np.arange(P)[:, None, None] + np.arange(n)[None, :, None] + np.arange(3)[None, None, :] / 10
    metrics = {m: (base + i) / 1000 for i, m in enumerate(METRICS)}
    metrics["top1_agree"] = np.ones(base.shape, np.int64)
    if P == 1:
        metrics = {m: v[0] for m, v in metrics.items()}
    attrs = {
        "truncsens_version": "0.1.0", "model": "tiny", "model_revision": "", "tokenizer": "tiny", "dtype": "float32",
        "device": "cpu", "semantics": "streaming", "positions": "original", "n_sink": 4, "reference_context": 128,
        "corpus": "code", "corpus_sha256": "ab" * 32, "domain": "code", "seed": 0, "policy": ",".join(policies),
        "created": "2026-01-01T00:00:00+00:00", "command": f"truncsens measure --policy {','.join(policies)}", **over,
    }
    positions = positions if positions is not None else list(range(200, 200 + n))
    return results.make_results(metrics, "budget", BUDGETS, [f"d{i // 2}" for i in range(n)], positions,
                                list(range(n)), attrs, policies=None if P == 1 else list(policies))


def test_join_puts_every_run_s_policies_side_by_side_unchanged():
    a, b = run(["sink_recent", "h2o"]), run(["poisson"], offset=100.0, chunk=1)  # chunk 1 = the default of a
    joined = join_policy_runs([a, b], ["a.nc", "b.nc"])
    assert [str(p) for p in joined["policy"].values] == ["sink_recent", "h2o", "poisson"]
    assert joined["kl"].dims == ("policy", "target", "budget")
    np.testing.assert_array_equal(joined["kl"].sel(policy="h2o").values, a["kl"].sel(policy="h2o").values)
    # poisson: offset 100, target 3, budget 64 (j = 2), kl is the metric of index 1 of METRICS
    assert joined["kl"].sel(policy="poisson").values[3, 2] == pytest.approx((100 + 3 + 0.2 + METRICS.index("kl")) / 1000)
    assert joined.attrs["policy"] == "sink_recent,h2o,poisson"
    assert [j["file"] for j in joined.attrs["joined_from"]] == ["a.nc", "b.nc"]
    assert joined.attrs["joined_from"][1]["command"] == "truncsens measure --policy poisson"


def test_runs_whose_policies_keep_different_sinks_join_with_each_policy_s_parameters():
    a = run(["sink_recent"], policy_params='{"sink_recent": {"n_sink": 4}}')
    b = run(["suffix"], n_sink=0, policy_params='{"suffix": {}}')
    joined = join_policy_runs([a, b])
    assert joined.attrs["policy_params"] == '{"sink_recent": {"n_sink": 4}, "suffix": {}}'


def test_a_single_run_comes_back_as_it_is():
    a = run(["random"])
    assert join_policy_runs([a]) is a
    assert policy_names(a) == ["random"] and with_policy_dim(a).sizes["policy"] == 1


@pytest.mark.parametrize("other, says", [
    (lambda: run(["h2o"], positions=list(range(300, 304))), "different targets (coord position"),
    (lambda: run(["h2o"], semantics="prefill_evict"), "semantics is 'prefill_evict'"),
    (lambda: run(["h2o"], granularity="head"), "granularity is 'head' there and 'token' here"),
    (lambda: run(["sink_recent"]), "policy sink_recent appears in more than one run"),
    (lambda: run(["h2o"], reference_context=np.int64(256)), "reference_context is 256 there and 128 here"),
])
def test_runs_of_other_measurements_are_refused(other, says):
    with pytest.raises(ResultsError, match=None) as err:
        join_policy_runs([run(["sink_recent", "random"]), other()], ["a.nc", "b.nc"])
    assert says in str(err.value)


def block(policies, contexts, **over):
    """A block-protocol run of :func:`run`: the block attrs and the actual reference context of each target."""
    attrs = {"protocol": "block", "block_fraction": 0.125, "block_size": 4, "block_length": 4, "block_extra_context": 3,
             **over}
    return run(policies, **attrs).assign_coords(actual_context=("target", np.asarray(contexts, np.int32)))


def test_block_runs_join_only_with_the_same_blocks_and_contexts():
    joined = join_policy_runs([block(["sink_recent"], [128, 129, 130, 131]), block(["h2o"], [128, 129, 130, 131])])
    assert joined["actual_context"].values.tolist() == [128, 129, 130, 131]
    with pytest.raises(ResultsError, match="block_size is 8 there and 4 here"):
        join_policy_runs([block(["sink_recent"], [128, 129, 130, 131]), block(["h2o"], [128, 129, 130, 131], block_size=8)])
    with pytest.raises(ResultsError, match="coord actual_context differs"):  # the same attrs, other contexts
        join_policy_runs([block(["sink_recent"], [128, 129, 130, 131]), block(["h2o"], [131, 132, 133, 134])])
    with pytest.raises(ResultsError, match="protocol is 'block' there and 'exact' here"):
        join_policy_runs([run(["sink_recent"]), block(["h2o"], [128, 129, 130, 131])])


def test_compare_policies_takes_several_runs(tmp_path):
    results.save(run(["sink_recent", "random"]), tmp_path / "a.nc")
    results.save(run(["h2o"], offset=1.0), tmp_path / "b.nc")
    out = CliRunner().invoke(app, ["compare-policies", str(tmp_path / "a.nc"), str(tmp_path / "b.nc"), "--metrics", "kl",
                                   "--bootstrap", "0"])
    assert out.exit_code == 0, out.output
    header = [line for line in out.output.splitlines() if line.strip().startswith("budget")][0]
    assert header.split()[1:] == ["sink_recent", "random", "h2o"]
    bad = CliRunner().invoke(app, ["compare-policies", str(tmp_path / "a.nc"), str(tmp_path / "a.nc")])
    assert bad.exit_code == 2 and "appears in more than one run" in bad.stderr


def test_truncation_mismatch_names_what_differs():
    """compare-policies --truncation notes a window run of another model revision, N or corpus, other
    targets, or an attr only one of the runs has."""
    from truncsens.report.policy_comparison import truncation_mismatch

    def run(n, docs, positions, **attrs):
        return xr.Dataset(coords={"doc": ("target", docs), "position": ("target", positions)},
                          attrs={"model": "reference", "corpus_sha256": "abc", "reference_context": n, **attrs})

    policy = run(1024, ["a", "b"], [1500, 2000], semantics="streaming")
    assert truncation_mismatch(policy, run(1024, ["a", "b"], [1500, 2000], semantics="reencode")) == []
    notes = truncation_mismatch(policy, run(256, ["a", "b"], [1500, 2001], model="other", model_revision="v2"))
    assert notes == ["the truncation run has model other, the policy run reference",
                     "the truncation run has model_revision v2, the policy run None",
                     "the truncation run has reference_context 256, the policy run 1024",
                     "the truncation run measured other targets (other positions, 2 each): its alpha is not paired "
                     "with the policies'"]
    assert truncation_mismatch(policy, run(1024, ["a"], [1500]))[-1].startswith(
        "the truncation run measured other targets (1 against 2)")
