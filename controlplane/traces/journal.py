"""The kvprefetch event journal: the live control plane's record of session events.

File format (JSONL, UTF-8, optionally gzip-compressed as ``.jsonl.gz`` once rotated):

* line 1, a header: ``{"kvprefetch_journal": 1, ...}`` (the format version, then free
  metadata given to :class:`JournalWriter`);
* then one :class:`~controlplane.base.types.SessionEvent` per line, as a flat object with the
  short keys ``kind``, ``session``, ``t``, ``turn``, ``in``, ``out``, ``reused``, ``stop``,
  ``hint``, ``eta_s``, ``node``, ``tenant``, ``parent``, ``ctx`` (``None`` fields are
  omitted).
  ``t`` is the service clock in seconds. Unknown keys are ignored, so version 1 may gain
  optional keys; a change of meaning bumps the version.

Crash safety: the writer appends each event as one ``write`` of one complete line, so a crash
can only tear the *last* line. The reader ignores a torn last line (one without its final
newline that does not parse) and logs a warning; a bad line anywhere else is an error
(:class:`~controlplane.base.errors.TraceFormatError` naming file, line and field). On opening an
existing journal the writer first cuts such a torn tail, so appending never buries it.

As a trace (:func:`load_journal`), the journal is replayed closed-loop: ``request_started``
gives the arrival, ``in`` and ``reused``; ``request_finished`` gives ``out``, ``stop`` and
``api_time_s`` = finish - start; ``gap_s`` of request ``i`` = start_i - finish_{i-1}
(clamped at 0; ``None`` if request ``i - 1`` never finished or is missing). Requests are
numbered 0, 1, ... in turn order. ``start_s`` is relative to the journal's first event.
Hints and ``session_closed`` events are for predictors and do not shape the trace.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import pydantic_core
from tqdm import tqdm

from controlplane.base.errors import TraceFormatError
from controlplane.base.types import (
    EventKind,
    HintKind,
    SessionEvent,
    Trace,
    TraceRequest,
    TraceSession,
)
from controlplane.traces._fields import FieldReader, check_exists

FORMAT_NAME = "journal"
HEADER_KEY = "kvprefetch_journal"
JOURNAL_VERSION = 1

_log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# One event <-> one JSON object.
# ---------------------------------------------------------------------------------------------


def event_to_dict(event: SessionEvent) -> dict[str, Any]:
    """The journal line of ``event`` as a dict (``None`` fields omitted)."""
    out: dict[str, Any] = {
        "kind": event.kind.value,
        "session": event.session_id,
        "t": event.time_s,
        "turn": event.turn,
        "in": event.input_tokens,
        "out": event.output_tokens,
        "reused": event.reused_tokens,
        "stop": event.stop_reason,
        "hint": event.hint.value if event.hint is not None else None,
        "eta_s": event.eta_s,
        "node": event.node,
        "tenant": event.tenant,
        "parent": event.parent_id,
        "ctx": event.context_tokens,
    }
    return {key: value for key, value in out.items() if value is not None}


def event_from_dict(
    obj: Mapping[str, Any], *, path: str | Path | None = None, line: int | None = None
) -> SessionEvent:
    """Parse one journal object; errors name ``path``, ``line`` and the field."""
    reader = FieldReader(Path(path) if path is not None else Path("<event>"), line)
    row = reader.mapping(obj, "event")
    kind_text = reader.text(row, "kind")
    try:
        kind = EventKind(kind_text)
    except ValueError:
        known = ", ".join(k.value for k in EventKind)
        raise reader.error("kind", f"unknown event kind {kind_text!r} (known: {known})") from None
    hint_text = reader.optional_text(row, "hint")
    hint: HintKind | None = None
    if hint_text is not None:
        try:
            hint = HintKind(hint_text)
        except ValueError:
            known = ", ".join(h.value for h in HintKind)
            raise reader.error("hint", f"unknown hint {hint_text!r} (known: {known})") from None
    session_id = reader.text(row, "session")
    return SessionEvent(
        kind=kind,
        session_id=session_id,
        time_s=reader.number(row, "t"),
        turn=reader.count(row, "turn", default=0),
        input_tokens=reader.count(row, "in", default=0),
        output_tokens=reader.count(row, "out", default=0),
        reused_tokens=reader.count(row, "reused", default=0),
        stop_reason=reader.optional_text(row, "stop"),
        hint=hint,
        eta_s=reader.seconds(row, "eta_s", optional=True),
        node=_node(reader, row),
        tenant=reader.optional_text(row, "tenant") or "default",
        parent_id=reader.optional_text(row, "parent"),
        context_tokens=reader.count(row, "ctx") if row.get("ctx") is not None else None,
    )


def _node(reader: FieldReader, row: Mapping[str, Any]) -> int | None:
    """The event's node number; journals written before it was an int hold its digits."""
    value = row.get("node")
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return reader.count(row, "node")


# ---------------------------------------------------------------------------------------------
# Writing.
# ---------------------------------------------------------------------------------------------


