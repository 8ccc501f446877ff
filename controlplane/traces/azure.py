"""Loader for the Azure LLM inference traces (Splitwise, 2023): arrivals and lengths only.

Input: CSV with a header ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps look like
``2023-11-16 18:15:46.6805900`` (seven fractional digits, more than ``datetime`` parses, so
they are parsed by hand). There are no sessions and no prefix hashes: every row becomes a
one-request session ``r000000``, ``r000001``... (by row) with no reuse, starting at its
timestamp minus the first row's timestamp (open-loop).
"""

from __future__ import annotations

import csv
from datetime import date
from pathlib import Path

from tqdm import tqdm

from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.base.fields import FieldReader, check_exists, open_text
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession

FORMAT_NAME = "azure"
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
TICKS_PER_S = 10_000_000  # timestamps carry 100 ns resolution; keep them exact as ints


def load_azure(
    path: str | Path, *, limit_sessions: int | None = None, progress: bool = False
) -> Trace:
    """Load an Azure LLM inference trace CSV; see the module docstring."""
    source = Path(path)
    check_exists(source)
    rows: list[tuple[int, int, int, int]] = []  # (row, ticks, context tokens, generated)
    with open_text(source) as stream:
        reader = csv.reader(stream)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError("trace has no requests (empty file)", path=source)
        columns = {name.strip(): i for i, name in enumerate(header)}
        for name in COLUMNS:
            if name not in columns:
                raise TraceFormatError("missing CSV column", path=source, line=1, field=name)
        ts_col, in_col, out_col = (columns[name] for name in COLUMNS)
        for cells in tqdm(reader, desc="azure", unit="row", disable=not progress):
            line = reader.line_num
            if not any(c.strip() for c in cells):
                continue
            fields = FieldReader(source, line)
            if len(cells) != len(header):
                raise TraceFormatError(
                    f"expected {len(header)} columns, got {len(cells)}", path=source, line=line
                )
            ticks = _parse_timestamp(cells[ts_col], fields)
            record = {"ContextTokens": _to_int(cells[in_col])}
            record["GeneratedTokens"] = _to_int(cells[out_col])
            context = fields.count(record, "ContextTokens")
            generated = fields.count(record, "GeneratedTokens")
            rows.append((len(rows), ticks, context, generated))
    if not rows:
        raise TraceFormatError("trace has no requests", path=source)
    t0 = min(r[1] for r in rows)
    sessions = [
        TraceSession(
            session_id=f"r{index:06d}",
            start_s=(ticks - t0) / TICKS_PER_S,
            requests=(TraceRequest(f"r{index:06d}", 0, 0.0, context, generated),),
        )
        for index, ticks, context, generated in rows
    ]
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    name = source.name.removesuffix(".gz").removesuffix(".csv")
    return Trace(name, tuple(sessions), FORMAT_NAME, 0).limit_sessions(limit_sessions)


def _to_int(cell: str) -> object:
    """A CSV cell as an int when it is one (the field check reports anything else)."""
    try:
        return int(cell.strip())
    except ValueError:
        return cell


def _parse_timestamp(cell: str, fields: FieldReader) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` as an exact count of 100 ns ticks."""
    try:
        day_text, _, time_text = cell.strip().partition(" ")
        hours, minutes, seconds = time_text.split(":")
        whole, _, fraction = seconds.partition(".")
        if not (fraction.isdigit() or fraction == "") or len(fraction) > 7:
            raise ValueError(cell)
        second_of_day = int(hours) * 3600 + int(minutes) * 60 + int(whole)
        if not 0 <= second_of_day <= 86400:
            raise ValueError(cell)
        day = date.fromisoformat(day_text).toordinal()
        return (day * 86400 + second_of_day) * TICKS_PER_S + int(fraction.ljust(7, "0"))
    except ValueError:
        raise fields.error(
            "TIMESTAMP", f"expected 'YYYY-MM-DD HH:MM:SS.fffffff', got {cell!r}"
        ) from None
