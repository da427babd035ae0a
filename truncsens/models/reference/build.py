"""Build the bundled reference model end to end: train, evaluate on held-out text, write the model
card, and (optionally) install it into ``truncsens/models/reference/weights``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from truncsens.models.reference.card import context_nll, write_card
from truncsens.models.reference.train import TrainConfig, train

CARD_CONTEXTS = (16, 64, 256)  # shorter contexts evaluated beside the model's maximum


def build_reference(cfg: TrainConfig, install: bool = False) -> tuple[Path, Path | None]:
    """Train with ``cfg``, evaluate (:func:`truncsens.models.reference.card.context_nll` on both builtin
    domains), write the card into the final checkpoint folder and, with ``install``, copy that
    folder into the package's weights folder.

    Returns:
        (final checkpoint folder, install folder or None).
    """
    from truncsens.models import REFERENCE_DIR, load_model

    final = train(cfg)
    shutil.copy(Path(cfg.out_dir) / "train_log.csv", final / "train_log.csv")
    loaded = load_model(str(final))
    evals = [context_nll(loaded, domain, list(CARD_CONTEXTS)) for domain in ("code", "nl")]
    write_card(final, evals, json.loads((final / "training_summary.json").read_text()))
    if not install:
        return final, None
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    for f in final.iterdir():
        shutil.copy(f, REFERENCE_DIR / f.name)
    return final, REFERENCE_DIR
