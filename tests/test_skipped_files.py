"""Corpus files a run leaves out (binary, not UTF-8, hidden, unreadable such as a broken link) were
counted only in the attr ``files_skipped``: ``measure`` now says on stderr how many and why, and
``show`` prints it under its first line (with the documents too short for N, which ``measure``
already printed); a run that skips nothing prints nothing new."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app

SKIPPED = "4 corpus files skipped (1 binary, 1 hidden, 1 not_utf8, 1 unreadable)"


def _measure(model_dir, corpus, out):
    return CliRunner().invoke(app, ["measure", "--model", model_dir, "--corpus", str(corpus), "--reference-context", "64",
                                    "--windows", "1,8", "--targets-per-doc", "1", "--no-progress", "--out", str(out)])


def test_skipped_files_are_said_on_stderr_and_shown(tiny_llama_dir, corpus_dir, tmp_path):
    corpus = Path(shutil.copytree(corpus_dir, tmp_path / "corpus"))
    (corpus / "image.bin").write_bytes(b"\x89PNG\x00\x00")
    (corpus / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    (corpus / ".notes.txt").write_text("hidden")
    os.symlink(corpus / "gone.txt", corpus / "link.txt")  # a broken link
    out = tmp_path / "r.nc"
    r = _measure(tiny_llama_dir, corpus, out)
    assert r.exit_code == 0, r.output
    assert f"note: {SKIPPED}, not measured" in r.stderr.splitlines(), r.stderr
    assert results.load(out).attrs["files_skipped"] == {"binary": 1, "hidden": 1, "not_utf8": 1, "unreadable": 1}
    shown = CliRunner().invoke(app, ["show", str(out), "-m", "tv"])
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.splitlines()[1] == f"not measured: {SKIPPED}", shown.stdout


def test_a_corpus_that_skips_nothing_prints_nothing_new(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "r.nc"
    r = _measure(tiny_llama_dir, corpus_dir, out)
    assert r.exit_code == 0 and "note:" not in r.stderr and "skipped" not in r.stderr, r.output
    shown = CliRunner().invoke(app, ["show", str(out), "-m", "tv"])
    assert shown.stdout.splitlines()[1] == "tv", shown.stdout


def test_show_counts_documents_too_short_beside_skipped_files():
    from truncsens.report.printed import not_measured_note

    attrs = {"files_skipped": {"empty": 3}, "n_docs_skipped_short": 3, "n_docs_checked": 67, "reference_context": 64}
    assert not_measured_note(attrs) == "not measured: 3 corpus files skipped (3 empty), 3 of 67 documents too short for N=64"
    assert not_measured_note({**attrs, "files_skipped": {}}) == "not measured: 3 of 67 documents too short for N=64"
    assert not_measured_note({"reference_context": 64}) == ""  # a file from before these attrs


def test_certify_says_the_skipped_files_as_measure_does():
    """``certify`` prints on stderr the note ``measure`` prints (the golden run shows it on the builtin
    corpus: ``note: 3 corpus files skipped (3 empty), not measured``), read from the results' attrs."""
    import xarray as xr

    from truncsens.api.certify import Certification

    done = Certification(xr.Dataset(attrs={"files_skipped": {"hidden": 1, "empty": 2}}), {}, None, [])
    assert done.notes() == ["3 corpus files skipped (2 empty, 1 hidden), not measured"]
    assert Certification(xr.Dataset(attrs={"files_skipped": {}}), {}, None, []).notes() == []
    assert Certification(xr.Dataset(), {}, None, []).notes() == []  # a file from before the attr


def test_certify_attribution_says_the_skipped_files_as_measure_does():
    """``certify-attribution`` reads the same attr and says the same note (its command prints it on stderr)."""
    import xarray as xr

    from truncsens.api.certify_attribution import Attribution

    def attribution(attrs):
        return Attribution(xr.Dataset(attrs=attrs), {}, None, None, [])

    assert attribution({"files_skipped": {"empty": 3}}).notes() == ["3 corpus files skipped (3 empty), not measured"]
    assert attribution({}).notes() == []
