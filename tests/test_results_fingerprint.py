"""A results file whose attrs contradict its data is refused: the attrs that define the measurement
are fingerprinted when the file is written and checked when it is read, so a hand edit of
``reference_context`` (down to 48 or up to 128), ``semantics``, ``model`` or ``n_sink`` (which moved
alpha from 0.143 to 0.096 or 0.182, and added sinks to the KV bytes) is refused by every reader with
what changed; a file without a fingerprint (an older truncsens) is checked by the value rules alone
(every target at a position >= reference_context, sinks and windows inside it); a deliberate re-label
goes through ``truncsens.results.relabel``, which records it."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.results import ResultsError
from truncsens.results.constructed import curve_results

WINDOWS = [1, 4, 16, 32]


def window_file(tmp_path) -> str:
    ds = curve_results({"tv": lambda w: 0.5 * w ** -0.6, "kl": lambda w: 0.3 * w ** -1.2}, WINDOWS, n_docs=4,
                       noise=0.2, reference_context=64, attrs={"model": "tiny"})
    return str(results.save(ds, tmp_path / "ok.nc"))


def hand_edited(path: str, name: str, fingerprint: bool = True, **attrs) -> str:
    """A copy of the file with ``attrs`` set in its stored form, as ncatted or a NetCDF script would
    (``fingerprint=False``: with the fingerprint removed too, as an older truncsens wrote it)."""
    ds = xr.load_dataset(path, engine="h5netcdf")
    ds.attrs.update(attrs)
    if not fingerprint:
        del ds.attrs["attrs_fingerprint"]
    out = path.replace(".nc", f"-{name}.nc")
    ds.to_netcdf(out, engine="h5netcdf")
    return out


def error_line(args: list[str]) -> str:
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    lines = [line for line in out.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.output
    return lines[0]


EDITS = {
    "reference_context down": ({"reference_context": 48}, "reference_context was 64, is 48"),
    "reference_context up": ({"reference_context": 128}, "reference_context was 64, is 128"),
    "semantics": ({"semantics": "streaming"}, 'semantics was "reencode", is "streaming"'),
    "model": ({"model": "other"}, 'model was "tiny", is "other"'),
    "n_sink": ({"n_sink": 4}, "n_sink was 0, is 4"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_hand_edited_attr_is_refused_by_every_reader_with_what_changed(tmp_path, case):
    edit, changed = EDITS[case]
    bad = hand_edited(window_file(tmp_path), "edited", **edit)
    fit_out = tmp_path / "f.json"
    for args in (["show", bad], ["fit", bad, "--out", str(fit_out), "--bootstrap", "0"],
                 ["recommend-window", bad, "--eps", "0.1"], ["compare-policies", bad], ["plot", bad, "--out", str(tmp_path / "p.png")]):
        line = error_line(args)
        assert line.startswith(f"error: {bad}: attrs were changed after the file was written ({changed})"), line
        assert "truncsens.results.relabel" in line, line
    assert not fit_out.exists()
    with pytest.raises(ResultsError, match=rf"\({changed}\)"):
        results.load(bad)


def test_an_unchanged_copy_and_a_volatile_attr_load(tmp_path):
    """Only the attrs that define the measurement count: the copy loads, and so does one whose
    ``command`` or ``created`` was rewritten."""
    path = window_file(tmp_path)
    assert results.load(hand_edited(path, "same")).attrs == results.load(path).attrs
    assert results.load(hand_edited(path, "when", created="2030-01-01T00:00:00+00:00"))["tv"].shape == (8, 4)
    assert "attrs_fingerprint" not in results.load(path).attrs  # load(save(ds)) == ds


def test_without_a_fingerprint_the_value_rules_still_hold(tmp_path):
    """A file written before fingerprints existed loads; its data must agree with its attrs."""
    path = window_file(tmp_path)
    old = hand_edited(path, "old", fingerprint=False)
    assert results.load(old)["tv"].shape == (8, 4)
    up = hand_edited(path, "up", fingerprint=False, reference_context=128)
    line = error_line(["show", up])
    assert ("rule positions: every target position must be at least reference_context = 128" in line
            and "8 of 8 are not, first 64 at target=0" in line), line
    sinks = hand_edited(path, "sinks", fingerprint=False, n_sink=40)
    line = error_line(["fit", sinks, "--out", str(tmp_path / "f.json")])
    assert "n_sink + the largest window must be at most reference_context = 64 tokens" in line
    assert "got n_sink 40 + window 32" in line, line


def test_relabel_records_the_change_and_writes_a_fresh_fingerprint(tmp_path):
    path = window_file(tmp_path)
    before = results.load(path)
    out = results.relabel(path, "the checkpoint was renamed", {"model": "tiny-v2"}, out=tmp_path / "renamed.nc")
    ds = results.load(out)
    assert ds.attrs["model"] == "tiny-v2"
    [record] = ds.attrs["relabels"]
    assert record["reason"] == "the checkpoint was renamed"
    assert record["changed"] == {"model": {"from": '"tiny"', "to": '"tiny-v2"'}}
    np.testing.assert_array_equal(ds["tv"].values, before["tv"].values)
    assert results.load(path).attrs["model"] == "tiny"  # the source is left as it was
    # a hand edit made on purpose is adopted by a relabel without changes, and recorded
    edited = hand_edited(path, "edited", n_sink=2)
    with pytest.raises(ResultsError, match="n_sink was 0, is 2"):
        results.load(edited)
    results.relabel(edited, "two sinks were kept")
    assert results.load(edited).attrs["relabels"][0]["changed"] == {"n_sink": {"from": "0", "to": "2"}}
    assert results.load(edited).attrs["n_sink"] == 2


def test_relabel_refuses_attrs_the_data_contradicts_and_keeps_the_file(tmp_path):
    path = window_file(tmp_path)
    before = open(path, "rb").read()
    with pytest.raises(ResultsError, match="rule positions.*reference_context = 128"):
        results.relabel(path, "longer context", {"reference_context": 128})
    with pytest.raises(ValueError, match="reason"):
        results.relabel(path, " ", {"model": "x"})
    with pytest.raises(ValueError, match="nothing to re-label"):
        results.relabel(path, "no change", {"model": "tiny"})
    with pytest.raises(ValueError, match="attrs_fingerprint"):
        results.relabel(path, "forge", {"attrs_fingerprint": {}})
    assert open(path, "rb").read() == before
