"""Griffe extension: the project's reStructuredText markup in docstrings, as Markdown.

Docstrings use Sphinx roles (:class:`~x.y.Z`), double back-quotes and ``::`` literal
blocks; mkdocstrings renders Markdown. Before rendering, roles become code spans (the last
name only with ``~``), double back-quotes single ones, and an indented block after a line
ending in ``::`` a fenced code block.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _literal_blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            head = line.rstrip()[:-1]  # "public face::" -> "public face:"
            out.append(head if head.strip() != ":" else "")
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            base = len(line) - len(line.lstrip())
            block: list[str] = []
            while j < len(lines) and (not lines[j].strip()
                                      or len(lines[j]) - len(lines[j].lstrip()) > base):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            if block:
                indent = min(len(b) - len(b.lstrip()) for b in block if b.strip())
                out += ["", " " * base + "```python",
                        *(" " * base + b[indent:] for b in block), " " * base + "```", ""]
                i = j
                continue
            i += 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def convert(text: str) -> str:
    text = _literal_blocks(text)
    text = _ROLE.sub(_role, text)
    return re.sub(r"(?<!`)``(?!`)", "`", text)


class SphinxMarkup(Extension):
    def __init__(self) -> None:
        super().__init__()
        self._done: set[int] = set()

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None and id(docstring) not in self._done:
            self._done.add(id(docstring))
            docstring.value = convert(docstring.value)

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        # Packages' own docstrings come through here (conversion is idempotent).
        self.on_object(obj=obj)
