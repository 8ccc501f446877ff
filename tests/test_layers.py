"""The package's import structure, beyond the layers import-linter checks
(pyproject.toml, ``[tool.importlinter]``): no import cycle between modules, lazy imports
(inside functions) included, and no module importing another module's private
(leading-underscore) name."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The product's top-level folders (``kvprefetch.<folder>``).
PACKAGES = ("controlplane", "predictors", "agents")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = [t for t in edges[node] if t in edges]
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_import_cycles_between_modules() -> None:
    graph = grimp.build_graph("kvprefetch", cache_dir=None)
    cycles = _cycles(graph)
    lines = []
    for component in cycles:
        for a in component:
            for b in sorted(graph.find_modules_directly_imported_by(a)):
                if b in component:
                    where = graph.get_import_details(importer=a, imported=b)
                    at = ", ".join(str(d["line_number"]) for d in where)
                    lines.append(f"{a} -> {b} (line {at})")
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_cycle_finder_finds_a_lazy_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b", line_number=1, line_contents="x")
    graph.add_import(importer="p.b", imported="p.a", line_number=9, line_contents="x")
    graph.add_import(importer="p.c", imported="p.a", line_number=1, line_contents="x")
    assert _cycles(graph) == [["p.a", "p.b"]]


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("kvprefetch", *parts))


def _private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``from kvprefetch.x import _name`` in ``path`` where ``kvprefetch.x`` is another
    module (a package's ``__init__`` may take its own submodules' names)."""
    here = _module_name(path, root)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if not node.module.startswith("kvprefetch"):
            continue
        for alias in node.names:
            if not alias.name.startswith("_") or alias.name.startswith("__"):
                continue
            same_package = path.name == "__init__.py" and node.module.startswith(here + ".")
            if node.module != here and not same_package:
                out.append(f"{path.relative_to(root)}:{node.lineno}: "
                           f"from {node.module} import {alias.name}")
    return out


def test_no_private_name_is_imported_from_another_module() -> None:
    found = [line for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for line in _private_imports(path)]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from kvprefetch.controlplane.base.units import _parse\n", 1),
    ("from kvprefetch.controlplane.base.units import parse as _parse\n", 0),
    ("from kvprefetch.controlplane.base import __version__\n", 0),
    ("def f():\n    from kvprefetch.agents.stores.local import _file_name\n", 1),
])
def test_private_import_check_reads_lazy_imports_and_aliases(
        tmp_path: Path, source: str, expected: int) -> None:
    path = tmp_path / "controlplane" / "x.py"
    path.parent.mkdir()
    path.write_text(source)
    assert len(_private_imports(path, tmp_path)) == expected
