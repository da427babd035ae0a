"""Draws of randomized policies: common random numbers across budgets (kept sets nested in the
budget), ``--draws R`` (a ``draw`` dim, averaged by every reader), ``--policy-seed`` (the draw, not
the targets), and compare-policies' spread between draws."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.fits.curves import curves_of
from truncsens.divergences import METRICS
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.kernel import measure_draws, policy_seeds
from truncsens.engine.measure import run_measure
from truncsens.engine.semantics import SEMANTICS
from truncsens.engine.streaming_pass import decide_offline
from truncsens.models import load_model
from truncsens.policies import make_policy
from truncsens.policies.poisson import PoissonPolicy
from truncsens.report.policy_comparison import CompareConfig, compare_policies
from truncsens.report.summary import summarize
from truncsens.targets import TargetSet

T = 24
BUDGETS = list(range(5, T + 1))


def tiny_targets(model, n: int = 3) -> TargetSet:
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, model.config.vocab_size, (n, T), generator=g)  # [n, T]
    return TargetSet([f"d{i}" for i in range(n)], np.arange(n) + 100, ctx, torch.randint(0, 50, (n,), generator=g))


def subset(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every true entry of a is true in b."""
    return not bool((a & ~b).any())


# -- the poisson budget split ------------------------------------------------------------------

def test_poisson_slices_never_shrink_and_grow_by_one():
    """R and T never decrease with k and R + T grows by at most 1 per unit of k (the condition of
    nested kept sets), for a grid of sinks and fractions."""
    for s, fr, ft in itertools.product([0, 2, 4], [0.0, 0.1, 0.25, 0.5, 0.7], [0.0, 0.1, 0.25, 0.3]):
        if fr + ft > 1:
            continue
        p = PoissonPolicy(n_sink=s, recent_fraction=fr, top_fraction=ft)
        prev = None
        for k in range(s + 1, 120):
            r, t, m = p.slices(k)
            assert r >= 1 and t >= 0 and m >= 0 and s + r + t + m == k
            if prev is not None:
                assert r >= prev[0] and t >= prev[1] and (r + t) - (prev[0] + prev[1]) <= 1, (s, fr, ft, k)
            prev = (r, t, m)


def test_poisson_slices_by_hand():
    """Multiples of 4 with fractions 1/4: R = T = k/4 as before; k = 7 (2 sinks): R = ⌊7/4⌋ = 1,
    T = max_j ⌊j/2⌋ - max(1, ⌊j/4⌋) = 3 - 1 = 2 (the old split ⌊7/4⌋ = 1 shrank the tail from 3 at
    k = 7 to 2 at k = 8, where R and T both step)."""
    assert PoissonPolicy(n_sink=4).slices(16) == (4, 4, 4)
    assert PoissonPolicy(n_sink=4).slices(64) == (16, 16, 28)
    assert PoissonPolicy(n_sink=2).slices(12) == (3, 3, 4)
    assert PoissonPolicy(n_sink=2).slices(7) == (1, 2, 2)
    assert PoissonPolicy(n_sink=2).slices(8) == (2, 2, 2)


# -- nested kept sets --------------------------------------------------------------------------

@pytest.mark.parametrize("name,kw", [("random", {}), ("random", {"per_query": True}), ("poisson", {"n_sink": 2})])
def test_per_query_kept_sets_nested_in_budget_every_query(name, kw):
    """Policy level, every query of a 40-token context, 3 sequences, every budget k -> k + 1: the
    seeds of :func:`policy_seeds` (no budget in them) make kept(k) a subset of kept(k + 1)."""
    n, L = 3, 40
    targets = TargetSet(["a", "b", "c"], np.array([50, 60, 70]), torch.zeros(n, L, dtype=torch.long), torch.zeros(n))
    seeds = policy_seeds(targets, slice(0, n), 11, name)
    g = torch.Generator().manual_seed(0)
    scores = torch.cumsum(torch.rand(n, L, L, generator=g, dtype=torch.float64) ** 3, 1)  # [n, Q, T] accumulated
    policy = make_policy(name, **kw)
    q = torch.arange(L)
    kept = {k: policy.keep(L, k, q, seeds, scores if policy.needs_scores else None).keep for k in range(3, L + 1)}
    for k in range(3, L):
        assert subset(kept[k], kept[k + 1]), k
    if name == "random":
        assert torch.equal(kept[7].sum(-1), torch.clamp(q + 1, max=7).expand(n, L))  # exactly min(k, q + 1) keys


