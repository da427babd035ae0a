"""The block protocol of policy sweeps under streaming and prefill_evict
(truncsens.engine.block.policies): every block value equals a single-target run of the same semantics
over the target's actual context x[r : t], a block of 1 equals the exact protocol, a wrong decode rule
differs, refusals, and a CLI run with resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hybrid_qwen2
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.divergences import METRICS, all_metrics
from truncsens.engine.block.plan import block_length, policy_forward_tokens
from truncsens.engine.block.plan import check_block_budgets, check_policy_blocks
from truncsens.engine.block.policies import measure_policy_blocks
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.granularity import evicted_mass
from truncsens.engine.kernel import measure_draws, policy_seeds
from truncsens.engine.reference_pass import reference_pass
from truncsens.engine.semantics import SEMANTICS, decode_kept, semantics_for
from truncsens.engine.streaming_pass import decide_offline
from truncsens.models import load_model
from truncsens.policies import POLICIES, make_policy
from truncsens.targets import TokenDoc, select_block_targets

BLOCK_SEMANTICS = [n for n, s in SEMANTICS.items() if s.policy_blocks]  # those whose policy sweeps run in blocks



def runnable(semantics: str) -> list[str]:
    """The registered policies the semantics runs in blocks (every one but snapkv and snapkv_shared under
    streaming, snapkv, whose kept sets are per layer and head, and the merging caches (refused by
    name: tests/test_merge_policies.py) anywhere), in registry order."""
    return [n for n in POLICIES if make_policy(n, n_sink=2).requirements() <= SEMANTICS[semantics].provides
            and not POLICIES[n].layer_heads and not POLICIES[n].merges]


STREAMING = runnable("streaming")
PREFILL_EVICT = runnable("prefill_evict")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(tiny_llama_dir).model


def _docs(seed: int, length: int = 40, n: int = 1) -> list[TokenDoc]:
    g = torch.Generator().manual_seed(seed)
    return [TokenDoc(f"d{i}", torch.randint(0, 250, (length,), generator=g)) for i in range(n)]


@torch.no_grad()
def single_target(model, semantics, policy, doc: torch.Tensor, t: int, c: int, k: int, seed_value: int) -> dict:
    """The single-target run of ``semantics`` over x[t - c : t] (c tokens): metrics, kept keys, evicted mass."""
    ids = doc[t - c : t][None]  # [1, c]
    ref = semantics.reference(model, ids, [policy])
    lp, keep_last = semantics.policy_logprobs(model, ids, policy, k, [seed_value], ref, "original", 1)
    values, _ = all_metrics(ref.logprobs, lp, doc[t : t + 1])
    return {**{m: float(v[0]) for m, v in values.items()}, "kept_tokens": int(keep_last.sum()),
            "evicted_attention_mass": float(evicted_mass(ref.last_attention, keep_last)[0])}


def check_block_equals_single_targets(model, semantics_name, names, budgets, N=24, fraction=0.25, size=4, room=0,
                                      draws=1, n_sink=2, tpd=5, n_docs=1):
    semantics = semantics_for(semantics_name)
    policies = [make_policy(n, n_sink=n_sink) for n in names]
    docs = _docs(len(names) + room, n=n_docs)
    B = block_length(N, fraction, size)
    targets = select_block_targets(docs, N, tpd, 0, B)
    assert len(set(targets.block.tolist())) < len(targets)  # several targets per block
    out = measure_policy_blocks(model, targets, policies, budgets, semantics, 7, "cpu", 4096, draws=draws, room=room)
    k_out = out.kernel
    by_id = {d.id: d.ids for d in docs}
    for i in range(len(targets)):
        doc, t, c = by_id[targets.doc[i]], int(targets.position[i]), int(out.actual_context[i])
        same = (targets.block == targets.block[i]) & (np.asarray(targets.doc) == targets.doc[i])
        first = int(np.flatnonzero(same)[0])  # the block's first target
        for p, policy in enumerate(policies):
            for r in range(draws if policy.randomized else 1):
                owner = first if semantics_name == "streaming" else i
                s = policy_seeds(targets, [owner], 7, policy.name, draw=r)[0]
                for jk, k in enumerate(budgets):
                    want = single_target(model, semantics, policy, doc, t, c, k, s)
                    for m in METRICS:
                        assert abs(float(k_out.metrics[m][p, r, i, jk]) - want[m]) <= 1e-5, (policy.name, i, k, m)
                    assert int(k_out.kept_tokens[p, r, i, jk]) == want["kept_tokens"], (policy.name, i, k)
                    lost = float(k_out.evicted_attention_mass[p, r, i, jk])
                    assert abs(lost - want["evicted_attention_mass"]) <= 1e-5, (policy.name, i, k)
    return out


@pytest.mark.parametrize("names", [STREAMING[0:2], STREAMING[2:4], STREAMING[4:6], STREAMING[6:]])
def test_streaming_block_equals_single_target_streams(llama, names):
    budgets = [6, 12] if names == STREAMING[0:2] else [6]
    out = check_block_equals_single_targets(llama, "streaming", names, budgets, draws=2)
    assert out.actual_context.tolist() == [21, 22, 23, 24, 24]  # blocks of 4 and 1: N - B + 1 + j
    assert out.kernel.metrics["kl"].shape == (2, 2, 5, len(budgets))


@pytest.mark.parametrize("names", [PREFILL_EVICT[:5], PREFILL_EVICT[5:]])
def test_prefill_evict_block_equals_single_target_decodes(llama, names):
    check_block_equals_single_targets(llama, "prefill_evict", names, [6, 12], draws=2, room=3)


def test_a_block_of_one_equals_the_exact_protocol(llama):
    docs = _docs(5)
    for name in BLOCK_SEMANTICS:
        semantics = semantics_for(name)
        policies = [make_policy(n, n_sink=2) for n in ("h2o", "random")]
        targets = select_block_targets(docs, 24, 3, 0, 1)  # B = 1: every target its own block
        block = measure_policy_blocks(llama, targets, policies, [8], semantics, 3, "cpu", 4096, draws=2).kernel
        exact = measure_draws(llama, targets, policies, [8], semantics, "original", 3, "cpu", 4096, draws=2)
        for m in METRICS:
            np.testing.assert_allclose(block.metrics[m], exact.metrics[m], atol=1e-5, err_msg=f"{name} {m}")
        assert np.array_equal(block.kept_tokens, exact.kept_tokens)
        np.testing.assert_allclose(block.evicted_attention_mass, exact.evicted_attention_mass, atol=1e-5)


def test_decoded_queries_that_see_each_other_give_other_values(llama):
    """The control: decoding the B queries with each other's decoded keys visible (a causal decode of
    the B tokens) differs from the block rule (each query reads its own new key only)."""
    ids = _docs(9)[0].ids[:20][None]  # [1, 20]
    B, L = 4, 20
    keep = torch.zeros(1, B, L - 1 + B, dtype=torch.bool)
    for j in range(B):
        c = L - B + 1 + j
        keep[0, j, : c - 1] = True  # every cache key before the query (a full kept set)
        keep[0, j, L - 1 + j] = True
    offset = torch.zeros(keep.shape)
    right = decode_kept(llama, ids, reference_pass(llama, ids, keep_cache=True, queries=B).cache, keep, offset)
    full = reference_pass(llama, ids, queries=B).logprobs  # [1, B, V] the full-context rows
    torch.testing.assert_close(right, full, atol=1e-5, rtol=0)  # nothing evicted: the reference itself
    window = torch.zeros_like(keep)  # a sink and the 3 keys before each query, then its own new key
    for j in range(B):
        c = L - B + 1 + j
        window[0, j, 0] = True
        window[0, j, c - 4 : c - 1] = True
        window[0, j, L - 1 + j] = True
    right = decode_kept(llama, ids, reference_pass(llama, ids, keep_cache=True, queries=B).cache, window, offset)
    wrong_keep = window.clone()  # the earlier queries' keys read from their decode, not from the cache
    for j in range(1, B):
        wrong_keep[0, j, L - B : L - B + j] = False
        wrong_keep[0, j, L - 1 : L - 1 + j] = window[0, j, L - B : L - B + j]
    wrong = decode_kept(llama, ids, reference_pass(llama, ids, keep_cache=True, queries=B).cache, wrong_keep, offset)
    assert (wrong[0, 1:] - right[0, 1:]).abs().amax(-1).min() > 1e-3  # every later query differs
    torch.testing.assert_close(wrong[0, 0], right[0, 0], atol=1e-5, rtol=0)  # query 0 reads the same keys


def test_a_stream_per_target_seed_differs_from_the_block_stream(llama):
    """The control of the streaming rule: target j's value is its block stream's, drawn with the block's
    seed; with the target's own seed the single-target stream gives another value (random draws)."""
    semantics = semantics_for("streaming")
    policy = make_policy("random", n_sink=1)
    docs = _docs(11)
    targets = select_block_targets(docs, 24, 4, 0, 4)
    out = measure_policy_blocks(llama, targets, [policy], [5], semantics, 7, "cpu", 4096).kernel
    doc, t, c = docs[0].ids, int(targets.position[3]), 24
    own = single_target(llama, semantics, policy, doc, t, c, 5, policy_seeds(targets, [3], 7, "random")[0])
    assert abs(float(out.metrics["kl"][0, 0, 3, 0]) - own["kl"]) > 1e-4


