"""Compaction (:func:`compact_journal`) of the scheduler's journal
(:mod:`kvprefetch.controlplane.journal.live`): the journal is rewritten atomically as its
header, the last scheduler-start record and the records of the sessions still live, each
from after its last close: the events of closed sessions are dropped, so resuming costs the
live sessions' events, not the history. A route record
(:class:`~kvprefetch.controlplane.journal.file.RouteRecord`) stays while the scheduler
remembers its request id (where it names the ids it remembers) and its session is kept, or
it records a cancel (a retry of a cancelled route is refused after a restart too, also when
the cancel closed the session). Records written while it ran are copied over as they are
(the tail). What compaction forgets: the books of closed sessions' KV that may still sit in
a node's tier (an agent's hello reconciles them away after a restart anyway), the core's
counters, and what an online predictor learnt from closed sessions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic_core

from kvprefetch.controlplane.base.types import EventKind
from kvprefetch.controlplane.journal.file import HEADER_KEY, JOURNAL_VERSION, RouteRecord, file_mode
from kvprefetch.controlplane.journal.live import LiveJournalScanner


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What :func:`compact_journal` did: records read and kept, bytes before and after."""

    records_before: int
    records_after: int
    bytes_before: int
    bytes_after: int
    #: Records of the compacted prefix that were damaged (left out, not quarantined here).
    damaged: int

    def to_dict(self) -> dict[str, int]:
        return {"records_before": self.records_before, "records_after": self.records_after,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "damaged": self.damaged}


def live_records(path: Path, upto_bytes: int, live: Collection[str] | None,
                 routes: Collection[tuple[str, str]] | None = None
                 ) -> tuple[list[bytes], int, int]:
    """The records of the first ``upto_bytes`` bytes of the journal that a compacted copy
    keeps: the last scheduler-start record and every record of a session in ``live``
    (None: every session not closed at the end of the prefix) from after its last close, in
    file order; and the route records of the sessions kept, and those of cancels, whose
    (tenant, request id) is in ``routes`` (None: any). Returns (records, records read,
    damaged records left out)."""
    scan = LiveJournalScanner(path)
    by_session: dict[str, list[tuple[int, bytes]]] = {}
    route_lines: list[tuple[int, bytes, RouteRecord]] = []
    epoch: tuple[int, bytes] | None = None
    for number, raw, event in scan.lines(upto_bytes):
        if event is None:
            if scan.last_line_was_epoch:
                epoch = (number, raw)
            elif scan.route is not None:
                route_lines.append((number, raw, scan.route))
        elif event.kind is EventKind.SESSION_CLOSED:
            by_session.pop(event.session_id, None)
        else:
            by_session.setdefault(event.session_id, []).append((number, raw))
    keep = [r for sid, records in by_session.items() if live is None or sid in live
            for r in records]
    for number, raw, route in route_lines:
        kept = route.session_id in by_session and (live is None or route.session_id in live)
        if (kept or route.cancelled) and (
                routes is None or (route.tenant, route.request_id) in routes):
            keep.append((number, raw))
    if epoch is not None:  # in its place: the records stay in sequence
        keep.append(epoch)
    keep.sort(key=lambda r: r[0])
    return [raw for _, raw in keep], scan.records, len(scan.damaged)


def write_compacted(path: Path, records: Sequence[bytes],
                    metadata: Mapping[str, Any] | None = None) -> Path:
    """A temporary file beside ``path`` holding a fresh header (``metadata`` and
    ``compacted``) and ``records``; :func:`publish_compacted` puts it in place."""
    header = {HEADER_KEY: JOURNAL_VERSION, **(metadata or {}), "compacted": True}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".compacting", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode(path))
            f.write(pydantic_core.to_json(header) + b"\n")
            for raw in records:
                f.write(raw if raw.endswith(b"\n") else raw + b"\n")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def publish_compacted(tmp: Path, path: Path, from_bytes: int) -> int:
    """Append the journal's records from byte ``from_bytes`` on (written while the
    compacted copy was made) to ``tmp``, fsync it and rename it over ``path``: a reader
    sees the old journal or the whole new one. Returns the new journal's size."""
    try:
        with tmp.open("ab") as out, path.open("rb") as src:
            src.seek(from_bytes)
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a crash once the directory is synced
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return size
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return size


def compact_journal(path: str | Path, live: Collection[str] | None = None, *,
                    metadata: Mapping[str, Any] | None = None,
                    routes: Collection[tuple[str, str]] | None = None) -> CompactionResult:
    """Rewrite the journal at ``path`` atomically without the records of closed sessions
    (see the module docstring); ``live`` and ``routes`` as in :func:`live_records`. Run it where no
    writer appends to the file (the scheduler at start-up, ``kvprefetch journal compact``).
    A journal with damaged records is left as it is (``damaged`` in the result says so):
    quarantine them first."""
    p = Path(path)
    size = p.stat().st_size
    records, read, damaged = live_records(p, size, live, routes)
    if damaged:
        return CompactionResult(read, read, size, size, damaged)
    tmp = write_compacted(p, records, metadata)
    after = publish_compacted(tmp, p, size)
    return CompactionResult(read, len(records) + 1, size, after, 0)
