"""reproduce/reference_numbers.py: marked blocks of the pages are replaced by the kept output of their
step, the ``$ command`` line stays, progress lines go, unmarked and not-yet-run blocks stay as they are;
every step the pages mark exists, and every README/docs figure the steps feed is one a step writes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def numbers():
    spec = importlib.util.spec_from_file_location("reference_numbers", ROOT / "reproduce" / "reference_numbers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reference_numbers"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_marked_blocks_are_replaced_by_the_kept_output(numbers, tmp_path):
    (tmp_path / "docs").mkdir()
    page = ("intro\n<!-- numbers: fit -->\n```text\n$ truncsens fit a.nc\nold table\n```\n\n"
            "<!-- numbers: plan -->\n```\nold plan\n```\n\n```text\nunmarked\n```\n")
    (tmp_path / "README.md").write_text(page)
    (tmp_path / "docs" / "x.md").write_text("<!-- numbers: recommend -->\n```text\nold\n```\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "fit.out").write_text("new table   \n\nline 2\n")
    (out / "fit.err").write_text("not shown\n")
    (out / "recommend.out").write_text("window 12\n")
    (out / "recommend.err").write_text("warning: shown\nfitting 50%|#####     | 1/2\n")
    numbers.update_docs(out, root=tmp_path)
    assert (tmp_path / "README.md").read_text() == (
        "intro\n<!-- numbers: fit -->\n```text\n$ truncsens fit a.nc\nnew table\n\nline 2\n```\n\n"
        "<!-- numbers: plan -->\n```\nold plan\n```\n\n```text\nunmarked\n```\n")  # plan has not run: unchanged
    assert (tmp_path / "docs" / "x.md").read_text() == "<!-- numbers: recommend -->\n```text\nwindow 12\nwarning: shown\n```\n"


def test_only_outputs_of_the_installed_weights_and_current_command_are_used(numbers, tmp_path):
    import json

    page = "<!-- numbers: fit -->\n```text\nold fit\n```\n\n<!-- numbers: recommend -->\n```text\nold rec\n```\n"
    (tmp_path / "README.md").write_text(page)
    out = tmp_path / "out"
    out.mkdir()
    steps = {s.name: s for s in numbers.STEPS}
    for name, sha, command in (("fit", "aaa", steps["fit"].command), ("recommend", "bbb", steps["recommend"].command)):
        (out / f"{name}.out").write_text(f"new {name}\n")
        (out / f"{name}.json").write_text(json.dumps({"returncode": 0, "weights_sha256": sha, "command": command}))
    numbers.update_docs(out, root=tmp_path, sha="aaa")  # recommend ran on other weights: left alone
    assert (tmp_path / "README.md").read_text() == page.replace("old fit", "new fit")
    (out / "fit.json").write_text(json.dumps({"returncode": 0, "weights_sha256": "aaa", "command": "truncsens fit x"}))
    (out / "fit.out").write_text("newer fit\n")
    numbers.update_docs(out, root=tmp_path, sha="aaa")  # fit ran as another command: left alone
    assert "newer fit" not in (tmp_path / "README.md").read_text()


def test_unknown_marker_is_refused(numbers, tmp_path):
    (tmp_path / "README.md").write_text("<!-- numbers: nonesuch -->\n```\nx\n```\n")
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit, match="unknown step 'nonesuch'"):
        numbers.update_docs(tmp_path / "out", root=tmp_path)


def test_the_pages_markers_name_steps_and_sources_exist(numbers):
    names = {s.name for s in numbers.STEPS}
    marked = set()
    for page in numbers.pages():
        text = page.read_text()
        marked |= {m.group(1) for m in numbers.MARKER.finditer(text)}
    assert marked and marked <= names
    assert "import truncsens" in numbers.source_of(next(s for s in numbers.STEPS if s.name == "api-example"))
    for dst in numbers.FIGURES.values():
        assert (ROOT / dst).is_file()
    writers = {o for s in numbers.STEPS for o in s.outputs}
    assert set(numbers.FIGURES) <= writers  # every copied figure is a declared output of a step


def test_needs_come_first_and_unknown_steps_are_named(numbers):
    order = [s.name for s in numbers.with_needs(["recommend"])]
    assert order == ["measure-code-max", "measure-nl-max", "fit", "recommend"]
    with pytest.raises(SystemExit, match="unknown step"):
        numbers.with_needs(["bogus"])