class JournalWriter:
    """Appends session events to a journal file, one line each.

    Called by the live control plane for every event it observes (often: once per request
    start and finish, plus hints), from any thread. The constructor does no I/O;
    :meth:`open` (or ``with``) creates the file with its header, or reopens an existing
    journal for appending after cutting a torn last line. Each event is one ``write`` of one
    complete line; :meth:`flush` hands buffered lines to the OS (``sync=True`` also fsyncs).
    """

    def __init__(self, path: str | Path, *, metadata: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self._metadata = dict(metadata or {})
        self._file: IO[bytes] | None = None
        self._lock = threading.Lock()

    def open(self) -> Self:
        if self._file is not None:
            return self
        if self.path.name.endswith(".gz"):
            raise TraceFormatError("cannot append to a compressed journal", path=self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cut_torn_tail()
        self._file = self.path.open("ab")
        if self._file.tell() == 0:
            header = {HEADER_KEY: JOURNAL_VERSION, **self._metadata}
            self._file.write(_encode(header))
        return self

    def write(self, event: SessionEvent) -> None:
        data = _encode(event_to_dict(event))
        with self._lock:
            if self._file is None:
                raise RuntimeError("JournalWriter is not open; call open() or use 'with'")
            self._file.write(data)

    def flush(self, *, sync: bool = False) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.flush()
            if sync:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _cut_torn_tail(self) -> None:
        """Drop a partial last line left by a crash, and refuse to append to a non-journal."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with self.path.open("r+b") as f:
            first = f.readline()
            try:
                header = json.loads(first)
            except ValueError:
                header = None
            if not (isinstance(header, dict) and HEADER_KEY in header):
                raise TraceFormatError(
                    "not a kvprefetch journal; refusing to append", path=self.path, line=1
                )
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return
            # Find the last newline; everything after it is the torn line.
            position = size
            while position > 0:
                step = min(65536, position)
                f.seek(position - step)
                chunk = f.read(step)
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    position = position - step + cut + 1
                    break
                position -= step
            _log.warning(
                "%s: cutting a torn last line (%d bytes) before appending",
                self.path,
                size - position,
            )
            f.truncate(position)


def _encode(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


# ---------------------------------------------------------------------------------------------
# Reading.
# ---------------------------------------------------------------------------------------------


def read_journal_events(path: str | Path) -> Iterator[SessionEvent]:
    """The events of a journal, in file order (see the module docstring for torn lines)."""
    for _line, event in _numbered_events(Path(path)):
        yield event


def _numbered_events(path: Path, *, progress: bool = False) -> Iterator[tuple[int, SessionEvent]]:
    check_exists(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as stream:
        lines = tqdm(stream, desc="journal", unit="line", disable=not progress)
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            complete = raw.endswith(b"\n")
            try:
                obj = pydantic_core.from_json(raw)
            except ValueError as exc:
                if not complete:
                    _log.warning("%s:%d: ignoring a torn last line", path, number)
                    return
                raise TraceFormatError(f"invalid JSON: {exc}", path=path, line=number) from None
            if isinstance(obj, dict) and HEADER_KEY in obj:
                version = obj[HEADER_KEY]
                if version != JOURNAL_VERSION:
                    raise TraceFormatError(
                        f"unsupported journal version {version!r} (this reader: {JOURNAL_VERSION})",
                        path=path,
                        line=number,
                        field=HEADER_KEY,
                    )
                continue
            yield number, event_from_dict(obj, path=path, line=number)


# ---------------------------------------------------------------------------------------------
# The journal as a trace.
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _SessionLog:
    started: dict[int, SessionEvent] = field(default_factory=dict)
    finished: dict[int, SessionEvent] = field(default_factory=dict)
    parent_id: str | None = None
    tenant: str = "default"


def load_journal(
    path: str | Path, *, limit_sessions: int | None = None, progress: bool = False
) -> Trace:
    """Rebuild the sessions recorded in a journal; see the module docstring."""
    source = Path(path)
    logs: dict[str, _SessionLog] = {}
    first_t: float | None = None
    for number, event in _numbered_events(source, progress=progress):
        first_t = event.time_s if first_t is None else min(first_t, event.time_s)
        log = logs.setdefault(event.session_id, _SessionLog())
        log.parent_id = log.parent_id or event.parent_id
        if event.kind is EventKind.REQUEST_STARTED:
            if event.turn in log.started:
                raise TraceFormatError(
                    f"request_started repeated for session {event.session_id!r} turn {event.turn}",
                    path=source,
                    line=number,
                    field="turn",
                )
            log.started[event.turn] = event
            log.tenant = event.tenant
        elif event.kind is EventKind.REQUEST_FINISHED:
            log.finished[event.turn] = event
    sessions = [
        session
        for session_id, log in logs.items()
        if (session := _build_session(session_id, log, first_t or 0.0)) is not None
    ]
    if not sessions:
        raise TraceFormatError("trace has no requests (no request_started events)", path=source)
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    name = source.name.removesuffix(".gz").removesuffix(".jsonl")
    return Trace(name, tuple(sessions), FORMAT_NAME, 0).limit_sessions(limit_sessions)


def _build_session(session_id: str, log: _SessionLog, t0: float) -> TraceSession | None:
    if not log.started:
        return None
    turns = sorted(log.started)
    session_start = log.started[turns[0]].time_s
    requests: list[TraceRequest] = []
    for index, turn in enumerate(turns):
        start = log.started[turn]
        finish = log.finished.get(turn)
        previous_finish = log.finished.get(turn - 1) if index > 0 else None
        gap_s = None
        if previous_finish is not None and turns[index - 1] == turn - 1:
            gap_s = max(0.0, start.time_s - previous_finish.time_s)
        requests.append(
            TraceRequest(
                session_id=session_id,
                turn=index,
                offset_s=start.time_s - session_start,
                input_tokens=start.input_tokens,
                output_tokens=finish.output_tokens if finish is not None else 0,
                reused_tokens=min(start.reused_tokens, start.input_tokens),
                gap_s=gap_s,
                stop_reason=finish.stop_reason if finish is not None else None,
                api_time_s=max(0.0, finish.time_s - start.time_s) if finish is not None else None,
            )
        )
    return TraceSession(
        session_id=session_id,
        start_s=session_start - t0,
        requests=tuple(requests),
        parent_id=log.parent_id,
        tenant=log.tenant,
    )