@pytest.mark.parametrize("semantics,name", [("reencode", "random"), ("prefill_evict", "random"),
                                            ("prefill_evict", "poisson")])
def test_engine_kept_sets_nested_in_budget(tiny_llama_dir, semantics, name):
    """Through the semantics (its queries and, for poisson, the reference pass's attention scores):
    the keys the target's query reads at budget k are a subset of those at k + 1."""
    model = load_model(tiny_llama_dir).model
    targets = tiny_targets(model)
    sem = SEMANTICS[semantics]
    policy = make_policy(name, **({"n_sink": 2} if name == "poisson" else {}))
    ref = sem.reference(model, targets.context, [policy])
    seeds = policy_seeds(targets, slice(0, len(targets)), 5, name)
    last = {k: sem.policy_logprobs(model, targets.context, policy, k, seeds, ref, "original")[1] for k in BUDGETS}
    for k in BUDGETS[:-1]:
        assert subset(last[k], last[k + 1]), k
    if name == "random":
        assert all(int(last[k].sum(-1).min()) == int(last[k].sum(-1).max()) == k for k in BUDGETS)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("per_query_seed", [0, 9])
def test_streaming_random_evictions_nested_in_budget(chunk, per_query_seed):
    """Streaming ``random``: the Evictions of :func:`decide_offline` at budget k evict every key no
    later than at k + 1 (so every query's kept set at k is a subset of the one at k + 1)."""
    targets = TargetSet(["a", "b"], np.array([1, 2]), torch.zeros(2, T, dtype=torch.long), torch.zeros(2))
    seeds = policy_seeds(targets, slice(0, 2), per_query_seed, "random")
    policy = make_policy("random")
    ev = {k: decide_offline(policy, k, T, chunk, seeds, "cpu") for k in range(2, T + 1)}
    for k in range(2, T):
        assert bool((ev[k].evict <= ev[k + 1].evict).all()), k
        assert subset(ev[k].kept().keep, ev[k + 1].kept().keep), k
    assert int(ev[T].evict.min()) == T  # budget T: nothing is ever evicted


@dataclass
class RecordingPoisson(PoissonPolicy):
    """Poisson that records the uniforms each streaming step reads (keyed by budget)."""

    seen: dict = field(default_factory=dict)

    def evict(self, view):
        self.seen.setdefault(view.budget, []).append(view.uniforms.clone())
        return super().evict(view)


def test_streaming_poisson_reads_common_uniforms(tiny_llama_dir):
    """Streaming ``poisson`` (online scores): the evicted run's scores differ between budgets, so its
    kept sets need not be nested in the budget (the π of a key is fixed when it leaves the certain set,
    and the capacity cap keeps drawn keys by score). What holds: every budget reads the same uniform per
    key (common random numbers), and another draw reads other uniforms."""
    model = load_model(tiny_llama_dir).model
    targets = tiny_targets(model, 2)
    policy = RecordingPoisson(n_sink=2)
    measure_draws(model, targets, [policy], [8, 12], SEMANTICS["streaming"], "original", 4, "cpu", 10_000, draws=2)
    # per budget: draw 0's steps then draw 1's; the last step of a draw sees the prompt's T - 1 keys
    for k in (8, 12):
        steps = policy.seen[k]
        assert len(steps) == 2 * (T - 1)
    for r in range(2):
        for i in range(T - 1):
            a, b = policy.seen[8][r * (T - 1) + i], policy.seen[12][r * (T - 1) + i]
            assert a.shape == (2, i + 1) and torch.equal(a, b)
    assert not torch.equal(policy.seen[8][T - 2], policy.seen[8][2 * (T - 1) - 1])  # draw 0 vs draw 1


