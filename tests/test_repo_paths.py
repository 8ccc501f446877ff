"""The product refers to nothing outside its repository: no code, help text, script or page
names a trace folder beside the checkout (``../shared/...``) or a path of a development
machine. Traces the product ships are under ``controlplane/data/traces``; the full public
sets are named by their source (``controlplane/data/traces/ATTRIBUTION.md``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What a user gets or reads: the packages, the examples, the docs and the build files.
SCANNED = ("controlplane", "predictors", "agents", "examples", "docs", "kvprefetch")
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml", "mkdocs.yml", "ray_cluster.yaml")
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ""}
#: A folder beside the checkout, the development traces' folder, a machine's work tree.
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w/])shared/traces\b|(?<![\w.])/work/")


def _outside_paths(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: text`` for each line of ``path`` that names a path outside the repository."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    return [f"{path.relative_to(root)}:{n}: {line.strip()}"
            for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]


def _files(root: Path = ROOT) -> list[Path]:
    out = [root / name for name in SCANNED_FILES if (root / name).is_file()]
    for folder in SCANNED:
        out += [p for p in sorted((root / folder).rglob("*"))
                if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return out


def test_no_file_names_a_path_outside_the_repository() -> None:
    files = _files()
    assert len(files) > 100  # the packages were found
    found = [line for path in files for line in _outside_paths(path)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


@pytest.mark.parametrize("line, flagged", [
    ("kvprefetch sim --trace ../shared/traces/claude-code", True),
    ('TRACES="${1:-../shared/traces/claude-code}"', True),
    ("kvprefetch eval-predictor --trace shared/traces/claude-code", True),
    ("see /work/main/README.md", True),
    ("kvprefetch sim --trace controlplane/data/traces/claude-code", False),
    ("kvprefetch sim --trace kv-cache-tester/traces", False),
    ("mmap.MAP_SHARED | MAP_POPULATE", False),
    ("the shared bearer token", False),
])
def test_outside_path_check_flags_what_it_should(tmp_path: Path, line: str, flagged: bool) -> None:
    path = tmp_path / "x.py"
    path.write_text(f"# one line\n{line}\n")
    assert bool(_outside_paths(path, tmp_path)) is flagged


#: A page of the repository named in code: ``docs/...md`` or ``controlplane/data/...md``.
CITED_PAGE = re.compile(r"\b((?:docs|controlplane/data)/[\w./-]+\.md)\b")
CONSTANTS_PAGE = ROOT / "docs" / "results" / "constants.md"


def test_every_page_the_code_cites_exists() -> None:
    cited = {(path, match) for package in ("controlplane", "predictors", "agents")
             for path in sorted((ROOT / package).rglob("*.py"))
             for match in CITED_PAGE.findall(path.read_text())}
    assert any(page == "docs/results/constants.md" for _, page in cited)
    missing = [f"{path.relative_to(ROOT)}: {page}" for path, page in sorted(cited)
               if not (ROOT / page).is_file()]
    assert not missing, "pages cited that do not exist:\n" + "\n".join(missing)


def test_each_constant_on_the_constants_page_exists_and_cites_it() -> None:
    import importlib
    import inspect

    names = re.findall(r"^\| `(kvprefetch\.[\w.]+)` \|", CONSTANTS_PAGE.read_text(), re.M)
    assert len(names) >= 4
    for dotted in names:
        module_name, _, attr = dotted.rpartition(".")
        module = importlib.import_module(module_name)
        assert hasattr(module, attr), dotted
        assert "docs/results/constants.md" in inspect.getsource(module), module_name
