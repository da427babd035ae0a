"""The per-head figure of ``truncsens certify-attribution``: where attribution is lost.

For every (layer, head), the attribution AUC (eviction-caused vs inherent failures, poisson, pooled
over budgets) of that head's true error ‖ô − o‖/‖o‖ (an ORACLE: it reads the full-cache output) beside
that of its certificate r_EB/‖ô‖ (:func:`truncsens.certificates.attribution_scores.head_aucs`). A head
where the oracle stands far above the certificate is one whose error the kept set cannot see. Drawn
on a :class:`matplotlib.figure.Figure` (no pyplot global state).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def heads_paths(stem: str | Path) -> list[Path]:
    """The files :func:`save_heads` writes: ``<stem>-attribution-heads.png`` and ``.pdf``."""
    stem = Path(stem)
    return [stem.with_name(stem.name + f"-attribution-heads.{ext}") for ext in ("png", "pdf")]


def heads_figure(heads: dict, title: str = ""):
    """A Figure of grouped bars, one group per (layer, head): oracle error and certificate AUC.

    Args:
        heads: {"oracle_error": [L][H], "certificate": [L][H]} AUCs (NaN bars are left out).

    Returns:
        matplotlib.figure.Figure.
    """
    from matplotlib.figure import Figure

    oracle, cert = np.asarray(heads["oracle_error"], float), np.asarray(heads["certificate"], float)  # [L, H]
    L, H = oracle.shape
    x = np.arange(L * H)
    fig = Figure(figsize=(max(4.0, 0.32 * L * H + 1.5), 3.2))
    ax = fig.add_subplot()
    ax.bar(x - 0.2, oracle.ravel(), 0.4, label="true error ||o_hat - o||/||o|| (ORACLE)", color="0.45")
    ax.bar(x + 0.2, cert.ravel(), 0.4, label="certificate r_EB/||o_hat||", color="tab:blue")
    ax.axhline(0.5, color="k", lw=0.8, ls=":")
    ax.set_xticks(x, [f"{layer}.{h}" for layer in range(L) for h in range(H)], fontsize=7, rotation=90)
    ax.set_xlabel("layer.head")
    ax.set_ylabel("attribution AUC")
    ax.set_ylim(0, 1.18)
    ax.set_title(title or "attribution AUC per head (poisson, pooled over budgets)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    return fig


def save_heads(heads: dict, stem: str | Path, title: str = "") -> list[Path]:
    """Write :func:`heads_figure` to the two files of :func:`heads_paths` and return them."""
    paths = heads_paths(stem)
    fig = heads_figure(heads, title)
    for path in paths:
        fig.savefig(path, dpi=120)
    return paths
