"""The ``truncsens certify`` driver: corpus -> documents -> targets -> probed passes
(:func:`truncsens.certificates.passes.certify_batch`) -> shard files -> results file (the shards, lock,
resume and merge of :func:`truncsens.engine.run.skeleton.run_sharded`).

Results (NetCDF, :mod:`truncsens.results`): dims (policy, target, budget) for the output metrics
(:data:`truncsens.divergences.METRICS`: KL, TV, top-1 agreement, NLL under the full cache
``nll_ref`` and under the policy ``nll_kept``) and ``kept_tokens``; dims (policy, target, budget,
layer, head) for the attention-level records of the target's query (``attn_error`` = ‖ô − o‖₂,
``attn_norm`` = ‖o‖₂, ``radius_eb``, ``radius_normal``, ``attn_variance`` V̂, ``value_range`` B̂,
``n_random`` kept random keys, ``has_tail``, ``attn_hat_norm`` = ‖ô‖₂, ``attn_tail_mass`` (the share of
the full-cache attention on the keys drawn at random: an oracle quantity) and the emitted certificate
``radius_certificate`` = ``radius_eb`` + b·‖ô‖ (:mod:`truncsens.certificates.arithmetic`); radii NaN for
topk and random); the top-1 token id and
its probability (the output confidence) under the full cache (``argmax_ref``, ``confidence_ref``,
dim target) and under each policy (``argmax_kept``, ``confidence_kept``). Policies and semantics:
poisson, topk, random under prefill_evict, or poisson (and sink_recent) under streaming
(:mod:`truncsens.certificates.semantics`); attrs add ``delta`` and ``certified_process`` (the process
simulated, in words). With ``--draws D`` >= 2 the file adds, per further Poisson draw of the same
target (dim ``certify_draw``, 0..D − 1, draw 0 the run's own records), ``draw_attn_error``,
``draw_attn_variance``, ``draw_value_range``, ``draw_n_random`` and ``draw_attn_hat_norm`` (dims policy,
target, budget, certify_draw, layer, head) and the attr ``draws``; with ``--variance hajek_bias``
``attn_variance`` and the radii are the corrected ones, ``attn_variance_hajek`` (and
``draw_attn_variance_hajek``) the plain V̂, and the attr ``variance`` names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from truncsens import results
from truncsens.certificates.arithmetic import ARITH_REFERENCE, LEGACY_FLOOR_FACTOR, declared_bound, emitted_radius
from truncsens.certificates.config import CertifyConfig
from truncsens.certificates.designs import CertifyDesign
from truncsens.certificates.probe import check_model
from truncsens.engine.batching import run_in_batches
from truncsens.engine.documents import prepare_documents
from truncsens.engine.kernel import metric_arrays, policy_seeds, store_metrics
from truncsens.engine.measure import provenance, resolve_reference_context
from truncsens.engine.options import recorded_attrs
from truncsens.engine.semantics import SEMANTICS
from truncsens.engine.run.shards import check_output
from truncsens.engine.run.skeleton import ShardedRun, ShardWork, run_sharded
from truncsens.engine.sweep import Sweep
from truncsens.models import LoadedModel, load_model
from truncsens.targets import TargetSet, doc_seed

ATTENTION_VARS = {  # results variable -> record name of certify_batch
    "attn_error": "error", "attn_norm": "o_norm", "radius_eb": "radius_eb", "radius_normal": "radius_normal",
    "attn_variance": "variance", "value_range": "value_range", "n_random": "n_random", "has_tail": "has_tail",
    "attn_hat_norm": "o_hat_norm", "attn_tail_mass": "tail_mass",
}
DRAW_VARS = {  # results variable of every draw (dim ``certify_draw``, ``--draws`` >= 2) -> record name
    "draw_attn_error": "error", "draw_attn_variance": "variance", "draw_value_range": "value_range",
    "draw_n_random": "n_random", "draw_attn_hat_norm": "o_hat_norm", "draw_attn_variance_hajek": "variance_hajek",
}
ATTENTION_DESCRIPTION = {"error": "||o_hat - o||_2", "variance": "the variance estimate of the radii",
                         "value_range": "the plug-in range B_hat", "n_random": "kept random keys",
                         "o_hat_norm": "||o_hat||_2", "variance_hajek": "the plain variance estimate V_hat"}
PLAIN_VARIANCE_VAR = "attn_variance_hajek"  # the plain V̂ beside a corrected ``attn_variance`` (``--variance``)


@dataclass
class CertifySummary:
    """What a finished run did."""

    path: Path
    n_targets: int
    n_docs: int
    budgets: list[int]
    reference_context: int
    shards_reused: int = 0


def shard_dataset(batches: dict, plan: TargetSet, sweep: Sweep, attrs: dict):
    """The results Dataset of one shard from the arrays of :func:`compute_arrays`."""
    names = [p.name for p in sweep.policies]
    ds = results.make_results(batches["metrics"], "budget", sweep.values, plan.doc, plan.position,
                              plan.token_id.numpy(), {**attrs, "n_clamped": batches["n_clamped"]}, policies=names)
    ds["kept_tokens"] = (("policy", "target", "budget"), batches["kept_tokens"])
    ds["kept_tokens"].attrs["units"] = "tokens"
    for var, rec in ATTENTION_VARS.items():
        ds[var] = (("policy", "target", "budget", "layer", "head"), batches["records"][rec])
    for var in ("argmax_ref", "confidence_ref"):
        ds[var] = (("target",), batches[var])
    ds["attn_floor_error"] = (("target", "layer", "head"), batches["floor"])
    ds["attn_floor_error"].attrs["description"] = ("||o_run_dtype - o_float64|| / ||o_float64|| of the full-cache "
                                                   "attention of the target query: the measured numerical floor")
    for var in ("argmax_kept", "confidence_kept"):
        ds[var] = (("policy", "target", "budget"), batches[var])
    ds["confidence_ref"].attrs["description"] = "largest next-token probability under the full cache"
    ds["attn_error"].attrs["description"] = "||o_hat - o||_2 of the target query per layer and head (values' units)"
    ds["radius_eb"].attrs["description"] = ("statistical part of the certificate: empirical-Bernstein radius at the "
                                            "run's delta (NaN: no design)")
    bound = float(attrs.get("arithmetic_bound_relative", 0.0))
    ds["radius_certificate"] = (("policy", "target", "budget", "layer", "head"),
                                emitted_radius(batches["records"]["radius_eb"], batches["records"]["o_hat_norm"], bound))
    ds["radius_certificate"].attrs["description"] = ("the emitted certificate: radius_eb + arithmetic_bound_relative * "
                                                     "||o_hat|| (values' units; NaN: no design)")
    ds["attn_hat_norm"].attrs["description"] = "||o_hat||_2, the Hajek output's norm (a kept-set quantity)"
    ds["attn_norm"].attrs["description"] = "||o||_2, the full-cache output's norm (an oracle quantity)"
    if "variance_hajek" in batches["records"]:
        ds[PLAIN_VARIANCE_VAR] = (("policy", "target", "budget", "layer", "head"), batches["records"]["variance_hajek"])
        ds[PLAIN_VARIANCE_VAR].attrs["description"] = "the plain linearized variance estimate V_hat (attn_variance: the run's --variance)"
    for var, rec in DRAW_VARS.items():
        if rec in batches.get("draws", {}):
            ds[var] = (("policy", "target", "budget", "certify_draw", "layer", "head"), batches["draws"][rec])
            ds[var].attrs["description"] = f"{ATTENTION_DESCRIPTION.get(rec, rec)} of every Poisson draw (draw 0: the run's own record)"
    if "certify_draw" in ds.dims:
        ds = ds.assign_coords(certify_draw=np.arange(ds.sizes["certify_draw"], dtype=np.int64))
    return ds


def compute_arrays(model, plan: TargetSet, sweep: Sweep, seed: int, delta: float, device: str, batch_tokens: int,
                   on_tokens: Callable[[int], None], design: CertifyDesign = CertifyDesign(),
                   batch: Callable | None = None, tokens_per_target: int | None = None, draws: int = 1,
                   variance: str = "hajek") -> dict:
    """Every pass of the targets of ``plan``: metrics [P, n, K], kept_tokens [P, n, K], records
    name -> [P, n, K, L, H] (float64), argmax_ref / confidence_ref [n] (top-1 id and its probability
    under the full cache), argmax_kept / confidence_kept [P, n, K], n_clamped; with ``draws`` D >= 2
    also "draws": name -> [P, n, K, D, L, H] (draw d's seeds: :func:`draw_seeds`). ``variance``: the
    radii's variance estimate (prefill-evict only; :data:`~truncsens.certificates.estimator.VARIANCES`).

    ``batch`` is the semantics' batch function (:meth:`truncsens.certificates.semantics.CertifySemantics.batch`;
    None: prefill-evict's ``certify_batch``) and ``tokens_per_target`` its forward tokens per target
    (the progress; None: prefill-evict's)."""
    if batch is None:
        from truncsens.certificates.passes import certify_batch as batch
    per_target = tokens_per_target or certify_tokens_per_target(plan.context.shape[1], sweep)
    n, N = plan.context.shape
    P, K = len(sweep.policies), len(sweep.budgets)
    metrics = metric_arrays((P, n, K))
    kept_tokens = np.zeros((P, n, K), dtype=np.int32)
    top = {"argmax_ref": np.zeros(n, np.int64), "confidence_ref": np.zeros(n),
           "argmax_kept": np.zeros((P, n, K), np.int64), "confidence_kept": np.zeros((P, n, K))}
    records: dict[str, np.ndarray] = {}
    per_draw: dict[str, np.ndarray] = {}
    floor: list[np.ndarray] = []
    state = {"n_clamped": 0}
    context, token_id = plan.context.to(device), plan.token_id.to(device)

    def step(sl: slice) -> None:
        # one independent draw per budget, as certify has always drawn: the budget stands in the seed's
        # draw slot (the seed string "doc:position:policy:budget" of the results published before)
        seeds = [[policy_seeds(plan, sl, seed, p.name, draw=k) for k in sweep.budgets] for p in sweep.policies]
        extra = {}
        if draws > 1 or variance != "hajek":  # prefill-evict's own keywords: default runs call any semantics as before
            extra["variance"] = variance
            if draws > 1:
                extra["draw_seeds"] = [[[draw_seeds(plan, sl, seed, p.name, k, d) for d in range(1, draws)]
                                        for k in sweep.budgets] for p in sweep.policies]
        out = batch(model, context[sl], sweep.policies, sweep.budgets, seeds, delta, design, **extra)
        for p in range(P):
            for j in range(K):
                state["n_clamped"] += store_metrics(metrics, (p, sl, j), out.ref_logprobs, out.logprobs[p, j], token_id[sl])
        kept_tokens[:, sl, :] = out.kept_tokens.permute(0, 2, 1).numpy()
        best, arg = out.ref_logprobs.max(-1)  # [b]
        top["argmax_ref"][sl], top["confidence_ref"][sl] = arg.cpu().numpy(), best.exp().cpu().numpy()
        best, arg = out.logprobs.max(-1)  # [P, K, b]
        top["argmax_kept"][:, sl], top["confidence_kept"][:, sl] = (arg.permute(0, 2, 1).cpu().numpy(),
                                                                    best.exp().permute(0, 2, 1).cpu().numpy())
        for name, v in out.records.items():
            if name not in records:
                records[name] = np.full((P, n, K, *v.shape[3:]), np.nan)
            records[name][:, sl] = v.permute(0, 2, 1, 3, 4).numpy()  # [P, K, b, L, H] -> [P, b, K, L, H]
        for name, v in (getattr(out, "draws", None) or {}).items():
            if name not in per_draw:
                per_draw[name] = np.full((P, n, K, *v.shape[2:3], *v.shape[4:]), np.nan)
            per_draw[name][:, sl] = v.permute(0, 3, 1, 2, 4, 5).numpy()  # [P, K, D, b, L, H] -> [P, b, K, D, L, H]
        floor.append(out.floor.numpy())  # [b, L, H], batches in target order
        on_tokens((sl.stop - sl.start) * per_target)

    run_in_batches(step, n, N, batch_tokens)
    return {"metrics": metrics, "kept_tokens": kept_tokens, "records": records, **top, "n_clamped": state["n_clamped"],
            "floor": np.concatenate(floor) if floor else np.zeros((0, 0, 0)), **({"draws": per_draw} if per_draw else {})}


def draw_seeds(plan: TargetSet, sl: slice, seed: int, policy: str, budget: int, draw: int) -> list[int]:
    """The seeds of draw ``draw`` (>= 1; ``certify --draws``) of the targets ``plan[sl]``:
    ``doc_seed(seed, "doc:position:policy:budget:draw")``. Draw 0 keeps the seed every certify run has
    used (``"doc:position:policy:budget"``, :func:`~truncsens.engine.kernel.policy_seeds`), so ``--draws 1``
    is the run as before; like it, a draw depends neither on batching nor on sharding nor on resuming."""
    return [doc_seed(seed, f"{plan.doc[i]}:{int(plan.position[i])}:{policy}:{budget}:{draw}")
            for i in range(len(plan))[sl]]


def design_attrs(design: CertifyDesign, dtype: str) -> dict:
    """The results attrs naming the run's sampling design and its declared arithmetic bound b
    (:func:`truncsens.certificates.arithmetic.declared_bound`, relative to ‖ô‖) and the earlier floor
    ``error_floor_relative`` (10 eps, relative to ‖o‖), which the design benchmarks' rules read."""
    return {"design": design.describe(), "design_granularity": design.granularity, "design_score": design.score,
            "obs_window": design.obs_window, "arithmetic_bound_relative": declared_bound(dtype),
            "arithmetic_bound_of": ARITH_REFERENCE, "error_floor_relative": declared_bound(dtype, LEGACY_FLOOR_FACTOR)}


def certify_tokens_per_target(N: int, sweep: Sweep, streams: bool = False, draws: int = 1) -> int:
    """Forward tokens of one target's certify passes (the progress estimate): its N-token prefill and,
    per (policy, budget), one decode (prefill-evict) or an N-token streaming run (``streams``), and one
    more decode per further draw of a randomized policy (``draws``), as :func:`compute_arrays` reports them."""
    extra = (draws - 1) * sum(p.randomized for p in sweep.policies) * len(sweep.budgets)
    return N + len(sweep.policies) * len(sweep.budgets) * (N if streams else 1) + extra


def certify_sweep(cfg: CertifyConfig, loaded: LoadedModel, N: int, budgets: list[int],
                  on_stage: Callable[[str], None] | None = None):
    """(measure config, sweep, documents) of a certify run: the run's policies under its semantics
    (``cfg.semantics``: prefill_evict or streaming) at ``budgets`` (each checked against N), and the
    documents long enough for N (``on_stage``: progress of loading them, as
    :func:`truncsens.engine.documents.prepare_documents`).

    Raises:
        PolicyError: a budget a policy cannot run at N.
    """
    mcfg = cfg.measure_config(budgets)
    policies = mcfg.build_policies()
    for p in policies:
        for k in budgets:
            p.check(k, N)
    sweep = Sweep("budget", budgets, budgets, policies, SEMANTICS[cfg.rule.name])
    return mcfg, sweep, prepare_documents(mcfg, loaded, N, on_stage)


def run_certify(cfg: CertifyConfig, loaded: LoadedModel | None = None) -> CertifySummary:
    """Run a certify measurement and write the results file ``cfg.out``.

    Raises:
        CertifyError: a budget at or above N or below the sinks.
        truncsens.certificates.probe.CertifyModelError: a model that does not use the attention interface.
        MeasureError: ``cfg.out`` exists (without overwrite), bad reference context or corpus, shards of
            another run. Nothing is written before every check has passed.
        truncsens.engine.run.lock.OutputLockedError: another run is writing ``cfg.out``.
        truncsens.models.ModelLoadError, truncsens.corpora.CorpusError: loading failed.
    """
    check_output(cfg.out, cfg.overwrite, cfg.resume)
    cfg.check_before_loading()
    loaded = loaded or load_model(cfg.model, cfg.device, cfg.dtype)
    check_model(loaded.model, loaded.name)
    N = resolve_reference_context(cfg.measure_config(), loaded)
    budgets = cfg.resolve_budgets(N)
    mcfg, sweep, docs = certify_sweep(cfg, loaded, N, budgets)
    attrs = {**provenance(mcfg, loaded, N, docs, sweep), **recorded_attrs(cfg), "delta": cfg.delta, **design_attrs(cfg.design, loaded.dtype),
             "certify": "attention-level certificates of the target query, arXiv 2607.21475 (truncsens certify)",
             "certified_process": cfg.rule.process_for(cfg.design),
             **({"draws": cfg.draws} if cfg.draws > 1 else {}), **({"variance": cfg.variance} if cfg.variance != "hajek" else {})}
    batch_tokens = mcfg.batch_tokens(loaded.device)
    per_target = certify_tokens_per_target(N, sweep, cfg.rule.streams, cfg.draws)

    def compute_shard(plan: TargetSet, on_tokens: Callable[[int], None]):
        arrays = compute_arrays(loaded.model, plan, sweep, cfg.seed, cfg.delta, loaded.device, batch_tokens, on_tokens,
                                cfg.design, cfg.rule.batch(), per_target, cfg.draws, cfg.variance)
        return shard_dataset(arrays, plan, sweep, attrs)

    work = ShardWork(compute_shard, per_target, "certify")
    fingerprint = cfg.fingerprint(reference_context=N, corpus_sha256=docs.sha256, budgets_tokens=budgets,
                                  model_sha256=loaded.content_sha256, model_revision=loaded.revision)
    done = run_sharded(ShardedRun.of(cfg, docs.used, N, fingerprint, work))
    return CertifySummary(done.path, done.n_targets, len(docs.used), budgets, N, done.shards_reused)
