"""Where a reference-model run starts when it skips the main stage (``--init-from``): the weights and
tokenizer of an exported model folder, checked against the recipe's model. Training itself is
:mod:`truncsens.models.reference.train`.
"""

from __future__ import annotations

from pathlib import Path


class TrainError(ValueError):
    """Training cannot go on as asked (a checkpoint of another recipe in the working folder, or a
    starting model that does not fit)."""


def init_folder(init_from: str) -> Path:
    """The model folder named by ``init_from``: ``"reference"`` is the bundled weights."""
    from truncsens import models  # read at call time: tests point REFERENCE_DIR elsewhere

    return models.REFERENCE_DIR if init_from == "reference" else Path(init_from)


def start_from(init_from: str, recall_steps: int, out: Path) -> tuple[dict, str]:
    """The weights ``init_from`` names (name -> tensor) and the folder's checkpoint SHA-256 (the id
    results files record as ``model_sha256``, :func:`truncsens.models.identity.checkpoint_sha256`);
    copies its tokenizer files into ``out/final`` so the run uses that tokenizer.

    Raises:
        TrainError: no recall stage to train, or the folder lacks ``model.safetensors`` / ``tokenizer.json``.
    """
    import shutil

    from safetensors.torch import load_file

    from truncsens.models.identity import checkpoint_sha256

    if recall_steps <= 0:
        raise TrainError(f"init_from={init_from!r} (--init-from {init_from}) starts the run at the recall stage, which has no steps; "
                         "give --recall-steps")
    folder = init_folder(init_from)
    for name in ("model.safetensors", "tokenizer.json"):
        if not (folder / name).is_file():
            raise TrainError(f"init_from={init_from!r} (--init-from {init_from}): {folder / name} does not exist; give an exported model "
                             "folder (config.json, model.safetensors, tokenizer.json) or 'reference'")
    (out / "final").mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, out / "final" / name)
    return load_file(str(folder / "model.safetensors")), checkpoint_sha256(folder)


def load_start(model, weights: dict, init_from: str) -> None:
    """Copy ``weights`` (bfloat16 or float32) into ``model``; the tied ``lm_head.weight`` may be absent.

    Raises:
        TrainError: missing or unexpected tensors, or shapes that differ from this recipe's model.
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(weights) - {"lm_head.weight"})
    extra = sorted(set(weights) - set(own))
    shapes = sorted(k for k in set(own) & set(weights) if tuple(own[k].shape) != tuple(weights[k].shape))
    if missing or extra or shapes:
        raise TrainError(f"init_from={init_from!r} (--init-from {init_from}) does not fit this recipe's model "
                         f"(missing {missing[:3]}, unexpected {extra[:3]}, other shapes {shapes[:3]})")
    model.load_state_dict(weights, strict=False)  # copies into float32 parameters


FLOOR_LR = 2e-4  # the learning-rate floor of TrainConfig.min_lr's default, which every run of the installed model used

STAGE_FIELDS = ("init_from", "recall_steps", "recall_warm_steps", "recall_warm_context", "recall_warm_doublings",
                "recall_name_words", "recall_kv_share", "recall_repeat_share", "recall_repeat_spans",
                "recall_repeat_min_distance", "recall_induction_share", "recall_lr", "min_lr", "seed", "bf16_autocast",
                "stage_name")  # what the card says of an earlier recall stage
MAIN_FIELDS = ("max_steps", "warm_steps", "warm_context", "repeat_share", "kv_share", "lr", "min_lr", "seed", "context",
               "recall_steps", "stage_name")  # what the card says of the main stage


def _summary(init_from: str) -> dict | None:
    """The starting folder's ``training_summary.json`` as a dict, or None where it has none."""
    import json

    path = init_folder(init_from) / "training_summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def stage_record(summary: dict) -> dict:
    """The record of the recall-stage run whose ``training_summary.json`` is ``summary``: the
    ``STAGE_FIELDS`` its config names (a field added later is absent) plus ``minutes``,
    ``tokens_seen`` and ``init_sha256``."""
    cfg = summary.get("config", {})
    return {k: cfg[k] for k in STAGE_FIELDS if k in cfg} | {"minutes": summary.get("minutes"),
                                                            "tokens_seen": summary.get("tokens_seen"),
                                                            "init_sha256": summary.get("init_sha256")}


def main_record(summary: dict) -> dict:
    """The record of the from-scratch run whose ``training_summary.json`` is ``summary``: the
    ``MAIN_FIELDS`` of its config (with a recall stage in the same run, its ``recall_*`` fields too)
    plus ``steps``, ``minutes`` and ``tokens_seen`` of the whole run."""
    cfg = summary.get("config", {})
    recall = {k: v for k, v in cfg.items() if k.startswith("recall_")} if cfg.get("recall_steps") else {}
    return {k: cfg[k] for k in MAIN_FIELDS if k in cfg} | recall | {
        "steps": summary.get("steps"), "minutes": summary.get("minutes"), "tokens_seen": summary.get("tokens_seen")}


def earlier_stages(init_from: str) -> list[dict]:
    """The recall stages the starting model was itself trained with, oldest first, each as
    :func:`stage_record` reads it, from the starting folder's ``training_summary.json`` (which lists
    the stages before it the same way). A starting model trained from scratch, or one without a
    summary, has none: ``[]`` (its main stage is :func:`main_stage`)."""
    summary = _summary(init_from)
    if summary is None or not summary.get("config", {}).get("init_from"):
        return []
    return [*summary.get("earlier_stages", []), stage_record(summary)]


def main_stage(init_from: str) -> dict | None:
    """The main stage the starting model descends from: a model trained from scratch is its own main
    stage (:func:`main_record`); one that was itself started from another model passes on the
    record its summary holds (``main_stage``). None where no summary records it (a folder without
    ``training_summary.json``, or one written before this record existed)."""
    summary = _summary(init_from)
    if summary is None:
        return None
    return summary.get("main_stage") if summary.get("config", {}).get("init_from") else main_record(summary)
