"""The layout's rules (docs/architecture.md) as tests: import-linter contracts, no import cycle
(function-level imports included), small modules, the allowed top-level modules, a docstring per folder."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "truncsens"
TOP_LEVEL = {"__init__.py", "metrics.py", "divergences.py", "stats.py", "targets.py"}
MAX_LINES = 400


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``pkg.__init__`` is ``pkg``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of the package that module ``name`` imports anywhere in its body (also inside functions).

    ``from a.b import c`` names ``a.b.c`` if that is a module, else ``a.b``; a module's own parent packages
    are not counted (Python runs them first whatever the module imports).
    """
    is_package = path.name == "__init__.py"
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in candidates:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
    return deps


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_function_level_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    known = modules(pkg)
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_no_import_cycle():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed (pip install -e '.[test]')")
def test_import_linter_contracts():
    proc = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_modules_are_small():
    large = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
             if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert large == {}


def test_only_the_allowed_top_level_modules():
    assert {p.name for p in PACKAGE.glob("*.py")} <= TOP_LEVEL


def test_every_folder_says_what_it_holds():
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent.name in ("manifests", "weights"):
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc) > 20, f"{init.relative_to(ROOT)} has no module docstring"
