"""Model identity by content (a path names no fixed weights): a checkpoint replaced at the same path is noticed
by --resume (weights replaced; config edited) and by every join (compare-policies, --truncation);
the hashes are stable and change with one byte."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import save_tiny_llama
from truncsens import results
from truncsens.engine.config import MeasureConfig, MeasureError
from truncsens.engine.measure import run_measure
from truncsens.engine.run.shards import MeasureInterrupted
from truncsens.models import in_memory_model, load_model
from truncsens.models.identity import checkpoint_files, checkpoint_sha256, state_sha256
from truncsens.results import ResultsError
from truncsens.results.join import join_policy_runs


def _config(model_dir, corpus_dir, out, resume=False, **kw):
    base = dict(reference_context=64, targets_per_doc=3, docs_per_shard=2, progress=False)
    base.update(kw)
    if "policies" not in base:
        base.setdefault("windows", [1, 4, 16])
    return MeasureConfig(model=model_dir, corpus=corpus_dir, out=str(out), resume=resume, **base)


def test_checkpoint_hash_is_stable_and_changes_with_one_byte(tmp_path):
    folder = tmp_path / "ckpt"
    save_tiny_llama(folder)
    first = checkpoint_sha256(folder)
    assert first == checkpoint_sha256(folder) and len(first) == 64
    assert {p.name for p in checkpoint_files(folder)} >= {"config.json", "model.safetensors", "tokenizer.json"}
    (folder / "README.md").write_text("a card does not change the model")
    assert checkpoint_sha256(folder) == first
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    assert checkpoint_sha256(folder) != first


def test_loaded_models_carry_their_content_hash(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir)
    assert loaded.content_sha256 == checkpoint_sha256(tiny_llama_dir)
    memory = in_memory_model(loaded.model, loaded.tokenizer)
    assert memory.content_sha256 == state_sha256(loaded.model)
    with torch.no_grad():
        next(loaded.model.parameters())[0, 0] += 1.0
    assert state_sha256(loaded.model) != memory.content_sha256


def test_resume_refuses_a_checkpoint_replaced_at_the_same_path(corpus_dir, tmp_path):
    """The issue's instance: shards written, the folder replaced by other weights (same architecture,
    another seed), --resume: refused, naming the model; nothing written is lost."""
    folder = tmp_path / "model"
    save_tiny_llama(folder, seed=0)
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_config(str(folder), corpus_dir, out), stop_after_shards=1)
    shutil.rmtree(folder)
    save_tiny_llama(folder, seed=1)
    with pytest.raises(MeasureError, match=r"model '.*model' is not the one the shards .* were computed with"):
        run_measure(_config(str(folder), corpus_dir, out, resume=True))
    assert (tmp_path / "r.nc.shards" / "shard-00000.nc").is_file()
    assert not out.exists()


def test_resume_refuses_a_checkpoint_whose_config_was_edited(corpus_dir, tmp_path):
    """Another instance: the same weights, the config's rope_theta edited in place."""
    folder = tmp_path / "model"
    save_tiny_llama(folder, seed=0)
    out = tmp_path / "r.nc"
    with pytest.raises(MeasureInterrupted):
        run_measure(_config(str(folder), corpus_dir, out), stop_after_shards=1)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 500.0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MeasureError, match="content hash or revision differs"):
        run_measure(_config(str(folder), corpus_dir, out, resume=True))


def _two_runs_from_different_weights(corpus_dir, tmp_path, second: dict):
    folder = tmp_path / "model"
    save_tiny_llama(folder, seed=0)
    a = run_measure(_config(str(folder), corpus_dir, tmp_path / "a.nc", policies=["sink_recent"], budgets=[8, 16],
                            semantics="streaming")).path
    shutil.rmtree(folder)
    save_tiny_llama(folder, seed=1)
    b = run_measure(_config(str(folder), corpus_dir, tmp_path / "b.nc", **second)).path
    return results.load(a), results.load(b)


def test_compare_policies_refuses_runs_of_different_weights_at_one_path(corpus_dir, tmp_path):
    a, b = _two_runs_from_different_weights(corpus_dir, tmp_path, dict(policies=["random"], budgets=[8, 16],
                                                                       semantics="streaming"))
    assert a.attrs["model"] == b.attrs["model"] and a.attrs["model_sha256"] != b.attrs["model_sha256"]
    with pytest.raises(ResultsError, match="model_sha256"):
        join_policy_runs([a, b])


def test_truncation_yardstick_of_different_weights_is_refused(corpus_dir, tmp_path):
    """Another join: compare-policies --truncation with a window run made from other weights."""
    from typer.testing import CliRunner

    from truncsens.cli.main import app

    _two_runs_from_different_weights(corpus_dir, tmp_path, dict(windows=[8, 16]))
    result = CliRunner().invoke(app, ["compare-policies", str(tmp_path / "a.nc"), "--truncation", str(tmp_path / "b.nc")])
    assert result.exit_code == 2
    assert "error: the truncation run and the policy run were made from different weights: model_sha256" in result.output


def test_files_from_before_the_hash_still_join():
    """A file without model_sha256 (written before it existed) is not compared on it."""
    from truncsens.results.join import attr_differences
    import xarray as xr

    old, new = xr.Dataset(attrs={"model": "m"}), xr.Dataset(attrs={"model": "m", "model_sha256": "ab"})
    assert attr_differences(old, new, ("model", "model_sha256")) == []
    assert attr_differences(new, xr.Dataset(attrs={"model": "m", "model_sha256": "cd"}), ("model_sha256",)) == [
        ("model_sha256", "ab", "cd")]
