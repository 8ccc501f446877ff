"""The architecture page and the README state the layers the import contract enforces
(``pyproject.toml``, ``[tool.importlinter]``): the page lists every layer of the contract in
its order, every package a contract names appears in its package table, and every package
of the product is in the layers contract."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
#: The README's words for the layers' packages.
README_NAMES = {
    "base types": "kvprefetch.controlplane.base",
    "journal": "kvprefetch.controlplane.journal",
    "predictors": "kvprefetch.predictors",
    "traces": "kvprefetch.controlplane.traces",
    "core": "kvprefetch.controlplane.core",
    "agents": "kvprefetch.agents",
    "simulator": "kvprefetch.controlplane.sim",
    "live service": "kvprefetch.controlplane.live",
    "harness": "kvprefetch.controlplane.harness",
    "CLI": "kvprefetch.controlplane.cli",
}

Layers = list[frozenset[str]]


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["importlinter"]["contracts"])


def _contract_layers() -> Layers:
    """The layers contract's layers, top first, each the set of its sibling packages."""
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    return [frozenset(name.strip() for name in line.split("|")) for line in layers]


def page_layers(text: str) -> Layers:
    """The layers block of the page (a ``text`` block of ``kvprefetch...`` lines), top first."""
    blocks = re.findall(r"```text\n(kvprefetch[^`]*)```", text)
    if len(blocks) != 1:
        raise AssertionError(f"expected one layers block on the page, found {len(blocks)}")
    return [frozenset(name.strip() for name in line.split("|"))
            for line in blocks[0].splitlines() if line.strip()]


def page_packages(text: str) -> set[str]:
    """The packages in the first column of the page's package table."""
    return set(re.findall(r"^\| `(kvprefetch[\w.]*)` \|", text, re.M))


def readme_layers(text: str) -> Layers:
    """The README's layer sentence, ``a < b, c < d``, as layers top first."""
    match = re.search(r"run by `make lint`\): (.*?)\.\n", text, re.S)
    if match is None:
        raise AssertionError("README: the layer sentence is missing")
    chain = " ".join(match.group(1).split())
    return [frozenset(README_NAMES[n.strip()] for n in layer.split(","))
            for layer in reversed(chain.split("<"))]


def contract_packages() -> set[str]:
    """Every package any contract names (layers, or the modules of other contracts)."""
    names: set[str] = set()
    for contract in _contracts():
        for line in contract.get("layers", []):
            names |= {n.strip() for n in line.split("|")}
        for key in ("modules", "source_modules", "forbidden_modules"):
            names |= set(contract.get(key, []))
    return names


def backend_folders() -> set[str]:
    """``kvprefetch.agents.backends.X`` for each backend folder (a package)."""
    root = ROOT / "agents" / "backends"
    return {f"kvprefetch.agents.backends.{p.name}" for p in sorted(root.iterdir())
            if (p / "__init__.py").is_file()}


def product_packages() -> set[str]:
    """``kvprefetch.controlplane.X`` for each package folder of controlplane, and the two
    other top-level packages."""
    found = {"kvprefetch.agents", "kvprefetch.predictors"}
    for sub in sorted((ROOT / "controlplane").iterdir()):
        if (sub / "__init__.py").is_file():
            found.add(f"kvprefetch.controlplane.{sub.name}")
    return found


def test_the_page_lists_the_contract_layers_in_order() -> None:
    assert page_layers(PAGE.read_text()) == _contract_layers()


def test_the_readme_sentence_states_the_contract_layers_in_order() -> None:
    assert readme_layers(README.read_text()) == _contract_layers()


def test_every_package_a_contract_names_is_in_the_page_table() -> None:
    missing = contract_packages() - page_packages(PAGE.read_text())
    assert not missing, f"docs/architecture.md's package table lacks: {sorted(missing)}"


