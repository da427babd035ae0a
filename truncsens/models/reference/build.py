"""Install a trained reference model: copy its checkpoint folder (weights, tokenizer, card) into the
package's bundled copy, ``truncsens/models/reference/weights``. Training is
:mod:`truncsens.models.reference.train`; the whole build (train, evaluate, card, install) is
:func:`truncsens.api.reference.train_reference`."""

from __future__ import annotations

import shutil
from pathlib import Path


def install_reference(folder: str | Path) -> Path:
    """Copy every file of ``folder`` into :data:`truncsens.models.REFERENCE_DIR` (created if missing)
    and return that folder."""
    from truncsens import models  # read at call time: tests point REFERENCE_DIR elsewhere

    target = models.REFERENCE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for f in Path(folder).iterdir():
        shutil.copy(f, target / f.name)
    return target