@torch.no_grad()
def test_chunks_above_one_would_not_be_exact(llama):
    """Why --chunk C > 1 is refused: a prefix run evicts at its own last prompt token, a shared stream only
    at multiples of C, so some position of one stream differs from its prefix run (with C = 1 none does)."""
    semantics = semantics_for("streaming")
    policy = make_policy("sink_recent", n_sink=1)
    ids = _docs(13)[0].ids[:24][None]  # [1, L]
    L, B, k = 24, 4, 6
    for chunk, differs in ((4, True), (1, False)):
        ev = decide_offline(policy, k, L, chunk, [0], "cpu")
        rows = semantics.kept_logprobs(llama, ids, ev, None, "original", keep=B)  # [1, B, V]
        gaps = [float((rows[0, j] - semantics.policy_logprobs(llama, ids[:, : L - B + 1 + j], policy, k, [0], None,
                                                               "original", chunk)[0][0]).abs().max()) for j in range(B)]
        assert (max(gaps) > 1e-3) == differs and min(gaps) <= 1e-5, (chunk, gaps)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(semantics="reencode", policies=["h2o"]), "under semantics (--semantics) streaming or prefill_evict"),
    (dict(semantics="prefill_evict", positions="reindexed"), "keeps original positions"),
    (dict(granularity="head"), "--granularity token"),
    (dict(chunk=4), "needs chunk=1 (--chunk 1)"),
])
def test_refusals_name_the_exact_protocol(kwargs, fragment):
    args = dict(semantics="streaming", policies=["h2o"], positions="original", granularity="token", chunk=1)
    args.update(kwargs)
    names = args.pop("policies")
    with pytest.raises(MeasureError, match="--protocol exact") as info:
        check_policy_blocks(args.pop("semantics"), [make_policy(n) for n in names], **args)
    assert fragment in str(info.value)