# -- the run: draws, policy seed, readers ------------------------------------------------------

N = 32


def cfg(model_dir, corpus_dir, out, **kw) -> MeasureConfig:
    return MeasureConfig(**{"model": model_dir, "corpus": corpus_dir, "reference_context": N, "targets_per_doc": 2,
                            "max_docs": 2, "docs_per_shard": 2, "out": str(out), "progress": False,
                            "policies": ["random", "sink_recent"], "budgets": [8, 16], "semantics": "streaming",
                            "n_sink": 2, **kw})


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, corpus_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("draws")
    loaded = load_model(tiny_llama_dir)
    files = {}
    for key, kw in {"one": {}, "two": {"draws": 2}, "other_seed": {"policy_seed": 5}}.items():
        run_measure(cfg(tiny_llama_dir, corpus_dir, root / f"{key}.nc", **kw), loaded)
        files[key] = root / f"{key}.nc"
    return {k: results.load(v) for k, v in files.items()} | {"paths": files}


def test_draw_dim_and_draw_zero_equals_one_draw(runs):
    one, two = runs["one"], runs["two"]
    assert "draw" not in one.dims and one.attrs["draws"] == 1 and one.attrs["policy_seed"] == 0
    assert two["kl"].dims == ("policy", "draw", "target", "budget") and two.sizes["draw"] == 2
    assert two["kept_tokens"].dims == two["evicted_attention_mass"].dims == two["kl"].dims
    assert two["draw"].values.tolist() == [0, 1] and two.attrs["draws"] == 2
    for name in (*METRICS, "kept_tokens", "evicted_attention_mass"):
        np.testing.assert_array_equal(two[name].sel(draw=0).values, one[name].values, err_msg=name)
    # deterministic: identical in every draw; random: draw 1 is another draw
    det = two["kl"].sel(policy="sink_recent").values  # [R, n, K]
    np.testing.assert_array_equal(det[0], det[1])
    rnd = two["kl"].sel(policy="random").values
    assert not np.array_equal(rnd[0], rnd[1])


def test_policy_seed_changes_the_draw_not_the_targets(runs):
    one, other = runs["one"], runs["other_seed"]
    assert other.attrs["policy_seed"] == 5 and other.attrs["seed"] == 0
    for c in ("doc", "position", "token_id"):
        np.testing.assert_array_equal(one[c].values, other[c].values)
    np.testing.assert_array_equal(one["kl"].sel(policy="sink_recent").values, other["kl"].sel(policy="sink_recent").values)
    assert not np.array_equal(one["kl"].sel(policy="random").values, other["kl"].sel(policy="random").values)


def test_readers_average_draws_per_target(runs):
    """curves (fit, compare) and summarize (show) see the per-target mean over draws."""
    two = runs["two"]
    by_hand = two["kl"].values.astype(np.float64).mean(axis=1)  # [P, n, K]
    mean = results.mean_over_draws(two)
    assert "draw" not in mean.dims and mean.attrs["draws_averaged"] == 2
    np.testing.assert_allclose(mean["kl"].values, by_hand, rtol=1e-12)
    curve = {c.policy: c for c in curves_of(two, ["kl"])}["random"]
    np.testing.assert_allclose(curve.mean_se("kl")[0], by_hand[0].mean(0), rtol=1e-9)
    row = next(r for r in summarize(two, ["kl"]) if r["policy"] == "random" and r["budget"] == 8)
    assert row["n"] == two.sizes["target"]
    assert row["mean"] == pytest.approx(by_hand[0, :, 0].mean(), rel=1e-9)


def test_mean_over_draws_keeps_infinity():
    attrs = {a: "x" for a in results.REQUIRED_ATTRS} | {"semantics": "streaming"}
    m = {k: np.zeros((2, 2, 2)) for k in METRICS}  # [draw, target, budget]
    m["kl"] = np.array([[[1.0, 2.0], [np.inf, 4.0]], [[3.0, 6.0], [5.0, 0.0]]])
    ds = results.make_results(m, "budget", [8, 16], ["a", "b"], [1, 2], [3, 4], attrs, draws=2)
    out = results.mean_over_draws(ds)
    np.testing.assert_array_equal(out["kl"].values, [[2.0, 4.0], [np.inf, 2.0]])
    assert results.mean_over_draws(out) is out  # no draw dim: as is


