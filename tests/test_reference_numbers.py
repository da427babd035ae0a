"""reproduce/reference_numbers.py and its record, reproduce/results/: a step writes one file, its command
line then its printed output; marked blocks of the pages are replaced by their step's record, the
``$ command`` line stays, progress lines go, unmarked and unrecorded blocks stay as they are; every step
the pages mark exists, and every README/docs figure the steps feed is one a step writes. Every decimal
number a page quotes beside a link to a record appears in that record."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD_LINK = re.compile(r"\]\(((?:\.\./)*reproduce/results/([\w-]+)\.txt)\)")
# a measured number: digits with a decimal point (1.36e-5 counts by its 1.36); versions such as 2.13.0 do not
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)+")


@pytest.fixture(scope="module")
def numbers():
    spec = importlib.util.spec_from_file_location("reference_numbers", ROOT / "reproduce" / "reference_numbers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reference_numbers"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_marked_blocks_are_replaced_by_the_record(numbers, tmp_path):
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
    fit_command = next(s for s in numbers.STEPS if s.name == "fit").command
    records = tmp_path / "reproduce" / "results"
    assert (records / "fit.txt").read_text() == f"$ {fit_command}\nnew table\n\nline 2\n"
    assert sorted(p.name for p in records.iterdir()) == ["fit.txt", "recommend.txt"]


def test_a_step_writes_its_command_line_then_its_printed_output(numbers, tmp_path):
    step = numbers.Step("echo", "echo 'alpha 0.425   ' && echo progress 50%| >&2 && echo shown >&2",
                        merge_stderr=True, env={"X": "1"})
    (tmp_path / "out").mkdir()
    assert numbers.run_step(step, tmp_path / "out", "sha", records=tmp_path / "rec")
    assert (tmp_path / "rec" / "echo.txt").read_text() == f"$ X=1 {step.command}\nalpha 0.425\nshown\n"
    failing = numbers.Step("fails", "echo half; exit 3")
    assert not numbers.run_step(failing, tmp_path / "out", "sha", records=tmp_path / "rec")
    assert not (tmp_path / "rec" / "fails.txt").exists()  # a failed step leaves no record


def test_a_timed_step_ends_its_record_with_its_run_time(numbers, tmp_path):
    (tmp_path / "out").mkdir()
    assert numbers.run_step(numbers.Step("slow", "sleep 1.2; echo done", timed=True), tmp_path / "out", "sha",
                            records=tmp_path / "rec")
    lines = (tmp_path / "rec" / "slow.txt").read_text().splitlines()
    assert lines[:2] == ["$ sleep 1.2; echo done", "done"]
    seconds = re.fullmatch(r"run time: (\d+) s wall clock, one process, on a machine with (\d+) CPU cores", lines[-1])
    assert seconds and 1 <= int(seconds.group(1)) <= 60 and int(seconds.group(2)) >= 1


def test_every_record_is_a_step_and_starts_with_its_command(numbers):
    records = sorted((ROOT / "reproduce" / "results").glob("*.txt"))
    assert records
    by_name = {s.name: s for s in numbers.STEPS}
    for path in records:
        assert path.stem in by_name, path.name
        assert path.read_text().split("\n", 1)[0] == numbers.header(by_name[path.stem]), path.name


def _units(text: str) -> list[str]:
    """A page's paragraphs, each table row on its own (fenced blocks left out). A row carries the record
    links of its table's caption: the lines above it in the same paragraph, or else the paragraph just
    before the table when that one ends with a colon."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    units: list[str] = []
    previous = ""
    for para in re.split(r"\n\s*\n", text):
        lines = para.splitlines()
        rows = [line for line in lines if line.startswith("|")]
        if not rows:
            units.append(para)
            previous = para
            continue
        caption = "\n".join(line for line in lines if not line.startswith("|")).strip()
        if caption:
            units.append(caption)
        elif previous.rstrip().endswith(":"):
            caption = previous
        links = " ".join(m.group(0) for m in RECORD_LINK.finditer(caption))
        units += [f"{row} {links}" if links else row for row in rows]
        previous = ""
    return units


