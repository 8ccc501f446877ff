"""The collection shortcut of tests/conftest.py: a module is skipped unimported only when
the ``-m`` expression deselects every test its module marks could be on."""

from __future__ import annotations

from pathlib import Path

import pytest
from markselect import deselects_whole, module_marks


@pytest.mark.parametrize("markexpr, marks, whole", [
    ("not servers and not slow and not live", {"servers"}, True),
    ("not servers and not slow and not live", {"slow", "servers"}, True),
    ("not vllm", {"servers"}, False),  # a test of the module may carry no vllm mark
    ("vllm", {"servers"}, False),  # ... or carry one of its own
    ("vllm", {"servers", "vllm"}, False),
    ("not vllm", {"servers", "vllm"}, True),
    ("servers or not live", {"live"}, False),
    ("(servers and live) or slow", {"live"}, False),
    ("slow and not live", {"live"}, True),
])
def test_a_module_is_skipped_only_when_no_test_of_it_could_be_selected(
        markexpr: str, marks: set[str], whole: bool) -> None:
    assert deselects_whole(markexpr, frozenset(marks)) is whole


@pytest.mark.parametrize("source, marks", [
    ("pytestmark = pytest.mark.servers\n", {"servers"}),
    ('"""Doc."""\nimport pytest\n\npytestmark = [pytest.mark.servers, pytest.mark.slow]\n',
     {"servers", "slow"}),
    ("def f():\n    pytestmark = pytest.mark.servers\n", set()),  # not at module level
    ("pytestmark = pytest.mark.skipif(True, reason='x')\n", set()),  # not a plain mark
    ("import pytest\n", set()),
])
def test_module_marks_are_read_from_the_text(tmp_path: Path, source: str,
                                             marks: set[str]) -> None:
    path = tmp_path / "test_x.py"
    path.write_text(source)
    assert module_marks(path) == marks
