"""``truncsens certify-attribution`` is long (half an hour as the README gives it): it reports progress
on stderr, writes its targets in shards of task documents, keeps them when it is interrupted and says
how to go on, and ``--resume`` gives the same file as an uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import requires_reference
from typer.testing import CliRunner

import truncsens.certificates.attribution_driver as driver
from truncsens import results
from truncsens.api.certify_attribution import certify_attribution
from truncsens.cli.main import app

# reference model, N = 64, 2 corpus documents with 2 copy targets each and 7 key-value documents (one
# target each), 8 task documents per shard: 2 shards; a 2-step trajectory computed once on the merged file
SMALL = ["certify-attribution", "--reference-context", "64", "--max-docs", "2", "--copy-per-doc", "2", "--kv-docs", "7",
         "--budgets", "25%,50%", "--trajectory", "2", "--trajectory-budget", "16"]


def _run(out, *extra):
    return CliRunner().invoke(app, [*SMALL, "--out", str(out), *extra])


def _same_file(a, b) -> None:
    """Every variable and coord bit for bit (NaN where NaN), every attr but when and by which command."""
    assert set(a.variables) == set(b.variables)
    for name in a.variables:
        x, y = a[name].values, b[name].values
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
    ignore = {"created", "command"}
    assert {k: v for k, v in a.attrs.items() if k not in ignore} == {k: v for k, v in b.attrs.items() if k not in ignore}


@requires_reference
def test_progress_interruption_and_resume_give_the_uninterrupted_file(tmp_path, monkeypatch):
    full = tmp_path / "full.nc"
    done = _run(full)  # progress on (the default): stderr is a pipe here, so one line per stage and per shard
    assert done.exit_code == 0, done.output
    lines = done.stderr.splitlines()
    assert lines[:3] == ["certify-attribution: loading model reference",
                         lines[1], "certify-attribution: building the task set: copy targets of 2 documents, "
                                   "7 key-value documents"]
    assert lines[1].startswith("certify-attribution: tokenizing ") and " documents of corpus " in lines[1]
    # 64 + 3 policies x 2 budgets = 70 tokens per target: the first shard's 10 targets (2 copy documents x 2
    # and 6 key-value documents), then the last key-value document's 1
    shards = [ln.split(", ")[:2] for ln in lines[3:5]]
    assert shards == [["certify-attribution: shard 1/2 done", "700/770 tokens"],
                      ["certify-attribution: shard 2/2 done", "770/770 tokens"]]
    assert lines[5:] == ["certify-attribution: greedy trajectory of 2 steps",
                         "note: 3 corpus files skipped (3 empty), not measured"]  # the builtin corpus's empty files
    ds_full = results.load(full)
    assert ds_full.attrs["n_docs"] == 9 and ds_full.sizes["target"] == 11 and "trajectory" in ds_full.attrs
    assert list(ds_full["task_kind"].values)[-1] == "kv"

    # interrupted (Ctrl-C) while the second shard is computed
    real, calls = driver.compute_arrays, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    part = tmp_path / "part.nc"
    monkeypatch.setattr(driver, "compute_arrays", interrupted)
    stopped = _run(part, "--no-progress")
    assert stopped.exit_code != 0 and not part.exists()
    kept = tmp_path / "part.nc.shards"
    assert sorted(p.name for p in kept.glob("shard-*.nc")) == ["shard-00000.nc"]
    assert (f"note: 1 finished shard(s) kept in {kept}; rerun the same command with --resume to continue"
            in stopped.stderr)
    monkeypatch.setattr(driver, "compute_arrays", real)

    again = _run(part, "--no-progress")  # without --resume: refused, the shard stays
    assert again.exit_code == 2 and "error: an earlier run left shards in" in again.stderr
    assert (kept / "shard-00000.nc").is_file()

    resumed = _run(part, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "certify-attribution: shard 1/2 reused" in resumed.stderr and not kept.exists()
    assert resumed.stdout.splitlines()[1:] == done.stdout.splitlines()[1:]  # all but the files written
    _same_file(ds_full, results.load(part))


def test_resume_needs_an_output_file():
    with pytest.raises(ValueError, match="resume continues an interrupted results file: give out=PATH"):
        certify_attribution("reference", resume=True)
