"""Results datasets built from given mean curves (window sweeps, or budget sweeps of a named policy),
independent of any model: the exact reference for tests of the fitting code, bootstrap intervals and
recommendations.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from truncsens import __version__
from truncsens.metrics import METRICS
from truncsens.results.schema import make_results, utc_now

def curve_results(
    curves: Mapping[str, Callable[[np.ndarray], np.ndarray]],
    windows: Sequence[int],
    n_docs: int,
    targets_per_doc: int = 2,
    noise: float = 0.0,
    seed: int = 0,
    reference_context: int = 1024,
    attrs: Mapping[str, object] | None = None,
    doc_noise: float = 0.0,
    sweep: str = "window",
):
    """A results dataset (window sweep) whose mean curves are the given functions.

    Each document holds pairs of targets with multipliers ``1 + noise * z`` and ``1 - noise * z``
    (z uniform in [-1, 1], one draw per pair and window-independent), so with ``doc_noise = 0``
    every per-document mean, and hence every per-window mean, equals ``curves[m](w)`` exactly while
    targets still scatter. ``doc_noise > 0`` multiplies each (document, window) by
    ``1 + doc_noise * u`` (u uniform in [-1, 1]), so documents disagree and the mean curve is
    exact only in expectation (for bootstrap tests). Metrics not in ``curves`` hold their best value
    (:attr:`truncsens.metrics.Metric.best`: zero, ``top1_agree`` one).

    Args:
        curves: metric name -> function of the windows [S] returning the mean curve [S].
        windows: the S windows in tokens.
        n_docs: documents; targets_per_doc: targets per document (even).
        noise: relative scatter of targets in [0, 1).
        doc_noise: relative scatter of (document, window) means in [0, 1).
        reference_context: the ``reference_context`` attr (N).
        attrs: attrs overriding the defaults.
        sweep: ``"window"``, or ``"budget"`` (the points are budgets; ``attrs`` name the ``policy`` and
            its ``policy_params``). The targets (doc, position) depend only on ``n_docs``,
            ``targets_per_doc`` and ``reference_context``: two datasets of other seeds or sweeps share them.

    Raises:
        ValueError: odd ``targets_per_doc`` or ``noise`` outside [0, 1).
    """
    if targets_per_doc < 2 or targets_per_doc % 2:
        raise ValueError("targets_per_doc must be even (targets come in antithetic pairs)")
    if not (0 <= noise < 1 and 0 <= doc_noise < 1):
        raise ValueError("noise and doc_noise must lie in [0, 1)")
    w = np.asarray(windows, dtype=np.float64)
    n = n_docs * targets_per_doc
    rng = np.random.default_rng(seed)
    z = rng.uniform(-1, 1, size=(n // 2, 1))
    mult = np.concatenate([1 + noise * z, 1 - noise * z], axis=1).reshape(n, 1)  # pairs stay inside a document
    per_doc = 1 + doc_noise * rng.uniform(-1, 1, size=(n_docs, w.size))
    mult = mult * np.repeat(per_doc, targets_per_doc, axis=0)  # [n, S]
    data = {}
    for m in METRICS:
        if m.name in curves:
            data[m.name] = mult * np.asarray(curves[m.name](w), dtype=np.float64)[None, :]  # [n, S]
        else:
            data[m.name] = np.full((n, w.size), m.best)  # [n, S] the value of no loss: 0, top1_agree 1
    base = {
        "truncsens_version": __version__, "model": "synthetic-curve", "model_revision": "", "tokenizer": "none",
        "dtype": "float32", "device": "cpu", "semantics": "reencode", "positions": "original", "n_sink": 0,
        "reference_context": reference_context, "corpus": "constructed", "corpus_sha256": "", "domain": "synthetic",
        "seed": seed, "created": utc_now(), "command": "truncsens.results.constructed.curve_results",
    }
    base.update(attrs or {})
    doc = [f"doc{i:04d}" for i in range(n_docs) for _ in range(targets_per_doc)]
    return make_results(data, sweep, [int(v) for v in windows], doc, np.arange(n) + reference_context,
                        np.zeros(n, dtype=np.int64), base)
