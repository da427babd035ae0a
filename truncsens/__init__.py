"""truncsens: truncation sensitivity of causal language models and KV-cache budgets.

Data flows one way: corpus -> targets -> semantics x policy -> metrics -> results -> fit ->
budget -> certify (docs/architecture.md).

The Python API (:mod:`truncsens.api`; every command line command calls it, keyword names are the
command's options in snake_case)::

    import truncsens
    ds = truncsens.measure(model, tokenizer, texts=[...], reference_context=512)  # an xarray Dataset
    report = truncsens.fit(ds, metrics="tv,kl")  # .table(), .to_json(), .plot(prefix)
    truncsens.recommend_window(report, eps=0.05)

Also :func:`compare_policies`, :func:`certify`, :func:`certify_attribution`, :func:`plot`,
:func:`show`, :func:`load` (a results file as a Dataset) and :func:`train_reference`. They are
imported on first use, so ``import truncsens`` stays instant. The verbs are functions here; the
stages they run are the folders named by nouns (:mod:`truncsens.fits`, :mod:`truncsens.certificates`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# --device of every command and API function that runs a model: CUDA when present, else cpu
# (a model object passed in memory runs where it is). Declared here, light to import, for every layer.
DEFAULT_DEVICE = "auto"

# name -> module of truncsens.api that defines it
_API = {
    "measure": "truncsens.api.measure", "fit": "truncsens.api.fit", "FitReport": "truncsens.api.fit",
    "recommend_window": "truncsens.api.recommend", "compare_policies": "truncsens.api.compare",
    "certify": "truncsens.api.certify", "certify_attribution": "truncsens.api.certify_attribution",
    "plot": "truncsens.api.plot", "show": "truncsens.api.show", "load": "truncsens.api.load",
    "train_reference": "truncsens.api.reference", "plan": "truncsens.api.plan",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:  # PEP 562: the API on first use
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
