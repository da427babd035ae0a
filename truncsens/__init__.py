"""truncsens: truncation sensitivity of causal language models and KV-cache budgets.

Data flows one way: corpus -> documents -> targets -> engine (model + policy) ->
per-target metrics -> results file -> fit -> recommendation / plots.

The Python API (:mod:`truncsens.api`; every command line command calls it, keyword names are the
command's options in snake_case)::

    import truncsens
    ds = truncsens.measure(model, tokenizer, texts=[...], reference_context=512)  # an xarray Dataset
    report = truncsens.fit(ds, metrics="tv,kl")  # .table(), .to_json(), .plot(prefix)
    truncsens.recommend_window(report, eps=0.05)

Also :func:`compare_policies`, :func:`certify`, :func:`certify_attribution`, :func:`plot`,
:func:`show`, :func:`load` (a results file as a Dataset) and :func:`train_reference`. They are
imported on first use, so ``import truncsens`` stays instant.

``truncsens.fit`` and ``truncsens.certify`` are also the subpackages :mod:`truncsens.fit` and
:mod:`truncsens.certify`: those two package modules are callable, and calling one calls the API
function of its name (:class:`_CallablePackage`), so ``truncsens.fit(ds)`` and
``truncsens.fit.laws`` both work.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import inspect
    from typing import Any

__version__ = "0.1.0"

# name -> module of truncsens.api that defines it
_API = {
    "measure": "truncsens.api.measure", "fit": "truncsens.api.fit", "FitReport": "truncsens.api.fit",
    "recommend_window": "truncsens.api.recommend", "compare_policies": "truncsens.api.compare",
    "certify": "truncsens.api.certify", "certify_attribution": "truncsens.api.certify_attribution",
    "plot": "truncsens.api.plot", "show": "truncsens.api.show", "load": "truncsens.api.load",
    "train_reference": "truncsens.api.reference",
}
_CALLABLE_PACKAGES = ("fit", "certify")  # subpackages that share their name with an API function

__all__ = ["__version__", *_API]


def _api_function(name: str) -> Any:
    """The object ``name`` of :data:`_API`, its module imported now."""
    return getattr(importlib.import_module(_API[name]), name)


class _CallablePackage(ModuleType):
    """The class of the subpackages named in :data:`_CALLABLE_PACKAGES`: the package module as it is
    (``truncsens.fit.laws``), and callable as the API function of its name (``truncsens.fit(ds)`` is
    ``truncsens.api.fit.fit(ds)``), with that function's signature."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _api_function(self.__name__.rpartition(".")[2])(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        import inspect

        return inspect.signature(_api_function(self.__name__.rpartition(".")[2]))


class _Package(ModuleType):
    """The class of this package's module: when the import system binds the subpackage ``fit`` or
    ``certify`` here (whoever imports it first), that subpackage becomes a :class:`_CallablePackage`."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CALLABLE_PACKAGES and isinstance(value, ModuleType) and value.__name__ == f"{__name__}.{name}":
            value.__class__ = _CallablePackage
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:  # PEP 562: the API on first use
    if name in _CALLABLE_PACKAGES:
        return importlib.import_module(f"{__name__}.{name}")  # bound here as a _CallablePackage
    if name in _API:
        return _api_function(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


sys.modules[__name__].__class__ = _Package