def test_budgets_above_the_shortest_reference_context_are_refused():
    check_block_budgets([8, 21], 24, 4)  # N = 24, blocks of 4: the shortest context is 21
    with pytest.raises(MeasureError, match="budget 30 is larger than the block protocol's shortest reference "
                                           "context 21 .*--protocol exact"):
        check_block_budgets([8, 30], 24, 4)


def test_kvpress_presses_are_refused():
    from truncsens.policies import Policy
    from truncsens.policies.kvpress_adapter import PREFILL_LAYERS

    class Press(Policy):  # what a kvpress press declares (kvpress itself need not be installed)
        name = "kvpress:FakePress"

        def requirements(self):
            return frozenset({PREFILL_LAYERS})

    with pytest.raises(MeasureError, match="does not run kvpress presses .*--protocol exact"):
        check_policy_blocks("prefill_evict", [Press()], "original", "token", 1)


def test_config_accepts_policy_blocks_and_refuses_the_rest():
    MeasureConfig(policies=["sink_recent", "h2o"], semantics="streaming", protocol="block")
    MeasureConfig(policies=["snapkv_shared"], semantics="prefill_evict", protocol="block")
    for kwargs, fragment in [
        (dict(policies=["h2o"], semantics="reencode"), "h2o"),
        (dict(policies=["h2o"], semantics="prefill_evict", positions="reindexed"), "original positions"),
        (dict(policies=["h2o"], semantics="streaming", granularity="head"), "--granularity token"),
        (dict(policies=["h2o"], semantics="streaming", chunk=4), "--chunk 1"),
        (dict(policies=["snapkv"], semantics="prefill_evict"), "one per layer and key/value head"),
    ]:
        with pytest.raises(Exception, match="--protocol exact") as info:
            MeasureConfig(protocol="block", **kwargs)
        assert fragment in str(info.value), kwargs


