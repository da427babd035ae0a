"""Setups research groups have: files another process holds open, failed writes, temporary files."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app

HOLD = """
import sys, time, h5py
f = h5py.File(sys.argv[1], "a")
print("open", flush=True)
time.sleep(60)
"""


@pytest.fixture()
def results_file(tmp_path):
    import numpy as np
    from truncsens.divergences import METRICS

    metrics = {m: np.full((2, 2), 0.25, np.float32) for m in METRICS}
    metrics["top1_agree"] = np.ones((2, 2), np.int8)
    attrs = {a: "x" for a in results.REQUIRED_ATTRS}
    attrs.update(semantics="reencode", positions="original", reference_context=8, n_sink=0, seed=0)
    ds = results.make_results(metrics, "window", [1, 2], ["a", "b"], [8, 9], [1, 2], attrs)
    return results.save(ds, tmp_path / "r.nc")


def test_a_file_open_for_writing_elsewhere_is_reported_as_locked(results_file, monkeypatch):
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(results_file)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(results.ResultsError, match="is locked by another process .* HDF5_USE_FILE_LOCKING=FALSE"):
            results.load(results_file)
        r = CliRunner().invoke(app, ["show", str(results_file)])  # the same through the command line
        assert r.exit_code == 2 and "is locked by another process" in r.stderr and "Traceback" not in r.output
    finally:
        holder.kill()
        holder.wait()
    assert results.load(results_file).sizes["target"] == 2  # readable again once the writer is gone


def test_a_failed_save_leaves_no_temporary_file(results_file, monkeypatch):
    from truncsens.results import paths

    ds = results.load(results_file)

    def broken(path, data):  # the temporary file is half written when the disk fills up
        path.write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(paths, "_write_file", broken)
    with pytest.raises(OSError, match="no space left"):
        results.save(ds, results_file.parent / "new.nc")
    assert sorted(p.name for p in results_file.parent.iterdir()) == ["r.nc"]