def quoted_numbers_missing(text: str, page_dir: Path) -> list[str]:
    """``'record: number'`` for every decimal number of a paragraph (or table row) that links a record
    and is not in the output of any record it links."""
    missing = []
    for unit in _units(text):
        links = RECORD_LINK.findall(unit)
        if not links:
            continue
        outputs = " ".join((page_dir / rel).read_text().split("\n", 1)[1].replace(",", "") for rel, _ in links)
        prose = RECORD_LINK.sub("", unit).replace(",", "")
        missing += [f"{'+'.join(n for _, n in links)}: {x}" for x in NUMBER.findall(prose)
                    if x.count(".") == 1 and not _in_output(x, outputs)]
    return missing


def _in_output(quoted: str, outputs: str) -> bool:
    """Whether a quoted decimal is in a record's output: as printed (or its leading digits), or a printed
    number with more decimals rounded to the quoted ones (7.737898 quoted as 7.7379 or 7.74)."""
    if quoted in outputs:
        return True
    decimals = len(quoted.split(".")[1])
    return any(f"{float(x):.{decimals}f}" == quoted for x in NUMBER.findall(outputs)
               if x.count(".") == 1 and len(x.split(".")[1]) > decimals)


def test_the_number_check_sees_a_number_the_record_lacks(tmp_path):
    (tmp_path / "reproduce" / "results").mkdir(parents=True)
    (tmp_path / "reproduce" / "results" / "s.txt").write_text("$ cmd 9.75\nalpha 0.425 [0.389, 0.466]\n")
    (tmp_path / "docs").mkdir()
    page = ("α is 0.425 [0.389, 0.466] with torch 2.13.0 ([record](../reproduce/results/s.txt)).\n\n"
            "| a | 0.466 ([s](../reproduce/results/s.txt)) |\n| b | 0.430 ([s](../reproduce/results/s.txt)) |\n\n"
            "A paragraph without a link is not checked: 1.5.\n\n"
            "The command's 9.75 is not output: [s](../reproduce/results/s.txt)\n")
    assert quoted_numbers_missing(page, tmp_path / "docs") == ["s: 0.430", "s: 9.75"]
    (tmp_path / "reproduce" / "results" / "s.txt").write_text("$ cmd\nalpha 0.42478\n")
    rounded = "α is 0.4248, 0.425, 0.42 or 0.4247 ([record](../reproduce/results/s.txt)); not 0.4249 or 0.43.\n"
    assert quoted_numbers_missing(rounded, tmp_path / "docs") == ["s: 0.4249", "s: 0.43"]


def test_a_table_is_checked_against_the_record_its_caption_links(tmp_path):
    (tmp_path / "reproduce" / "results").mkdir(parents=True)
    (tmp_path / "reproduce" / "results" / "s.txt").write_text("$ cmd\nshare 72.3% 74.7%\n")
    (tmp_path / "docs").mkdir()
    link = "[record](../reproduce/results/s.txt)"
    captioned = f"Share that fails ({link}):\n\n| budget | share |\n|---|---|\n| 12.5 % | 72.3 % |\n| 25 % | 60.2 % |\n"
    assert quoted_numbers_missing(captioned, tmp_path / "docs") == ["s: 12.5", "s: 60.2"]
    same_paragraph = f"Share ({link}):\n| budget | share |\n| 50 % | 74.7 % |\n| 50 % | 1.25 % |\n"
    assert quoted_numbers_missing(same_paragraph, tmp_path / "docs") == ["s: 1.25"]
    # a paragraph that is not a caption (no colon at its end) lends the table nothing
    assert quoted_numbers_missing(f"See {link}.\n\n| a | 9.5 |\n", tmp_path / "docs") == []


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_numbers_quoted_beside_a_record_appear_in_it(page):
    assert quoted_numbers_missing(page.read_text(), page.parent) == []


def test_marked_blocks_equal_their_records(numbers):
    differing = []
    for page in numbers.pages():
        for m in numbers.MARKER.finditer(page.read_text()):
            name, _, body, _ = m.groups()
            body = body.split("\n", 1)[1] if body.startswith("$ ") else body
            record = ROOT / "reproduce" / "results" / f"{name}.txt"
            if not record.is_file() or numbers.output_of(record.read_text()) != body:
                differing.append(f"{page.name}: {name}")
    assert differing == []


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


def test_print_source_prints_the_block_a_python_step_runs(numbers, capsys):
    assert numbers.main(["--print-source", "api-example"]) == 0
    assert capsys.readouterr().out == numbers.source_of(next(s for s in numbers.STEPS if s.name == "api-example"))
    with pytest.raises(SystemExit, match="no python-block step 'fit'"):
        numbers.main(["--print-source", "fit"])
