"""``truncsens.load``: a results file as an xarray Dataset; and the datasets of results given as paths
or Datasets alike (what :func:`truncsens.fit`, :func:`truncsens.compare_policies` and
:func:`truncsens.plot` take)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import xarray as xr

from truncsens import results
from truncsens.fits.fit_file import is_fit_file
from truncsens.results import ResultsError

Results = Union[str, Path, xr.Dataset]  # a results file, or a results dataset in memory


def load(path: str | Path) -> xr.Dataset:
    """Read and validate a results file (written by ``truncsens measure``, ``truncsens.measure(..., out=)``
    or ``truncsens certify``) into memory. Schema: :mod:`truncsens.results.schema`.

    Raises:
        FileNotFoundError: no such file.
        truncsens.results.ResultsError: not NetCDF, not a truncsens results file, or locked by a writer.
    """
    return results.load(path)


def refuse_fit_file(path: str | Path) -> None:
    """Refuse a fit file where a results file is read, naming the command that reads it.

    Raises:
        truncsens.results.ResultsError: ``path`` is a fit file (the JSON ``truncsens fit`` writes).
    """
    if Path(path).is_file() and is_fit_file(path):
        raise ResultsError(f"{path} is a fit file (the JSON `truncsens fit` writes), not a results file: "
                           f"`truncsens recommend-window {path}` reads it")


def datasets_of(items: Results | Sequence[Results]) -> tuple[list[xr.Dataset], list[str]]:
    """The datasets of one or several results, and their sources: a path is loaded (:func:`load`) and
    its source is the path as given; a Dataset is taken as it is, with source "" (held in memory).

    Raises:
        ValueError: no results given.
        FileNotFoundError, truncsens.results.ResultsError: as :func:`load`; a fit file given as results.
    """
    items = [items] if isinstance(items, (str, Path, xr.Dataset)) else list(items)
    if not items:
        raise ValueError("no results given: pass a results file, a Dataset, or a list of them")
    datasets, sources = [], []
    for item in items:
        in_memory = isinstance(item, xr.Dataset)
        if not in_memory:
            refuse_fit_file(item)
        datasets.append(item if in_memory else load(item))
        sources.append("" if in_memory else str(item))
    return datasets, sources