def test_streaming_block_run_resumes_from_the_command_line(tiny_llama_dir, corpus_dir, tmp_path):
    from truncsens.engine.measure import run_measure
    from truncsens.engine.run.shards import MeasureInterrupted

    out = tmp_path / "p.nc"
    cfg = MeasureConfig(model=tiny_llama_dir, corpus=corpus_dir, policies=["sink_recent", "h2o"], semantics="streaming",
                        budgets=[16], reference_context=64, max_docs=2, targets_per_doc=4, docs_per_shard=1,
                        protocol="block", block_size=4, out=str(out), progress=False)
    with pytest.raises(MeasureInterrupted):
        run_measure(cfg, stop_after_shards=1)
    args = ["measure", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--protocol", "block", "--semantics",
            "streaming", "--policy", "sink_recent,h2o", "--budgets", "16", "--reference-context", "64", "--max-docs",
            "2", "--targets-per-doc", "4", "--docs-per-shard", "1", "--block-size", "4", "--out", str(out),
            "--no-progress", "--resume"]
    resumed = CliRunner().invoke(app, args)
    assert resumed.exit_code == 0, resumed.output
    assert "block protocol" in resumed.output and "1 shard reused" in resumed.output, resumed.output
    ds = results.load(out)
    assert ds.attrs["protocol"] == "block" and ds.attrs["block_length"] == 4 and ds.sizes["target"] == 8
    # the tiny model has room beyond N = 64: e = B - 1 = 3, contexts N .. N + 3
    assert ds.attrs["block_extra_context"] == 3 and ds["actual_context"].values.tolist() == list(range(64, 68)) * 2
    assert "actual_budget" not in ds.coords and "evicted_attention_mass" in ds
    assert "share their stream's draws" in ds.attrs["draw_seeds"]


def test_prefill_evict_block_run_on_the_reference_model_names_its_protocol(tmp_path):
    out = tmp_path / "r.nc"
    args = ["measure", "--protocol", "block", "--semantics", "prefill_evict", "--policy", "sink_recent,h2o",
            "--budgets", "16,32", "--reference-context", "128", "--max-docs", "2", "--targets-per-doc", "8",
            "--block-size", "8", "--out", str(out), "--no-progress"]
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0, run.output
    ds = results.load(out)
    assert ds.attrs["protocol"] == "block" and ds.attrs["block_length"] == 8 and ds.sizes["target"] == 16
    assert ds["actual_context"].values.min() >= 121 and ds["kept_tokens"].sel(budget=16).values.max() == 16
    assert "share their stream's draws" not in ds.attrs["draw_seeds"]  # every target its own draw
    shown = CliRunner().invoke(app, ["show", str(out)])
    assert shown.exit_code == 0 and "protocol block" in shown.output, shown.output


@pytest.mark.parametrize("semantics_name", BLOCK_SEMANTICS)
def test_blocks_batched_together_keep_their_own_seeds(llama, semantics_name):
    """Three documents, blocks of 4: three blocks run in one batch, each with its own seeds and rows."""
    out = check_block_equals_single_targets(llama, semantics_name, ["poisson", "tova"], [6], draws=2, tpd=4, n_docs=3)
    assert out.actual_context.tolist() == [21, 22, 23, 24] * 3


@pytest.fixture(scope="module")
def hybrid():
    return hybrid_qwen2()


@pytest.mark.parametrize("semantics_name,names", [("streaming", ["sink_recent", "h2o"]),
                                                  ("prefill_evict", ["tova", "random"])])
def test_sliding_window_layers_block_equals_single_targets(hybrid, semantics_name, names):
    budgets = [6] if semantics_name == "streaming" else [4, 8]
    check_block_equals_single_targets(hybrid, semantics_name, names, budgets, draws=2, room=2)


def test_forward_tokens_by_hand(llama):
    """Blocks of 4 and 1 target (N = 24, no room: L = 24 each), one deterministic policy, 2 budgets:
    reference 2 x 24; streaming 2 budgets x 2 blocks x 24; prefill_evict 2 budgets x (4 + 1) decoded queries."""
    targets = select_block_targets(_docs(4), 24, 5, 0, 4)
    assert sorted(np.bincount(np.unique(targets.block, return_inverse=True)[1]).tolist()) == [1, 4]
    policy = [make_policy("sink_recent", n_sink=2)]
    got = {name: measure_policy_blocks(llama, targets, policy, [6, 12], semantics_for(name), 0, "cpu", 4096).forward_tokens
           for name in ("streaming", "prefill_evict")}
    assert got == {"streaming": 48 + 2 * 2 * 24, "prefill_evict": 48 + 2 * 5}
    # the plan's count (progress estimates, benchmarks) is the same rule
    assert policy_forward_tokens([4, 1], 24, 2, True) == got["streaming"]
    assert policy_forward_tokens([4, 1], 24, 2, False) == got["prefill_evict"]
    assert policy_forward_tokens([4], 24, 2, True, room=10) == 27 + 2 * 27  # L = N + min(B - 1, room)
