"""Attention features that change the weights beyond ``softmax(q·k / sqrt(d) + mask)``, read from a
model, so that every path that computes attention itself can apply each one or refuse the model.

Features (what the model's own attention function does, transformers 5.x):

- ``softcap``: attention-logit soft-capping, ``s -> c · tanh(s / c)`` before the mask (Gemma 2,
  arXiv 2408.00118; config ``attn_logit_softcapping``).
- ``sinks``: learned sink logits, one per head, that join every softmax and are then dropped
  (GPT-OSS; a ``sinks`` parameter on the attention modules, passed as ``s_aux``).
- ``alibi``: ALiBi linear position biases (Press et al. 2022, arXiv 2108.12409; BLOOM, MPT, Falcon
  with ``alibi``).

Who applies what: the model's own attention (re-encode, prefill-evict, the streaming dense-mask and
online paths) applies all of them. Attention from eviction steps (the streaming one-pass path,
:mod:`truncsens.engine.evict_attention`) applies ``softcap`` and ``sinks``; a model that does not call
transformers' attention interface (detected there by counting calls), or whose decoder layers do not
pass the call's keyword arguments on to attention (StableLM, Falcon), gets the dense mask. The
certificate probe (:mod:`truncsens.certificates.probe`) applies none and refuses them. On CUDA the
block protocol keeps the model's own attention implementation for a model with any of them instead
of switching to SDPA (which drops soft-capping and sinks).
"""

from __future__ import annotations

from dataclasses import dataclass

ALIBI_MODEL_TYPES = ("bloom", "mpt")


@dataclass(frozen=True)
class AttentionFeature:
    """One feature: ``name`` (a short key) and ``description`` (a phrase for messages)."""

    name: str
    description: str


SOFTCAP = AttentionFeature("softcap", "attention-logit soft-capping (attn_logit_softcapping)")
SINKS = AttentionFeature("sinks", "learned attention-sink logits (s_aux)")
ALIBI = AttentionFeature("alibi", "ALiBi position biases")


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def attention_features(model) -> tuple[AttentionFeature, ...]:
    """The features of ``model`` (a transformers model, or anything else: none), in a fixed order."""
    config = getattr(model, "config", None)
    if config is None:
        return ()
    config = _text_config(config)
    found = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        found.append(SOFTCAP)
    named = getattr(model, "named_parameters", None)
    if callable(named) and any(n.rsplit(".", 1)[-1] == "sinks" for n, _ in named()):
        found.append(SINKS)
    if getattr(config, "alibi", False) is True or getattr(config, "model_type", "") in ALIBI_MODEL_TYPES:
        found.append(ALIBI)
    return tuple(found)


def describe(features: tuple[AttentionFeature, ...]) -> str:
    """``"a, b"`` of the features' descriptions (empty for none)."""
    return ", ".join(f.description for f in features)
