"""Conventions shared by every command: list options, output files.

Lists: every option that takes a list accepts repeats **and** commas, in any mix:
``--policy a --policy b`` == ``--policy a,b`` == ``--policy a,b --policy b`` (repeats removed,
first order kept). JSON and figures: ``--json`` prints JSON to stdout instead of the table;
``--json-out PATH`` (``fit``: ``--out``) writes a JSON file; ``--plot`` draws figures and
``--plot-out PREFIX`` says where (``PREFIX.png``, ``PREFIX.pdf``). A command that writes a file
refuses to replace an existing one unless ``--overwrite`` is given, before computing anything
(:func:`truncsens.fits.fit_file.check_new_files`).

Options that several commands declare alike are written once here, as ``Annotated`` types
(``domain: Domain = "code"``): the same flag, the same help text, whatever the command.
"""

from __future__ import annotations

from typing import Annotated, Callable, Optional, Sequence, TypeVar

import typer

T = TypeVar("T")

# options shared by commands (the defaults stay in each signature: they differ between commands)
CertifyModel = Annotated[str, typer.Option(help="'reference' (bundled), a Hugging Face id or a local checkpoint folder (a transformers model that uses the attention interface).")]
Domain = Annotated[str, typer.Option(help="code or nl: picks the default corpus of the domain.")]
Split = Annotated[str, typer.Option(help="heldout, train, all, or auto (held-out for builtin corpora).")]
CertifyBudgets = Annotated[str, typer.Option(help="Comma-separated budgets: token counts or percentages of N.")]
Delta = Annotated[float, typer.Option(help="Miss probability of the certificates, in (0, 1); nominal coverage 1 - delta.")]
CertifySinks = Annotated[int, typer.Option(help="Sinks of poisson and topk.")]
CertifyDevice = Annotated[str, typer.Option(help="cpu, cuda, cuda:N, mps or auto.")]
CertifyDtype = Annotated[str, typer.Option(help="float32, bfloat16, float16 or float64.")]
DesignGranularity = Annotated[str, typer.Option("--granularity", help="Sampling design: 'head' (one per layer and key/value head, from the head's own score) or 'token' (one shared by every layer and head: the ablation, the design of earlier versions).")]
DesignScore = Annotated[str, typer.Option("--score", help="Per-head score of the design: 'window' (attention of the last --obs-window prefill queries), 'h2o' (attention of every prefill query) or 'key_norm'.")]
ObsWindow = Annotated[int, typer.Option("--obs-window", help="W: prefill queries of the 'window' score.")]
Temper = Annotated[float, typer.Option("--temper", help="gamma > 0: inclusion probabilities from score^gamma (below 1 spreads them).")]
TopFraction = Annotated[float, typer.Option("--top-fraction", help="Share of the budget poisson and topk keep surely as the top keys by score.")]
BatchTokens = Annotated[Optional[int], typer.Option(help="Token budget of one forward pass.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its shards.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing results file.")]
Progress = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress on stderr.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON instead of tables.")]


def split_list(values: Optional[Sequence[str]], what: str) -> Optional[list[str]]:
    """Repeated and comma-separated values as one list (blanks dropped, duplicates removed, order kept).

    Args:
        values: what Typer collected from a repeatable option (None when not given).
        what: the option's name, for the error.

    Returns:
        the items, or None when the option was not given.

    Raises:
        ValueError: the option was given but holds no item (e.g. ``--policy ,``).
    """
    if values is None or len(values) == 0:
        return None
    items = [v.strip() for text in values for v in str(text).split(",") if v.strip()]
    if not items:
        raise ValueError(f"{what} is empty")
    return list(dict.fromkeys(items))


def _typed_list(values: Optional[Sequence[str]], what: str, cast: Callable[[str], T], kind: str) -> Optional[list[T]]:
    items = split_list(values, what)
    if items is None:
        return None
    for text in values:  # name the value as typed in the error
        for v in str(text).split(","):
            try:
                cast(v.strip()) if v.strip() else None
            except ValueError:
                raise ValueError(f"{what} must be comma-separated {kind}, got {text!r}") from None
    return list(dict.fromkeys(cast(v) for v in items))


def int_list(values: Optional[Sequence[str]], what: str) -> Optional[list[int]]:
    """:func:`split_list` of whole numbers (``--windows 1,2 --windows 4`` -> [1, 2, 4])."""
    return _typed_list(values, what, int, "whole numbers")


def float_list(values: Optional[Sequence[str]], what: str) -> Optional[list[float]]:
    """:func:`split_list` of numbers (``--eps 0.01,0.05``)."""
    return _typed_list(values, what, float, "numbers")
