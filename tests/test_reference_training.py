"""The reference model's trainer and model card (the real training run is marked slow)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import requires_reference
from truncsens.api.reference import doc_clustered_mean_se
from truncsens.models.reference.card import training_runs, write_card
from truncsens.models.reference.train import TrainConfig, _lr_at, crop_at


def test_lr_schedule_warmup_cosine_by_step_only():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, max_minutes=60)
    assert _lr_at(0, cfg) == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert _lr_at(9, cfg) == pytest.approx(1e-3)
    assert _lr_at(60, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert _lr_at(109, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.99)))


def test_lr_schedule_of_the_recall_stage_warms_up_again_and_decays_to_the_floor():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, recall_steps=50, recall_lr=5e-4,
                      recall_warmup_steps=5)
    assert cfg.total_steps == 160
    assert _lr_at(110, cfg) == pytest.approx(1e-4)  # (0 + 1) / 5 of the recall peak
    assert _lr_at(114, cfg) == pytest.approx(5e-4)
    assert _lr_at(135, cfg) == pytest.approx(1e-4 + 0.5 * 4e-4 * (1 + math.cos(math.pi * 20 / 45)))
    assert _lr_at(160, cfg) == pytest.approx(1e-4) and _lr_at(500, cfg) == pytest.approx(1e-4)


def test_an_annealing_recall_stage_decays_from_its_peak_to_a_lower_floor():
    """--min-lr below the recall peak: warm-up to 2e-4, cosine to 1e-5 at the last step."""
    cfg = TrainConfig(min_lr=1e-5, max_steps=100, recall_steps=45, recall_lr=2e-4, recall_warmup_steps=5)
    assert _lr_at(104, cfg) == pytest.approx(2e-4)
    assert _lr_at(125, cfg) == pytest.approx(1e-5 + 0.5 * 1.9e-4 * (1 + math.cos(math.pi * 20 / 40)))
    assert _lr_at(145, cfg) == pytest.approx(1e-5)


def test_a_main_stage_checkpoint_continues_into_the_recall_stage_but_not_a_changed_one():
    cfg = TrainConfig(max_steps=100, recall_steps=30)
    main_only = {k: v for k, v in cfg.recipe().items() if not k.startswith("recall_")}  # an earlier recipe
    assert cfg.differences(main_only, step=100) == []
    assert cfg.differences({**main_only, "recall_steps": 10}, step=100) == []  # its recall stage not begun
    assert cfg.differences({**cfg.recipe(), "recall_kv_share": 0.5}, step=101) == ["recall_kv_share"]
    assert cfg.differences({**cfg.recipe(), "lr": 1.0}, step=3) == ["lr"]


def test_crops_are_short_in_the_warm_phase_with_the_same_tokens_per_step():
    cfg = TrainConfig(context=2048, warm_context=512, warm_steps=400, batch_size=4)
    assert crop_at(0, cfg) == (16, 512) and crop_at(399, cfg) == (16, 512)
    assert crop_at(400, cfg) == (4, 2048)


def test_the_recall_stage_starts_on_short_crops_too():
    cfg = TrainConfig(context=2048, batch_size=4, max_steps=2000, recall_steps=300, recall_warm_context=512,
                      recall_warm_steps=150)
    assert crop_at(1999, cfg) == (4, 2048)
    assert crop_at(2000, cfg) == (16, 512) and crop_at(2149, cfg) == (16, 512)
    assert crop_at(2150, cfg) == (4, 2048) and crop_at(2299, cfg) == (4, 2048)


def test_doc_clustered_mean_se_by_hand():
    values = np.array([1.0, 3.0, 10.0, 4.0])
    mean, se = doc_clustered_mean_se(values, ["a", "a", "b", "c"])
    assert mean == pytest.approx(18 / 4)
    # CR1: residual sums per document (4 - 9, 10 - 4.5, 4 - 4.5) = (-5, 5.5, -0.5); G = 3 documents
    resid = np.array([-5.0, 5.5, -0.5])
    assert se == pytest.approx(math.sqrt(3 / 2 * (resid**2).sum()) / 4)


CARD_EVALS = [{"domain": "code", "n_docs": 3, "n_targets": 12,
               "nll": {"16": [3.5, 0.1], "64": [3.2, 0.1], "256": [3.0, 0.1], "1024": [2.9, 0.1]},
               "gain_shortest_to_max": [0.6, 0.05], "gain_to_max": {"16": [0.6, 0.05], "64": [0.3, 0.04], "256": [0.1, 0.02]}}]
CARD_TASKS = {"reference_context": 2048, "copy": {"correct": 45, "n": 60, "accuracy": 0.75},
              "kv": {"correct": 5, "n": 8, "accuracy": 0.625}}


def card_summary() -> dict:
    """A run trained from scratch: 10 steps (the main stage's 8, then a recall stage of 2 in the same run)."""
    return {"parameters": 1234, "steps": 10, "tokens_seen": 5000, "minutes": 2.0,
            "config": {"num_layers": 2, "hidden_size": 8, "num_heads": 2, "intermediate_size": 16,
                       "vocab_size": 64, "context": 1024, "batch_size": 2, "seed": 0, "max_steps": 8, "lr": 3e-3,
                       "warm_steps": 4, "warm_context": 512, "repeat_share": 0.2, "kv_share": 0.2,
                       "recall_steps": 2, "recall_kv_share": 0.6, "recall_repeat_share": 0.2, "recall_lr": 1e-3}}


def test_write_card(tmp_path):
    text = write_card(tmp_path, CARD_EVALS, card_summary(), CARD_TASKS).read_text()
    assert "| NLL | 3.500 ± 0.100 | 3.200 ± 0.100 | 3.000 ± 0.100 | 2.900 ± 0.100 | 0.600 ± 0.050 |" in text
    assert "| parameters | 1,234 |" in text
    assert "| gain of max over c | 0.600 ± 0.050 | 0.300 ± 0.040 | 0.100 ± 0.020 | 0 | |" in text
    # Wilson's interval by hand: (p + z²/2n ± z·sqrt(p(1 − p)/n + z²/4n²)) / (1 + z²/n), z = 1.959964
    z = 1.959964
    def wilson(k, n):
        p = k / n
        mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return 100 * (mid - half) / (1 + z * z / n), 100 * (mid + half) / (1 + z * z / n)
    assert wilson(45, 60) == pytest.approx((62.77, 84.23), abs=0.01)
    assert "| long-range copy | 45 | 60 | 75.0 % [62.8, 84.2] |" in text
    lo, hi = wilson(5, 8)
    assert f"| key-value recall | 5 | 8 | 62.5 % [{lo:.1f}, {hi:.1f}] |" in text
    assert "(N = 2048)" in text
    assert json.loads((tmp_path / "eval.json").read_text())["evaluations"][0]["domain"] == "code"
    # one run from scratch: the main stage and its own recall stage in one row
    assert "| optimizer steps | 10 in 1 runs (batch 2 x 1024 tokens, or as many tokens in shorter crops) |" in text
    assert ("| main + recall | random initialisation | 10 | 5,000 | 20 % long-range repeats, 20 % key-value recall, the "
            "rest corpus text; 512-token crops for 4 steps, then 1024; then, in the same run, a recall stage of 2 steps: "
            "60 % dense key-value recall, 20 % repeats, the rest corpus text | 0.003, then 0.001 | 0 | 2 |") in text
    assert "| all | | 10 | 5,000 | | | | 2 (0.0 hours) |" in text


def test_card_lists_every_run_of_a_chain_with_totals(tmp_path):
    """A run started from another model: the main stage and the earlier recall stages its summary
    carries, one row each, and the totals over all of them; a missing record makes them 'at least'."""
    main = {"max_steps": 2000, "warm_steps": 400, "warm_context": 512, "repeat_share": 0.2, "kv_share": 0.2,
            "lr": 3e-3, "seed": 0, "context": 2048, "steps": 2000, "minutes": 305.2, "tokens_seen": 16_384_000}
    first = {"init_from": "reference", "recall_steps": 800, "recall_warm_steps": 600, "recall_warm_context": 256,
             "recall_warm_doublings": 2, "recall_name_words": 20, "recall_kv_share": 0.6, "recall_repeat_share": 0.2,
             "recall_lr": 1e-3, "seed": 0, "minutes": 99.4, "tokens_seen": 6_553_600, "init_sha256": "cd" * 32,
             "stage_name": "recall"}
    summary = card_summary()
    summary["config"] |= {"init_from": "runs/recall/final", "recall_steps": 30, "recall_warm_steps": 0,
                          "recall_repeat_spans": 16, "recall_repeat_min_distance": 512, "recall_induction_share": 0.3,
                          "seed": 4, "stage_name": "far"}
    summary |= {"steps": 2030, "tokens_seen": 5000, "minutes": 2.4, "init_sha256": "ab" * 32,
                "main_stage": main, "earlier_stages": [first]}
    text = write_card(tmp_path, CARD_EVALS, summary, CARD_TASKS).read_text()
    assert ("| main | random initialisation | 2,000 | 16,384,000 | 20 % long-range repeats, 20 % key-value recall, the "
            "rest corpus text; 512-token crops for 400 steps, then 2048 | 0.003 | 0 | 305 |") in text
    assert ("| recall | main (checkpoint sha256 cdcdcdcdcdcdcdcd…) | 800 | 6,553,600 | 60 % dense key-value recall, "
            "20 % repeats, the rest corpus text; the first 600 steps on crops of 256, 512 and 1024 tokens (200 steps "
            "each), then 1024; names from 20 words | 0.001 | 0 | 99 |") in text  # crops capped at the context
    assert ("| far | recall (checkpoint sha256 abababababababab…) | 30 | 5,000 | 60 % dense key-value recall, 20 % repeats (16 spans "
            "each, 512 tokens back or more), 30 % induction sequences (the same repeats of frequency-drawn spans), the "
            "rest corpus text | 0.001 | 4 | 2 |") in text
    assert "| all | | 2,830 | 22,942,600 | | | | 407 (6.8 hours) |" in text
    assert "decays by cosine to a floor of 0.0002, or to the floor its row names." in text
    summary["config"]["min_lr"] = 1e-5  # an annealing run names its floor; the others keep the stated one
    text = write_card(tmp_path, CARD_EVALS, summary, CARD_TASKS).read_text()
    assert "the rest corpus text | 0.001 (floor 1e-05) | 4 | 2 |" in text and "| 0.001 | 0 | 99 |" in text
    summary["config"]["min_lr"] = 2e-4
    summary["config"]["recall_repeat_share"] = 0.0  # no repeats of corpus text: the span form is the induction's
    text = write_card(tmp_path, CARD_EVALS, summary, CARD_TASKS).read_text()
    assert ("| far | recall (checkpoint sha256 abababababababab…) | 30 | 5,000 | 60 % dense key-value recall, 30 % induction "
            "sequences (repeats of frequency-drawn spans, 16 spans each, 512 tokens back or more), the rest corpus text | "
            "0.001 | 4 | 2 |") in text
    summary["config"]["recall_repeat_share"] = 0.2
    assert "| optimizer steps | 2,830 in 3 runs (batch 2 x 1024 tokens, or as many tokens in shorter crops) |" in text
    assert "| tokens seen | 22,942,600 |" in text
    assert "| training time | 407 minutes on 2 CPU cores (float32); the last run 2 minutes, seed 4" in text
    # a starting model whose summary predates the records: its main stage is not recorded, totals are lower bounds
    del summary["main_stage"]
    first.pop("tokens_seen")
    text = write_card(tmp_path, CARD_EVALS, summary, CARD_TASKS).read_text()
    assert ("| main | random initialisation | not recorded | not recorded | not recorded in the starting model's summary "
            "| not recorded | not recorded | not recorded |") in text
    assert "| recall | `reference` (checkpoint sha256 cdcdcdcdcdcdcdcd…) | 800 | not recorded |" in text
    first |= {"init_sha256_of": "model.safetensors", "recall_warm_steps": 7, "recall_warm_context": 128}
    text = write_card(tmp_path, CARD_EVALS, summary, CARD_TASKS).read_text()
    # crop_at's phases of 7 steps in 3: step k in phase k * 3 // 7, so 3, 2 and 2 steps
    assert ("| recall | `reference` (model.safetensors sha256 cdcdcdcdcdcdcdcd…) | 800 | not recorded | 60 % dense "
            "key-value recall, 20 % repeats, the rest corpus text; the first 7 steps on crops of 128, 256 and 512 "
            "tokens (3, 2 and 2 steps), then 1024;") in text
    assert "the last run's steps, numbered on from the main stage's 8)" in text
    assert "| all | | at least 830 | at least 5,000 | | | | at least 102 (1.7 hours) |" in text
    assert "| optimizer steps | at least 830 in 3 runs" in text


def test_rewrite_card_keeps_the_evaluations_and_names_missing_files(tmp_path):
    from truncsens.api.reference import rewrite_card

    write_card(tmp_path, CARD_EVALS, card_summary(), CARD_TASKS)
    (tmp_path / "training_summary.json").write_text(json.dumps(card_summary() | {"minutes": 75.0}))
    (tmp_path / "README.md").write_text("old card")
    before = json.loads((tmp_path / "eval.json").read_text())
    text = rewrite_card(tmp_path).read_text()
    assert "| all | | 10 | 5,000 | | | | 75 (1.2 hours) |" in text  # the folder's summary, not eval.json's copy
    after = json.loads((tmp_path / "eval.json").read_text())
    assert after["evaluations"] == before["evaluations"] and after["tasks"] == before["tasks"]
    from typer.testing import CliRunner

    from truncsens.cli.main import app

    r = CliRunner().invoke(app, ["train-reference", "--rewrite-card", str(tmp_path)])
    assert r.exit_code == 0 and "model card written again" in r.stdout
    (tmp_path / "eval.json").unlink()
    with pytest.raises(FileNotFoundError, match="eval.json does not exist"):
        rewrite_card(tmp_path)
    r = CliRunner().invoke(app, ["train-reference", "--rewrite-card", str(tmp_path)])
    assert r.exit_code == 2 and "eval.json does not exist" in r.stderr and (tmp_path / "README.md").read_text() == text
    (tmp_path / "eval.json").write_text("{}")
    r = CliRunner().invoke(app, ["train-reference", "--rewrite-card", str(tmp_path)])
    assert r.exit_code == 2 and "eval.json has no list 'evaluations'" in r.stderr
    (tmp_path / "eval.json").write_text(json.dumps({"evaluations": []}))
    (tmp_path / "training_summary.json").write_text("[]")
    r = CliRunner().invoke(app, ["train-reference", "--rewrite-card", str(tmp_path)])
    assert r.exit_code == 2 and "training_summary.json has no 'config'" in r.stderr
    assert (tmp_path / "README.md").read_text() == text  # nothing rewritten by a refused call


def test_the_stage_name_is_a_label_not_part_of_the_recipe():
    named = TrainConfig(stage_name="far-induction")
    assert "stage_name" not in named.recipe() and named.differences(TrainConfig().recipe(), 2500) == []


def test_the_installed_card_is_the_card_of_its_records(tmp_path):
    """The bundled card is what this version's card writer makes of the bundled eval.json and
    training_summary.json (regenerated, not edited), and it counts all four runs."""
    import shutil

    from truncsens import models
    from truncsens.api.reference import rewrite_card

    for name in ("README.md", "eval.json", "training_summary.json"):
        shutil.copy(models.REFERENCE_DIR / name, tmp_path / name)
    assert rewrite_card(tmp_path).read_text() == (models.REFERENCE_DIR / "README.md").read_text()
    summary = json.loads((models.REFERENCE_DIR / "training_summary.json").read_text())
    runs = training_runs(summary)
    assert [r["name"] for r in runs] == ["main", "recall", "induction", "far-induction"]
    assert [r["steps"] for r in runs] == [2000, 800, 1000, 600]


@pytest.mark.slow
def test_train_tiny_reference(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from truncsens.models.reference.train import train

    final = train(TrainConfig(out_dir=str(tmp_path), vocab_size=300, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2, context=64, batch_size=2, max_steps=3, eval_every=3,
                              eval_sequences=4, warmup_steps=1, recall_steps=0))
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.max_position_embeddings == 64 and len(tok) == 300
    assert len((tmp_path / "train_log.csv").read_text().splitlines()) == 2


@pytest.mark.slow
def test_build_reference_trains_evaluates_and_installs(tmp_path, monkeypatch):
    import json

    import truncsens.models
    from truncsens.api.reference import build_reference
    from truncsens.models.reference.train import TrainConfig

    monkeypatch.setattr(truncsens.models, "REFERENCE_DIR", tmp_path / "installed")
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, context=300, batch_size=2, max_steps=2, eval_every=2, eval_sequences=2, warmup_steps=1,
                      recall_steps=0)
    final, installed, summary = build_reference(cfg, install=True)
    assert summary["finished"]
    assert installed == tmp_path / "installed"
    card = json.loads((installed / "eval.json").read_text())
    assert [e["domain"] for e in card["evaluations"]] == ["code", "nl"]
    assert set(card["evaluations"][0]["nll"]) == {"16", "64", "256", "300"}
    assert (installed / "README.md").read_text().startswith("# truncsens reference model")
    assert sorted(p.name for p in final.iterdir()) == sorted(p.name for p in installed.iterdir())


@requires_reference
def test_committed_reference_model_uses_long_context():
    """The model card's bar, recomputed on a smaller sample: on held-out code, NLL with the maximum
    context (2,048) is at least 0.25 nats below NLL with 16 tokens, and below NLL with 64 tokens.
    (The card's gain from 256 tokens is too small a margin to assert on a sample this size.)"""
    from truncsens.models import load_model
    from truncsens.api.reference import context_nll

    ev = context_nll(load_model("reference"), "code", [16, 64], targets_per_doc=2, seed=1)
    nll = {int(k): v[0] for k, v in ev["nll"].items()}
    assert ev["gain_shortest_to_max"][0] >= 0.25
    assert max(nll) == 2048 and nll[2048] < nll[64] < nll[16]


def tiny_config(out_dir, **kw) -> TrainConfig:
    return TrainConfig(out_dir=str(out_dir), vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=2, context=128, warm_context=64, warm_steps=2, batch_size=2, max_steps=4,
                       eval_every=2, eval_sequences=2, warmup_steps=1, threads=1,
                       **{"recall_steps": 2, "recall_warmup_steps": 1, "recall_warm_context": 64, "recall_warm_steps": 1, **kw})


@pytest.mark.slow
def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """Stopped after step 1, 3 and 5 (inside and after the short-crop warm phase, inside the recall
    stage), resumed each time: the same weights, bit for bit, as one run of 4 + 2 steps; a changed
    recipe is refused."""
    import torch
    from safetensors.torch import load_file

    from truncsens.models.reference.train import TrainError, train

    whole = train(tiny_config(tmp_path / "whole"))
    for stop in (1, 3, 5, 0):
        parts = train(tiny_config(tmp_path / "parts", stop_at_step=stop))
    a, b = load_file(whole / "model.safetensors"), load_file(parts / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.load(tmp_path / "parts" / "checkpoint.pt", weights_only=False)["step"] == 6
    log = (tmp_path / "parts" / "train_log.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in log[1:]] == ["2", "4", "6"]
    with pytest.raises(TrainError, match="lr differ"):
        train(tiny_config(tmp_path / "parts", lr=1e-2))


def test_recall_warm_crops_double_in_equal_phases():
    """recall_warm_doublings = 2 from 384: the 300 warm steps in three phases of 100 steps with crops
    384, 768, 1536 (tokens per step kept: 4 x 2048 // crop sequences), then the full context."""
    cfg = TrainConfig(context=2048, batch_size=4, max_steps=2000, recall_steps=900, recall_warm_context=384,
                      recall_warm_steps=300, recall_warm_doublings=2)
    assert crop_at(2000, cfg) == (4 * 5, 384) and crop_at(2099, cfg) == (20, 384)
    assert crop_at(2100, cfg) == (4 * 2, 768) and crop_at(2199, cfg) == (8, 768)
    assert crop_at(2200, cfg) == (4, 1536) and crop_at(2299, cfg) == (4, 1536)
    assert crop_at(2300, cfg) == (4, 2048)
    capped = TrainConfig(context=2048, warm_steps=0, max_steps=10, recall_steps=10, recall_warm_context=1024,
                         recall_warm_steps=4, recall_warm_doublings=2)  # 1024, 2048, then capped at 2048
    assert [crop_at(10 + s, capped)[1] for s in range(4)] == [1024, 1024, 2048, 2048]


def test_a_checkpoint_recipe_without_later_fields_counts_their_defaults():
    """A recall-stage checkpoint written before recall_warm_doublings / recall_name_words existed
    resumes under the defaults (it ran with them) and differs from any other value."""
    cfg = TrainConfig(max_steps=10, recall_steps=5)
    old = {k: v for k, v in cfg.recipe().items() if k not in ("recall_warm_doublings", "recall_name_words")}
    assert cfg.differences(old, 12) == []
    other = TrainConfig(max_steps=10, recall_steps=5, recall_name_words=20)
    assert other.differences(old, 12) == ["recall_name_words"]
    assert other.differences(old, 10) == []  # the main stage alone: recall fields do not count yet


def test_init_from_is_refused_without_a_recall_stage_or_its_files(tmp_path):
    from truncsens.models.reference.start import TrainError, init_folder, start_from

    with pytest.raises(TrainError, match="give --recall-steps"):
        start_from(str(tmp_path), 0, tmp_path / "run")
    (tmp_path / "model").mkdir()
    with pytest.raises(TrainError, match="model.safetensors does not exist"):
        start_from(str(tmp_path / "model"), 5, tmp_path / "run")
    from truncsens.models.reference.train import train

    with pytest.raises(TrainError, match="give --recall-steps"):  # refused before the folder records a config
        train(TrainConfig(out_dir=str(tmp_path / "run2"), init_from="reference", recall_steps=0))
    assert not (tmp_path / "run2" / "train_config.json").exists()
    import truncsens.models

    assert init_folder("reference") == truncsens.models.REFERENCE_DIR
    assert init_folder(str(tmp_path)) == tmp_path


def test_shares_and_learning_rates_are_checked_before_anything_is_written(tmp_path):
    from typer.testing import CliRunner

    from truncsens.cli.main import app
    from truncsens.models.reference.start import TrainError

    with pytest.raises(TrainError, match="recall stage's data mix: shares .* repeat=0.5, kv=0.6"):
        TrainConfig(recall_repeat_share=0.5, recall_kv_share=0.6)
    with pytest.raises(TrainError, match="main stage's data mix"):
        TrainConfig(kv_share=-0.1)
    with pytest.raises(TrainError, match="recall_lr must be > 0, got 0"):
        TrainConfig(recall_lr=0.0)
    with pytest.raises(TrainError, match=r"min_lr \(the learning-rate floor, 0.0005\) must not exceed recall_lr "
                                         r"\(a peak that decays to it, 0.0003\)"):
        TrainConfig(recall_steps=10, recall_lr=3e-4, min_lr=5e-4)
    assert TrainConfig(recall_lr=3e-4, min_lr=5e-4).min_lr == 5e-4  # no recall stage: its peak decays to nothing
    with pytest.raises(TrainError, match="must not exceed lr"):
        TrainConfig(lr=1e-4)
    assert TrainConfig(init_from="reference", recall_steps=10, recall_lr=5e-3, min_lr=4e-3).min_lr == 4e-3  # no main stage
    assert TrainConfig(recall_repeat_share=0.4, recall_kv_share=0.6).recall_kv_share == 0.6  # sum 1 is allowed
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train-reference", "--out-dir", str(out), "--init-from", "reference",
                                 "--recall-steps", "5", "--recall-kv-share", "0.9"])
    assert r.exit_code == 2 and "error: the recall stage's data mix" in r.stderr and not out.exists()
    with pytest.raises(TrainError, match="at least 2 name words"):
        TrainConfig(recall_name_words=1)
    with pytest.raises(TrainError, match="recall stage's data mix: repeats need .* repeat_min_distance=0"):
        TrainConfig(recall_repeat_min_distance=0)
    r = CliRunner().invoke(app, ["train-reference", "--out-dir", str(out), "--init-from", "reference",
                                 "--recall-steps", "5", "--recall-repeat-spans", "0"])
    assert r.exit_code == 2 and "repeat_spans=0" in r.stderr and not out.exists()
    far = TrainConfig(recall_repeat_spans=16, recall_repeat_min_distance=512).recall_mix()
    assert (far.repeat_spans, far.repeat_min_distance, far.dense_kv) == (16, 512, True)
    assert TrainConfig(recall_induction_share=0.2).recall_mix().induction == 0.2
    r = CliRunner().invoke(app, ["train-reference", "--out-dir", str(out), "--init-from", "reference",
                                 "--recall-steps", "5", "--recall-induction-share", "0.5"])  # 0.6 + 0.2 + 0.5 > 1
    assert r.exit_code == 2 and "induction=0.5" in r.stderr and not out.exists()
    r = CliRunner().invoke(app, ["train-reference", "--out-dir", str(out), "--init-from", "reference",
                                 "--recall-steps", "5", "--recall-lr", "1e-4", "--min-lr", "2e-4"])
    assert r.exit_code == 2 and "must not exceed recall_lr" in r.stderr and not out.exists()


def test_load_start_copies_bf16_weights_and_refuses_another_shape():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from truncsens.models.reference.start import TrainError, load_start

    def tiny(hidden):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))

    source = {k: v.to(torch.bfloat16) for k, v in tiny(16).state_dict().items() if k != "lm_head.weight"}
    model = tiny(16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_start(model, source, "x")
    own = model.state_dict()
    assert all(torch.equal(own[k], source[k].float()) for k in source)
    assert torch.equal(own["lm_head.weight"], own["model.embed_tokens.weight"])  # tied
    with pytest.raises(TrainError, match="does not fit"):
        load_start(tiny(32), source, "x")
    with pytest.raises(TrainError, match="missing"):
        load_start(tiny(16), {k: v for k, v in source.items() if "mlp" not in k}, "x")


@pytest.mark.slow
def test_a_run_started_from_an_exported_model_trains_only_the_recall_stage(tmp_path):
    """--init-from: a main-stage-only run's export starts a second run at step max_steps with its
    tokenizer; the second run logs and checkpoints only the recall steps and changes the weights."""
    import json

    import torch
    from safetensors.torch import load_file

    from truncsens.models.reference.train import train

    main = train(tiny_config(tmp_path / "main", recall_steps=0))
    recall = train(tiny_config(tmp_path / "recall", init_from=str(main)))
    assert (recall / "tokenizer.json").read_bytes() == (main / "tokenizer.json").read_bytes()
    assert torch.load(tmp_path / "recall" / "checkpoint.pt", weights_only=False)["step"] == 6
    log = (tmp_path / "recall" / "train_log.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in log[1:]] == ["6"]
    a, b = load_file(main / "model.safetensors"), load_file(recall / "model.safetensors")
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((recall / "training_summary.json").read_text())
    from truncsens.models.identity import checkpoint_sha256

    assert summary["finished"] and summary["init_sha256"] == checkpoint_sha256(main)
    assert summary["earlier_stages"] == []  # the main-stage run started from nothing
    main_summary = json.loads((main / "training_summary.json").read_text())
    assert summary["main_stage"] == {"max_steps": 4, "warm_steps": 2, "warm_context": 64, "repeat_share": 0.2,
                                     "kv_share": 0.2, "lr": 3e-3, "seed": 0, "context": 128, "recall_steps": 0,
                                     "stage_name": "", "steps": 4, "minutes": main_summary["minutes"],
                                     "tokens_seen": main_summary["tokens_seen"]}
