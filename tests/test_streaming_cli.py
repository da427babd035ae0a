"""Streaming from the command line: ``--chunk`` and the score source recorded in the results attrs,
chunk 1 of the whole run equal to the exact evicting cache, and bad input (one ``error:`` line, exit
2, nothing written)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from oracles import evicting_loop
from truncsens import results
from truncsens.cli.main import app
from truncsens.divergences import all_metrics
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.kernel import policy_seeds
from truncsens.models import load_model
from truncsens.policies import PolicyError, make_policy
from truncsens.targets import TargetSet

N = 32


def run_cli(model_dir, corpus_dir, out, *extra) -> None:
    res = CliRunner().invoke(app, ["measure", "--model", model_dir, "--corpus", corpus_dir, "--policy", "h2o,sink_recent",
                                   "--budgets", "8,16", "--semantics", "streaming", "--reference-context", str(N),
                                   "--targets-per-doc", "2", "--max-docs", "2", "--sinks", "2", "--out", str(out),
                                   "--no-progress", *extra])
    assert res.exit_code == 0, res.output


def test_streaming_run_records_chunk_and_score_source(tiny_llama_dir, corpus_dir, tmp_path):
    """--chunk 4 is recorded with the score source; the target's query reads exactly k keys for every
    chunk size (it is decoded alone); chunking changes the decisions of h2o (online scores arrive
    only at chunk ends) and leaves the reference distribution alone."""
    run_cli(tiny_llama_dir, corpus_dir, tmp_path / "c4.nc", "--chunk", "4")
    run_cli(tiny_llama_dir, corpus_dir, tmp_path / "c1.nc")
    c4, c1 = results.load(tmp_path / "c4.nc"), results.load(tmp_path / "c1.nc")
    assert c4.attrs["chunk"] == 4 and c1.attrs["chunk"] == 1
    assert c4.attrs["score_source"].startswith("online: attention and key norms computed by the evicted")
    assert c4.sizes["target"] == 4
    np.testing.assert_array_equal(c4["kept_tokens"].values, np.broadcast_to([8, 16], (2, 4, 2)))
    np.testing.assert_array_equal(c4["nll_ref"].values, c1["nll_ref"].values)
    assert np.abs(c4["kl"].sel(policy="h2o").values - c1["kl"].sel(policy="h2o").values).max() > 1e-5


def test_streaming_kernel_equals_the_evicting_cache(tiny_llama_dir):
    """The kernel's streaming metrics (chunk 1 and 3) equal those of the oracle's evicting cache run
    with the kernel's own per-target seeds."""
    model = load_model(tiny_llama_dir).model
    n, T = 3, 24
    g = torch.Generator().manual_seed(4)
    ctx = torch.randint(0, model.config.vocab_size, (n, T), generator=g)
    targets = TargetSet([f"d{i}" for i in range(n)], np.arange(n) + T, ctx, torch.randint(0, 50, (n,), generator=g))
    from truncsens.engine.kernel import measure_targets
    from truncsens.engine.semantics import SEMANTICS

    for chunk in (1, 3):
        policy = make_policy("poisson", n_sink=2)
        out = measure_targets(model, targets, [policy], [8], SEMANTICS["streaming"], "original", 7, "cpu", 10_000,
                              chunk=chunk)
        seeds = policy_seeds(targets, slice(0, n), 7, "poisson")
        lp, _ = evicting_loop(model, ctx, policy, 8, seeds, chunk)
        ref = torch.log_softmax(model(input_ids=ctx).logits[:, -1].float().double(), -1).detach()
        want, _ = all_metrics(ref, lp, targets.token_id)
        np.testing.assert_allclose(out.metrics["kl"][0, :, 0], want["kl"].numpy(), atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(out.metrics["tv"][0, :, 0], want["tv"].numpy(), atol=1e-5)


@pytest.mark.parametrize("args,message", [
    (["--policy", "snapkv", "--semantics", "streaming"], "error: policy snapkv cannot be run with semantics streaming"),
    (["--policy", "sink_recent", "--chunk", "0"], "error: chunk (--chunk) must be at least 1, got 0"),
    (["--policy", "random", "--per-query"], "error: policy random cannot be run with semantics streaming"),
    (["--policy", "h2o", "--semantics", "prefill_evict", "--chunk", "4"], "error: chunk (--chunk) is the decision interval"),
    (["--policy", "h2o", "--semantics", "reencode"], "error: policy h2o cannot be run with semantics reencode"),
])
def test_bad_streaming_input(tiny_llama_dir, corpus_dir, tmp_path, args, message):
    out = tmp_path / "x.nc"
    res = CliRunner().invoke(app, ["measure", "--model", tiny_llama_dir, "--corpus", corpus_dir, "--reference-context", "32",
                                   "--out", str(out), "--no-progress", *args])
    assert res.exit_code == 2, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), res.output
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises((MeasureError, PolicyError)):
        MeasureConfig(**{"policies": [args[1]], "out": str(out), **({"chunk": 0} if "0" in args else {}),
                         **({"semantics": args[args.index("--semantics") + 1]} if "--semantics" in args else {}),
                         **({"per_query": True} if "--per-query" in args else {}),
                         **({"chunk": 4} if "4" in args else {})})
