"""CertifyConfig and AttributionConfig share one declaration of their common fields (CertifyBase):
the same defaults, the same checks and messages, and the resume fingerprint of certify unchanged."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from truncsens.certificates.attribution_driver import AttributionConfig
from truncsens.certificates.config import CertifyBase, CertifyConfig, CertifyError
from truncsens.engine.config import MeasureError

SHARED = ["model", "domain", "corpus", "split", "reference_context", "budgets", "delta", "n_sink", "max_docs", "seed",
          "device", "dtype", "max_batch_tokens", "out", "docs_per_shard", "resume", "overwrite", "progress", "command",
          "granularity", "score",
          "obs_window", "temper", "top_fraction", "semantics", "policies"]


def test_the_shared_fields_are_declared_once_in_the_base():
    assert [f.name for f in fields(CertifyBase) if f.init] == SHARED
    certify = {f.name for f in fields(CertifyConfig) if f.init}
    attribution = {f.name for f in fields(AttributionConfig) if f.init}
    assert certify & attribution == set(SHARED)
    assert certify - set(SHARED) == {"text_field", "targets_per_doc", "draws", "variance"}  # certify's own
    assert attribution - set(SHARED) == {"copy_per_doc", "copy_rule", "kv_docs", "min_distance", "trajectory",
                                         "trajectory_budget"}


def test_defaults_per_command():
    c, a = CertifyConfig(), AttributionConfig()
    assert c.out == "results/reference-code-certify.nc" and a.out == "results/reference-code-attribution.nc"
    assert c.reference_context is None and a.reference_context == 512  # attribution's own default of N
    assert (c.budgets, c.delta, c.n_sink, c.max_docs) == (a.budgets, a.delta, a.n_sink, a.max_docs) == (
        "12.5%,25%,50%", 0.05, 4, 16)
    assert c.parsed_budgets == a.parsed_budgets == [(12.5, True), (25.0, True), (50.0, True)]
    inner = AttributionConfig(seed=3, n_sink=2, budgets="40").certify_config()
    got = (inner.seed, inner.n_sink, inner.budgets, inner.reference_context, inner.targets_per_doc)
    assert got == (3, 2, "40", 512, 1)
    assert inner.out == "results/reference-code-attribution.nc"


def test_the_resume_fingerprint_keeps_its_keys():
    keys = sorted(CertifyConfig().fingerprint(budgets_tokens=[8]))
    assert keys == ["budgets", "budgets_tokens", "corpus", "delta", "docs_per_shard", "domain", "dtype", "granularity",
                    "max_docs", "model", "n_sink", "obs_window", "reference_context", "score", "seed", "split",
                    "targets_per_doc", "temper", "text_field", "top_fraction"]
    # and its values, pinned: a change of them makes every interrupted run unresumable. (The sampling
    # design joined them with per-head designs: shards of the shared design must not be
    # resumed as per-head ones; runs from before also lack the model's content hash; the
    # default γ became 0.5 when benchmarks/certify_designs.py chose it, so earlier default runs are
    # not resumed under the new default either.)
    from truncsens.engine.run.shards import fingerprint_hash

    assert fingerprint_hash(CertifyConfig().fingerprint(budgets_tokens=[8])) == (
        "dd717ecef9e158bc89ca3523c0e7f5c7fc48fb7fabdbf9c864410081ab1c7565")
    assert fingerprint_hash(CertifyConfig(seed=3, budgets="40", n_sink=2).fingerprint(budgets_tokens=[40])) == (
        "7eefad68479a54e568b8708b599cf4ad1e0c66c9f4246f0fac001390e80f03bc")
    # the options added later enter only away from their defaults: a streaming run never resumes a
    # prefill-evict one, and a prefill-evict run keeps the fingerprint it had before
    streaming = CertifyConfig(semantics="streaming").fingerprint(budgets_tokens=[8])
    assert streaming["semantics"] == "streaming" and "policies" not in streaming
    assert CertifyConfig(policies="poisson,topk").fingerprint(budgets_tokens=[8])["policies"] == "poisson,topk"


@pytest.mark.parametrize("cls", [CertifyConfig, AttributionConfig])
@pytest.mark.parametrize("kwargs,error,message", [
    ({"delta": 1.0}, CertifyError, "delta (--delta) must lie strictly between 0 and 1, got 1.0"),
    ({"budgets": "12.5%,x"}, CertifyError, "budgets (--budgets): 'x' is neither a token count"),
    ({"budgets": " , "}, CertifyError, "budgets (--budgets) is empty"),
    ({"max_docs": 0}, MeasureError, "max_docs (--max-docs) must be at least 1, got 0"),
    ({"top_fraction": 1.5}, CertifyError, "top_fraction (--top-fraction) must lie in"),
    ({"granularity": "layer"}, CertifyError, "granularity (--granularity) must be one of head, token, got 'layer'"),
])
def test_shared_checks_and_messages(cls, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        cls(**kwargs)


def test_attribution_checks_its_own_fields_first():
    with pytest.raises(CertifyError, match=r"copy_rule \(--copy-rule\) must be one of induction, span, token"):
        AttributionConfig(copy_rule="bigram", delta=2.0)
    with pytest.raises(CertifyError, match=r"trajectory_budget \(--trajectory-budget\) takes one budget"):
        AttributionConfig(trajectory_budget="10,20")


@pytest.mark.parametrize("value, message", [
    ("0", "trajectory_budget (--trajectory-budget): a token count must be at least 1, got 0"),  # named --budgets before
    ("150%", "trajectory_budget (--trajectory-budget): a percentage of the reference context must lie in (0%, 100%], got 150%"),
    ("abc", "trajectory_budget (--trajectory-budget): 'abc' is neither a token count (128) nor a percentage (12.5%)"),
])
def test_a_bad_trajectory_budget_names_its_own_option(value, message):
    with pytest.raises(CertifyError) as err:
        AttributionConfig(trajectory_budget=value)
    assert str(err.value) == message
    with pytest.raises(CertifyError, match=r"^budgets \(--budgets\): a token count must be at least 1, got 0$"):
        AttributionConfig(budgets="0")


@pytest.mark.parametrize("cls", [CertifyConfig, AttributionConfig])
def test_run_options_are_checked_by_one_measure_config(cls, monkeypatch):
    from truncsens.engine import config as engine_config

    built = []
    real = engine_config.MeasureConfig.__post_init__
    monkeypatch.setattr(engine_config.MeasureConfig, "__post_init__", lambda self: built.append(1) or real(self))
    cls()
    assert len(built) == 1
