"""Faults that used to crash or print library output: a full disk (before and during a write, shards
and the final merge), a model on the ``meta`` device, and the libraries' notices before the one
``error:`` line. Each ends in one clear error; no temporary file or lock is left behind and the
shards already written stay."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.errors import library_notices_silenced
from truncsens.cli.main import app
from truncsens.engine.run.lock import OutputLock
from truncsens.fits.fit_file import write_json
from truncsens.models import ModelLoadError
from truncsens.results import paths
from truncsens.results.constructed import curve_results
from truncsens.results.paths import NoSpaceError

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
RUN = ["measure", "--model", "synthetic:0.5", "--max-docs", "4", "--docs-per-shard", "2", "--no-progress"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def error_line(result) -> str:
    """Exit code 2 and exactly one `error: ...` line, no traceback; returns that line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def files_under(folder: Path) -> list[str]:
    """Every file and folder under ``folder`` (hidden temporaries included), relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def small_results():
    return curve_results({"tv": lambda w: 0.1 * w**-0.5}, [1, 2, 4], n_docs=2)


# -- a full disk ---------------------------------------------------------------------------------

def test_save_onto_a_full_device_is_one_error_naming_the_path(tmp_path):
    # a real ENOSPC from the kernel: the temporary file of this process is made a link to /dev/full
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    out = tmp_path / "r.nc"
    os.symlink("/dev/full", tmp_path / f".r.nc.{os.getpid()}.tmp")
    with pytest.raises(NoSpaceError) as info:
        results.save(small_results(), out)
    assert str(info.value) == f"cannot write {out}: no space left on device; free some space and rerun"
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert files_under(tmp_path) == []  # the temporary (here the link) is removed, nothing written


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    ds = small_results()
    size = results.save(ds, tmp_path / "sized.nc").stat().st_size  # the bytes a save of ds writes
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=size - 1))
    with pytest.raises(NoSpaceError) as info:
        results.save(ds, tmp_path / "sub" / "r.nc")
    assert str(info.value) == (f"cannot write {tmp_path / 'sub' / 'r.nc'}: no space left on device "
                               f"({size:,} bytes needed, {size - 1:,} free); free some space and rerun")
    assert files_under(tmp_path) == ["sized.nc", "sub"]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=size))  # exactly enough
    assert results.load(results.save(ds, tmp_path / "sub" / "r.nc")).identical(results.load(tmp_path / "sized.nc"))


def test_netcdf_bytes_of_older_xarray_read_back_the_same(tmp_path):
    # xarray < 2025.8 gives no h5netcdf bytes from to_netcdf(): the store path must write the same file
    from truncsens.results import files

    ds = small_results()
    (tmp_path / "store.nc").write_bytes(files._netcdf_bytes_through_store(files._encode(ds)))
    results.save(ds, tmp_path / "save.nc")
    assert results.load(tmp_path / "store.nc").identical(results.load(tmp_path / "save.nc"))


def test_full_disk_before_a_shard_keeps_the_shards_written_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "run.nc"
    first = tmp_path / "run.nc.shards" / "shard-00000.nc"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0 if first.exists() else real(p).free))
    line = error_line(invoke(*RUN, "--out", out))
    # the last shard is merged from memory, so the write that meets the full disk is the results file's; the
    # shard is then kept for --resume only if it can be written (here it cannot: shard 0 alone is kept)
    assert line.startswith(f"error: cannot write {out}: no space left on device (")
    assert line.endswith(" bytes needed, 0 free); free some space and rerun")
    assert files_under(tmp_path) == ["run.nc.shards", "run.nc.shards/run.json", "run.nc.shards/shard-00000.nc"]
    monkeypatch.setattr(shutil, "disk_usage", real)  # space freed: --resume finishes with the shard kept
    resumed = invoke(*RUN, "--out", out, "--resume")
    assert resumed.exit_code == 0 and "1 shard reused" in resumed.stdout, resumed.output
    assert invoke(*RUN, "--out", tmp_path / "whole.nc").exit_code == 0
    a, b = results.load(out), results.load(tmp_path / "whole.nc")
    for name in ("tv", "kl"):
        np.testing.assert_array_equal(a[name].values, b[name].values)
    assert files_under(tmp_path) == ["run.nc", "whole.nc"]


def test_full_disk_during_the_merge_leaves_no_temporary_file_or_lock(tmp_path, monkeypatch):
    out = tmp_path / "run.nc"
    real = paths._write_file

    def write(path, data):  # the disk fills up half way through the merged file
        if path.name.startswith(".run.nc."):
            real(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(paths, "_write_file", write)
    result = invoke(*RUN, "--out", out)
    assert error_line(result) == f"error: cannot write {out}: no space left on device; free some space and rerun"
    assert "note: 2 finished shard(s) kept" in result.stderr
    assert files_under(tmp_path) == ["run.nc.shards", "run.nc.shards/run.json", "run.nc.shards/shard-00000.nc",
                                     "run.nc.shards/shard-00001.nc"]


def test_full_disk_while_taking_the_lock_leaves_no_lock_file(tmp_path, monkeypatch):
    real = os.write

    def write(fd, data):
        if data.startswith(b'{"pid"'):  # the lock's record of its owner
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(NoSpaceError, match=rf"^cannot write {tmp_path / 'run.nc.lock'}: no space left on device;"):
        with OutputLock(tmp_path / "run.nc"):
            pass
    assert files_under(tmp_path) == []


def test_fit_file_onto_a_full_disk(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10))
    # '{', ' "a": [', '  1,', '  2', ' ]', '}' on 6 lines: 1 + 7 + 4 + 3 + 2 + 1 characters and 5 newlines
    with pytest.raises(NoSpaceError, match=r"no space left on device \(23 bytes needed, 10 free\)"):
        write_json({"a": [1, 2]}, tmp_path / "fit.json")
    assert files_under(tmp_path) == []


# -- a model on the meta device -------------------------------------------------------------------

def _llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def test_model_on_the_meta_device_is_refused_by_name_before_hashing():
    import truncsens
    from conftest import build_tokenizer

    tok = build_tokenizer()
    with torch.device("meta"):
        model = _llama(len(tok))
    texts = ["alpha beta gamma " * 60]
    # 21 tensors: embeddings, 2 layers x (q, k, v, o, gate, up, down, 2 norms), final norm, lm_head
    with pytest.raises(ModelLoadError, match=r"^model 'LlamaForCausalLM \(passed in memory\)' has 21 of its 21 weight "
                                             r"tensors on the 'meta' device \(first: model\.embed_tokens\.weight\)"):
        truncsens.measure(model, tok, texts=texts, reference_context=64, windows=[4], progress=False)
    model = _llama(len(tok))  # materialized, but for one tensor
    model.lm_head.weight = torch.nn.Parameter(torch.empty(model.lm_head.weight.shape, device="meta"))
    with pytest.raises(ModelLoadError, match=r"has 1 of its 21 weight tensors on the 'meta' device \(first: lm_head\.weight\)"):
        truncsens.measure(model, tok, texts=texts, reference_context=64, windows=[4], progress=False)


# -- the libraries' notices -----------------------------------------------------------------------

def test_library_notices_are_silenced_and_errors_are_not(caplog):
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with library_notices_silenced():
            logging.getLogger("kernels._internals.hf_hub").warning("Skipping publisher trust check for 'x'")
            logging.getLogger("transformers.modeling_utils").info("loading weights")
            warnings.warn_explicit("a deprecation", FutureWarning, "transformers/modeling_utils.py", 1, module="transformers")
            warnings.warn_explicit("our own", UserWarning, "truncsens/engine/measure.py", 1, module="truncsens.engine.measure")
            logging.getLogger("transformers").error("a real error")
        logging.getLogger("kernels._internals.hf_hub").warning("after")  # restored once the command is over
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("transformers", "a real error"),
                                                                 ("kernels._internals.hf_hub", "after")]
    assert [str(w.message) for w in caught] == ["our own"]


def test_failing_local_checkpoint_prints_only_truncsens_lines(tmp_path):
    # A GPT-Neo checkpoint (importing its modeling module asks `kernels`, when installed, for flash-attention
    # kernels: offline, each says "Skipping publisher trust check ...") whose config warns on load (token
    # ids outside the vocabulary) and whose weights file is damaged.
    from transformers import GPTNeoConfig

    from conftest import build_tokenizer

    folder = tmp_path / "neo"
    tok = build_tokenizer()
    GPTNeoConfig(vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                 max_position_embeddings=128, window_size=16, architectures=["GPTNeoForCausalLM"]).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x10" * 1000)
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma delta " * 100)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "truncsens.cli.main", "measure", "--model", str(folder), "--corpus",
                           str(corpus), "--reference-context", "64", "--windows", "4", "--no-progress", "--out",
                           str(tmp_path / "o.nc")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"error: cannot read the weights of {folder}: the .safetensors file is damaged (")
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert files_under(tmp_path) == ["c.txt", "neo", *(f"neo/{p.name}" for p in sorted(folder.iterdir()))]