def test_compare_policies_spread_between_draws(runs):
    two = runs["two"]
    cmp = compare_policies(two, CompareConfig(metrics=("kl",), n_boot=0))
    assert cmp.draws == 2
    per_draw = two["kl"].sel(policy="random").values.astype(np.float64).mean(axis=1)  # [R, K]
    rows = {(r["policy"], r["budget"]): r for r in cmp.spread}
    for j, k in enumerate([8, 16]):
        r = rows[("random", k)]
        np.testing.assert_allclose(r["draw_means"], per_draw[:, j], rtol=1e-9)
        assert r["sd"] == pytest.approx(abs(per_draw[0, j] - per_draw[1, j]) / np.sqrt(2), rel=1e-9)
        assert (r["min"], r["max"]) == (pytest.approx(per_draw[:, j].min()), pytest.approx(per_draw[:, j].max()))
        assert rows[("sink_recent", k)]["sd"] == 0.0
        table = next(t for t in cmp.table if t["policy"] == "random" and t["budget"] == k)
        assert table["mean"] == pytest.approx(per_draw[:, j].mean(), rel=1e-6)  # mean of draws = mean of per-target means


def test_compare_policies_cli_shows_spread(runs):
    res = CliRunner().invoke(app, ["compare-policies", str(runs["paths"]["two"]), "--bootstrap", "0", "--metrics", "kl"])
    assert res.exit_code == 0, res.output
    assert "kl: spread between 2 draws of the mean over targets (sd [min, max])" in res.output
    assert "mean over 2 draws" in res.output
    one = CliRunner().invoke(app, ["compare-policies", str(runs["paths"]["one"]), "--bootstrap", "0", "--metrics", "kl"])
    assert one.exit_code == 0 and "spread between" not in one.output
    js = CliRunner().invoke(app, ["compare-policies", str(runs["paths"]["two"]), "--bootstrap", "0", "--json"])
    data = json.loads(js.stdout)
    assert data["draws"] == 2 and len(data["spread"]) == 2 * 2 * 2  # policies x metrics x budgets


# -- configuration and the command line --------------------------------------------------------

def test_fingerprint_unchanged_for_one_draw_and_default_policy_seed():
    base = MeasureConfig(policies=["random"], budgets=[16])
    assert "draws" not in base.fingerprint() and "policy_seed" not in base.fingerprint()
    assert "policy_seed" not in MeasureConfig(policies=["random"], policy_seed=0).fingerprint()  # = --seed
    assert MeasureConfig(policies=["random"], draws=3).fingerprint()["draws"] == 3
    assert MeasureConfig(policies=["random"], policy_seed=7).fingerprint()["policy_seed"] == 7
    assert MeasureConfig(policies=["random"], policy_seed=7).draw_seed == 7
    assert MeasureConfig(policies=["random"], seed=3).draw_seed == 3


@pytest.mark.parametrize("kw,message", [
    ({"policies": ["random"], "draws": 0}, r"draws \(--draws\) must be at least 1, got 0"),
    ({"policies": ["random"], "draws": -2}, r"draws \(--draws\) must be at least 1, got -2"),
    ({"policies": ["sink_recent"], "draws": 2}, "sink_recent decides deterministically"),
    ({"draws": 2}, "a window sweep is deterministic"),
])
def test_bad_draws_refused(kw, message):
    with pytest.raises(MeasureError, match=message):
        MeasureConfig(**kw)


def test_cli_draws_zero(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    res = CliRunner().invoke(app, ["measure", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--policy", "random",
                                   "--budgets", "8", "--reference-context", "32", "--draws", "0", "--out", str(out),
                                   "--no-progress"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == "error: draws (--draws) must be at least 1, got 0"
    assert not out.exists() and not list(tmp_path.iterdir())
