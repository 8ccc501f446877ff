"""Which test modules a ``-m`` expression deselects whole, told from their text: the
collection shortcut of ``tests/conftest.py``."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from _pytest.mark.expression import Expression

#: A module-level ``pytestmark`` of plain marks: ``pytest.mark.servers`` or a list of them.
_MODULE_MARKS = re.compile(r"^pytestmark = \[?((?:pytest\.mark\.\w+(?:, )?)+)\]?$", re.M)
_WORDS = re.compile(r"[A-Za-z_]\w*")


def module_marks(path: Path) -> frozenset[str]:
    """The marks a test module puts on all its tests, read from its text (no import)."""
    found = _MODULE_MARKS.search(path.read_text())
    return frozenset(re.findall(r"pytest\.mark\.(\w+)", found.group(1))) if found else frozenset()


def deselects_whole(markexpr: str, marks: frozenset[str]) -> bool:
    """Whether ``-m markexpr`` deselects every test that carries ``marks``, whatever other
    marks each test has: false under every assignment of the expression's other names."""
    expression = Expression.compile(markexpr)
    others = sorted(set(_WORDS.findall(markexpr)) - {"and", "or", "not"} - marks)
    for values in itertools.product((False, True), repeat=len(others)):
        on = marks | {name for name, value in zip(others, values, strict=True) if value}
        if expression.evaluate(on.__contains__):
            return False
    return True