def test_every_backend_folder_is_in_the_independence_contract() -> None:
    (independent,) = [set(c["modules"]) for c in _contracts() if c["type"] == "independence"
                      and any(".backends." in m for m in c["modules"])]
    assert len(backend_folders()) >= 3
    assert backend_folders() == independent


def test_every_product_package_is_in_the_layers_contract() -> None:
    layered = set().union(*_contract_layers())
    missing = product_packages() - layered
    assert not missing, f"packages outside the layers contract: {sorted(missing)}"


# --------------------------------------------------------------- the checks can fail
PAGE_OK = """| `kvprefetch.a` | a |
| `kvprefetch.b` | b |

```text
kvprefetch.b
kvprefetch.a | kvprefetch.c
```
"""


def test_page_parsing_finds_layers_and_table() -> None:
    assert page_layers(PAGE_OK) == [frozenset({"kvprefetch.b"}),
                                    frozenset({"kvprefetch.a", "kvprefetch.c"})]
    assert page_packages(PAGE_OK) == {"kvprefetch.a", "kvprefetch.b"}


@pytest.mark.parametrize("drop", ["kvprefetch.controlplane.harness", "kvprefetch.controlplane.sim"])
def test_a_layer_missing_from_the_page_is_caught(drop: str) -> None:
    text = PAGE.read_text()
    block = re.search(r"```text\n(kvprefetch[^`]*)```", text)
    assert block is not None
    lines = [" | ".join(n for n in (m.strip() for m in line.split("|")) if n != drop)
             for line in block.group(1).splitlines()]
    edited = text.replace(block.group(1), "\n".join(x for x in lines if x) + "\n")
    assert page_layers(edited) != _contract_layers()


def test_a_package_missing_from_the_table_is_caught() -> None:
    text = PAGE.read_text()
    edited = re.sub(r"^\| `kvprefetch\.controlplane\.harness` \|.*\n", "", text, flags=re.M)
    assert "kvprefetch.controlplane.harness" in contract_packages() - page_packages(edited)


def test_the_old_chain_in_the_readme_is_caught() -> None:
    old = ("The layers are a contract (`lint-imports`, run by `make lint`): base types < "
           "predictors,\ntraces < core, agents < simulator < live service < CLI.\n")
    assert readme_layers(old) != _contract_layers()


# --------------------------------------------------------------- test helpers
def product_module_names() -> set[str]:
    """The last name of every module and package of the product."""
    names = set()
    for package in ("controlplane", "predictors", "agents"):
        for path in (ROOT / package).rglob("*.py"):
            names.add(path.parent.name if path.stem == "__init__" else path.stem)
    return names


def bare_helpers(tests: Path = ROOT / "tests") -> dict[str, Path]:
    """Helper modules a test imports by bare name: a module beside the tests in a folder
    without ``__init__.py`` (pytest puts such folders on the path) that is no test module
    and no conftest. Packages (folders with ``__init__.py``) are what tests import by name
    instead."""
    found = {}
    for folder in [tests, *sorted(p for p in tests.iterdir() if p.is_dir())]:
        if (folder / "__init__.py").exists():
            continue
        for path in sorted(folder.glob("*.py")):
            if not path.name.startswith("test_") and path.name != "conftest.py":
                found[path.stem] = path
    for package in sorted(p for p in tests.iterdir() if (p / "__init__.py").exists()):
        found[package.name] = package
    return found


def test_no_test_helper_takes_the_name_of_a_product_module() -> None:
    clashes = {name: str(path.relative_to(ROOT)) for name, path in bare_helpers().items()
               if name in product_module_names()}
    assert not clashes, f"test helpers named like product modules: {clashes}"


def test_a_helper_named_like_a_product_module_is_caught(tmp_path: Path) -> None:
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / "harness.py").write_text("")
    (tmp_path / "live" / "test_x.py").write_text("")
    assert "harness" in bare_helpers(tmp_path)
    assert "harness" in product_module_names()

