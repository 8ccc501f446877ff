"""Guess a trace file's format from its name and first line (``fmt="auto"``).

* a directory, ``*.json`` or ``*.json.gz`` -> ``claude-code``;
* ``*.jsonl`` / ``*.jsonl.gz``: the first non-empty line decides: a ``kvprefetch_journal``
  header or an event with ``kind`` -> ``journal``; ``hash_ids`` and ``timestamp`` ->
  ``mooncake``;
* ``*.csv`` / ``*.csv.gz`` whose header has ``TIMESTAMP`` -> ``azure``.

Anything else raises :class:`~kvprefetch.controlplane.base.errors.UnknownFormatError` listing the
formats.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from kvprefetch.controlplane.base.errors import UnknownFormatError
from kvprefetch.controlplane.base.fields import check_exists, numbered_lines, open_text

#: Every format :func:`kvprefetch.controlplane.traces.load_trace` reads, by name.
FORMATS: tuple[str, ...] = ("claude-code", "mooncake", "azure", "journal")


def known_formats_text() -> str:
    return ", ".join(FORMATS)


def detect_format(path: str | Path) -> str:
    """The format name of the trace at ``path``; see the module docstring."""
    source = Path(path)
    check_exists(source)
    name = source.name.lower()
    if source.is_dir() or name.endswith((".json", ".json.gz")):
        return "claude-code"
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _detect_jsonl(source)
    if name.endswith((".csv", ".csv.gz")):
        with open_text(source) as stream:
            header = next(csv.reader(stream), [])
        if "TIMESTAMP" in (cell.strip() for cell in header):
            return "azure"
        raise _unknown(source, "a CSV file without a TIMESTAMP column")
    raise _unknown(source, "an unrecognised file name extension")


def _detect_jsonl(source: Path) -> str:
    with open_text(source) as stream:
        first = next(numbered_lines(stream), None)
    if first is None:
        raise _unknown(source, "an empty JSONL file")
    try:
        obj = json.loads(first[1])
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        if "kvprefetch_journal" in obj or "kind" in obj:
            return "journal"
        if "hash_ids" in obj and "timestamp" in obj:
            return "mooncake"
    raise _unknown(source, "a JSONL file whose first line matches no known format")


def _unknown(source: Path, what: str) -> UnknownFormatError:
    return UnknownFormatError(
        f"{source}: cannot tell the trace format ({what}); known formats: {known_formats_text()}"
    )
