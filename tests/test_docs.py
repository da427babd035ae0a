"""The README and docs/ pages: CI runs exactly the README's test command, and every relative link,
anchor and repository path the pages name exists (a module or page that moves must take its links along)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Paths named in backticks or prose: `truncsens/engine/attention_windows.py`, benchmarks/gpu_suite.sh, ...
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:truncsens|benchmarks|tests|notebooks|docs|reproduce)/[\w/.-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = (line.lstrip("#").strip().lower() for line in page.read_text().splitlines() if line.startswith("#"))
    return {re.sub(r"[^\w\- ]", "", h).replace(" ", "-") for h in heads}


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"]
    setup = (ROOT / "README.md").read_text().split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    assert "# 2. install with test dependencies, then run the test suite\n" + ci[0] + "\n" in setup


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_exist(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and anchor not in _anchors(linked)):
            missing.append(target)
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_repository_paths_exist(page):
    named = {m.rstrip(".") for m in REPO_PATH.findall(page.read_text())}
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_the_path_check_sees_a_moved_module():
    text = "windows per layer (`truncsens/engine/layer_windows.py`); see docs/method.md."
    named = [m.rstrip(".") for m in REPO_PATH.findall(text)]
    assert named == ["truncsens/engine/layer_windows.py", "docs/method.md"]
    assert [(ROOT / p).exists() for p in named] == [False, True]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_fences_are_closed(page):
    fences = [i for i, line in enumerate(page.read_text().splitlines(), 1) if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: a code fence opened on line {fences[-1]} is never closed"


def test_architecture_names_the_files_each_folder_holds():
    """Every `name.py` in a row of docs/architecture.md's folder table is a file of that row's folder."""
    missing = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        row = re.match(r"\| `(?:truncsens/)?([\w/]+)/` \|(.*)", line)
        if not row:
            continue
        folder = ROOT / "truncsens" / row.group(1)
        assert folder.is_dir(), row.group(1)
        for name in re.findall(r"`([\w/]+\.py)`", row.group(2)):
            if not (folder / name).exists() and not (ROOT / "truncsens" / name).exists():
                missing.append(f"{row.group(1)}/{name}")
    assert missing == []


def test_readme_names_every_registered_policy():
    """A user reads the policies off the README: every registered name appears there in backticks."""
    from truncsens.policies import POLICIES

    readme = (ROOT / "README.md").read_text()
    assert sorted(n for n in POLICIES if f"`{n}`" not in readme) == []


def test_readme_is_a_short_page():
    """The README is a page for users, not the project's record (that is CHANGELOG.md): at most 12,000
    bytes, as `wc -c` counts (its α, ε and dashes take two or three bytes each)."""
    assert len((ROOT / "README.md").read_bytes()) <= 12_000
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_docs_pages_are_guides_of_bounded_size():
    """Each page under docs/ is a user's guide of at most 20,000 bytes (method.md, the formulas with
    their sources, at most 30,000), and all pages together at most 150,000 (as `wc -c docs/*.md`
    counts): verbatim outputs live in reproduce/results/, investigations on short findings pages."""
    sizes = {p.name: len(p.read_bytes()) for p in (ROOT / "docs").glob("*.md")}
    limits = {name: 30_000 if name == "method.md" else 20_000 for name in sizes}
    assert sorted(name for name, size in sizes.items() if size > limits[name]) == []
    assert sum(sizes.values()) <= 150_000


# A section of a page cited in code, tests, benchmarks or reproduce: docs/method.md, "Block protocol"
CITED_SECTION = re.compile(r'docs/([\w-]+\.md)[^"\n]{0,25}?\\?"([A-Z][^"\n\\]{2,60})\\?"')


def _sections(page: Path) -> list[str]:
    """A page's headings and bold paragraph titles (**Memory.**), lower case."""
    text = page.read_text()
    heads = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return [t.lower() for t in heads + re.findall(r"\*\*([^*]+?)\.?\*\*", text)]


def _stale_citations(text: str) -> list[tuple[str, str]]:
    return [(page, title) for page, title in CITED_SECTION.findall(text)
            if not (ROOT / "docs" / page).exists() or not any(title.lower() in s for s in _sections(ROOT / "docs" / page))]


def test_sections_cited_in_the_code_exist():
    files = [f for d in ("truncsens", "tests", "benchmarks", "reproduce", "notebooks") for f in sorted((ROOT / d).rglob("*"))
             if f.suffix in (".py", ".md", ".sh") and f.is_file() and f != Path(__file__).resolve()]  # not the examples below
    stale = [(str(f.relative_to(ROOT)), *c) for f in files for c in _stale_citations(f.read_text(errors="ignore"))]
    assert stale == []


def test_the_citation_check_sees_a_section_that_moved():
    assert _stale_citations('(docs/reference-model.md, end of "Stages for copying").') == [
        ("reference-model.md", "Stages for copying")]
    assert _stale_citations('see docs/method.md, "Block protocol" and docs/reference-model.md ("Training it")') == []
