"""The code blocks of a documentation page, and a script that runs them in order as written.

A block preceded by ``<!-- docs-test: skip: REASON -->`` is not run (it installs packages,
or runs for minutes); every other ``bash`` block runs in one shell, in page order, and every
``python`` block runs as a file with the same environment, so an ``export`` of one block
holds in the next. A ``kvprefetch serve`` line other than ``--check`` serves until stopped:
the script starts it in the background (its output in ``serve.log``, its pid in
``serve.pid``) and goes on once it prints ``kvprefetch serve: ready``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"(?:<!-- docs-test: skip: (?P<skip>[^\n]*?) -->\n)?"
                    r"```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)
#: Seconds the script waits for ``kvprefetch serve: ready``.
SERVE_READY_S = 240


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    skip: str | None


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``docs/<page>``, in order."""
    text = (DOCS / page).read_text()
    return [Block(m["lang"], m["code"], m["skip"]) for m in _BLOCK.finditer(text)]


def _serve_line(line: str) -> bool:
    words = line.split("#", 1)[0].split()
    return words[:2] == ["kvprefetch", "serve"] and "--check" not in words


def script(page_blocks: list[Block], workdir: Path) -> str:
    """One bash script that runs the blocks not skipped, in order (python blocks from
    files ``block-<i>.py`` written into ``workdir``)."""
    out = ["set -euo pipefail"]
    for i, b in enumerate(page_blocks):
        if b.skip is not None:
            continue
        if b.lang == "python":
            (workdir / f"block-{i}.py").write_text(b.code)
            out.append(f"python block-{i}.py")
        elif b.lang == "bash":
            for line in b.code.splitlines():
                if not _serve_line(line):
                    out.append(line)
                    continue
                command = line.split("#", 1)[0].rstrip()
                out += [f"{command} > serve.log 2>&1 &", "echo $! > serve.pid",
                        f"for _ in $(seq {SERVE_READY_S * 5}); do",
                        "  grep -q 'kvprefetch serve: ready' serve.log && break",
                        "  kill -0 $(cat serve.pid) 2>/dev/null || "
                        "{ cat serve.log >&2; exit 3; }",
                        "  sleep 0.2", "done",
                        "grep -q 'kvprefetch serve: ready' serve.log || "
                        "{ cat serve.log >&2; exit 4; }"]
        else:
            raise AssertionError(f"block {i}: language {b.lang!r} is neither bash nor python "
                                 "and not marked skip")
    return "\n".join(out) + "\n"
