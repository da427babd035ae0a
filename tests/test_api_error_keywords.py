"""Errors raised by the Python API name the API keyword, with the command line's flag in parentheses
(``sinks (--sinks) must be >= 0``), so a caller of :mod:`truncsens` and a user of the command line
both recognise the option. Every call is refused before a model is loaded or a results file is read
(the synthetic source and missing files: no forward pass)."""

from __future__ import annotations

import pytest

import truncsens
from truncsens.models.reference.start import start_from

SYN = "synthetic:1.0"  # a model spec of the synthetic source: no checkpoint is read before these checks

CASES = [
    (lambda tmp: truncsens.measure(SYN, positions="bogus"),
     "positions (--positions) must be one of ('original', 'reindexed'), got 'bogus'"),
    (lambda tmp: truncsens.measure(SYN, bos="sometimes"),
     "bos (--bos) must be one of auto, always, never, document, got 'sometimes'"),
    (lambda tmp: truncsens.measure(SYN, policies=["sink_recent"], granularity="x"),
     "granularity (--granularity) must be token or head, got 'x'"),
    (lambda tmp: truncsens.measure(SYN, policies=["sink_recent"], budgets=[0, 4]),
     "budgets (--budgets) must be at least 1 token each, got 0"),
    (lambda tmp: truncsens.measure(SYN, targets_per_doc=0),
     "targets_per_doc (--targets-per-doc) must be at least 1, got 0"),
    (lambda tmp: truncsens.measure(SYN, policies=["suffix"], budgets=[16], positions="reindexed"),
     "semantics streaming keeps original positions (keys are computed once, at their own position); "
     "positions='reindexed' (--positions reindexed) works only with semantics (--semantics) reencode or prefill_evict"),
    (lambda tmp: truncsens.measure(SYN, protocol="block", policies=["h2o"], semantics="streaming", chunk=4),
     "protocol='block' (--protocol block) under streaming needs chunk=1 (--chunk 1): with chunks of 4 tokens"),
    (lambda tmp: truncsens.measure(SYN, policies=["sink_recent"], policy_args={"a": 1}),
     "policy_args (--policy-arg) sets parameters of kvpress:<PressClass> policies; none is given"),
    (lambda tmp: truncsens.certify(SYN, semantics="reencode"),
     "semantics='reencode' (--semantics reencode): a re-encoded context has no cache to certify"),
    (lambda tmp: truncsens.certify(SYN, policies="topk,random"),
     "policies (--policies) must include poisson, the certified policy; got topk,random"),
    (lambda tmp: truncsens.certify(SYN, semantics="streaming", policies="poisson,topk"),
     "policies (--policies) topk under semantics='streaming' (--semantics streaming): a certificate needs"),
    (lambda tmp: truncsens.recommend_window("missing.fit.json", -1.0),
     "eps (--eps) must be > 0 (a distortion target), got -1.0"),
    (lambda tmp: truncsens.recommend_window("missing.fit.json", 2.0),
     "eps (--eps) for tv must lie in (0, 1] since tv never exceeds 1; got 2.0"),
    (lambda tmp: truncsens.fit("missing.nc", bootstrap=-1), "bootstrap (--bootstrap) must be >= 0, got -1"),
    (lambda tmp: truncsens.fit("missing.nc", level=2.0), "level (--level) must lie in (0, 1), got 2.0"),
    (lambda tmp: truncsens.fit("missing.nc", seed=-1), "seed (--seed) must be >= 0, got -1"),
    (lambda tmp: truncsens.compare_policies("missing.nc", seed=-1), "seed (--seed) must be >= 0, got -1"),
    (lambda tmp: truncsens.measure(SYN, seed=-1), "seed (--seed) must be >= 0, got -1"),
    (lambda tmp: truncsens.certify(SYN, seed=-1), "seed (--seed) must be >= 0, got -1"),
    (lambda tmp: truncsens.fit("missing.nc", fit_range="4-128"),
     "fit_range (--fit-range) must look like LO:HI with whole numbers of tokens (e.g. 4:128), got '4-128'"),
    (lambda tmp: truncsens.fit("missing.nc", holdout_range=(9, 3)),
     "holdout_range (--holdout-range) (9, 3) is empty or starts below 1: need 1 <= LO <= HI"),
    (lambda tmp: truncsens.compare_policies("missing.nc", bootstrap=-1), "bootstrap (--bootstrap) must be >= 0, got -1"),
    (lambda tmp: truncsens.compare_policies("missing.nc", fit_range="8:4"),
     "fit_range (--fit-range) '8:4' is empty or starts below 1: need 1 <= LO <= HI"),
    (lambda tmp: truncsens.plan(SYN, eps=[0.0]), "eps (--eps) must be a positive distortion, got 0"),
    (lambda tmp: truncsens.measure(SYN, reference_context=1),
     "reference_context (--reference-context) must be at least 2 tokens, got 1"),
    (lambda tmp: truncsens.certify(SYN, reference_context=1),
     "reference_context (--reference-context) must be at least 2 tokens, got 1"),
    (lambda tmp: truncsens.measure("synthetic:0.5:64", reference_context=16, max_docs=2, windows=[2], bos="always",
                                   out=tmp / "r.nc", progress=False),
     "bos='always' (--bos always): model 'synthetic:0.5:64' has no tokenizer with a BOS token"),
    (lambda tmp: start_from("reference", 0, tmp / "run"),  # train_reference's check (it reads its data first)
     "init_from='reference' (--init-from reference) starts the run at the recall stage, which has no steps"),
]


@pytest.mark.parametrize("call, says", CASES, ids=[says.split(" ")[0] + f"-{i}" for i, (_, says) in enumerate(CASES)])
def test_api_errors_name_the_keyword_then_the_flag(call, says, tmp_path):
    with pytest.raises(Exception) as info:
        call(tmp_path)
    assert not isinstance(info.value, (FileNotFoundError, TypeError)), info.value  # refused on the value itself
    assert str(info.value).startswith(says), str(info.value)
