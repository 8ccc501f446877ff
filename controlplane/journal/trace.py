"""The journal as a trace: its session events in file order (:func:`read_journal_events`)
and the sessions they record (:func:`load_journal`), for ``sim --trace``, ``train --trace``
and the other trace readers. Both are strict: a damaged line raises
:class:`~kvprefetch.controlplane.base.errors.TraceFormatError` naming file, line and field
(the format, torn last lines and damage: :mod:`kvprefetch.controlplane.journal.file`).

As a trace, the journal is replayed closed-loop: ``request_started`` gives the arrival,
``in`` and ``reused``; ``request_finished`` gives ``out``, ``stop`` and ``api_time_s`` =
finish - start; ``gap_s`` of request ``i`` = start_i - finish_{i-1} (clamped at 0; ``None``
if request ``i - 1`` never finished or is missing). Requests are numbered 0, 1, ... in turn
order. ``start_s`` is relative to the journal's first event. Hints are for predictors and do
not shape the trace. A session id used again after its ``session_closed`` (the service
numbers the new session's turns from 0 again), or whose turn 0 starts again, is a new
session of the trace, named ``<id>#2``, ``<id>#3``, ...
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.base.types import (
    EventKind,
    SessionEvent,
    Trace,
    TraceRequest,
    TraceSession,
)
from kvprefetch.controlplane.journal.file import JournalScanner

FORMAT_NAME = "journal"


def read_journal_events(path: str | Path) -> Iterator[SessionEvent]:
    """The events of a journal, in file order (a torn last line is ignored, see
    :mod:`kvprefetch.controlplane.journal.file`). Strict: a damaged line raises
    :class:`TraceFormatError` (``kvprefetch journal check --repair`` sets damaged lines
    aside)."""
    for _line, event in JournalScanner(path, strict=True):
        yield event


def _numbered_events(path: Path, *, progress: bool = False) -> Iterator[tuple[int, SessionEvent]]:
    yield from JournalScanner(path, strict=True, progress=progress)



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
    #: Session id -> its current incarnation (1, 2, ...) and whether that one is closed.
    lives: dict[str, tuple[int, bool]] = {}
    first_t: float | None = None
    for number, event in _numbered_events(source, progress=progress):
        first_t = event.time_s if first_t is None else min(first_t, event.time_s)
        life, closed = lives.get(event.session_id, (1, False))
        key = _incarnation_id(event.session_id, life)
        if closed or (event.kind is EventKind.REQUEST_STARTED and event.turn == 0
                      and 0 in logs.get(key, _SessionLog()).started):
            life += 1
            key = _incarnation_id(event.session_id, life)
        lives[event.session_id] = (life, event.kind is EventKind.SESSION_CLOSED)
        log = logs.setdefault(key, _SessionLog())
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


def _incarnation_id(session_id: str, life: int) -> str:
    return session_id if life == 1 else f"{session_id}#{life}"


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
