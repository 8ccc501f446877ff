"""``oracle``: reads the future from the trace being replayed (simulator only).

The predictor of the ``perfect`` policy, the reference of the forecast gap closure: its
forecast is a point mass at the true next arrival, or ``p_return = 0`` when the session
never returns.
"""

from __future__ import annotations

from kvprefetch.controlplane.base.types import (
    ArrivalForecast,
    EventKind,
    SessionEvent,
    Trace,
    TraceSession,
)

_NEVER_S = 1e12


class OraclePredictor:
    """Knows every session's future from the trace; only the simulator can build one."""

    name = "oracle"

    def __init__(self, trace: Trace) -> None:
        self._sessions: dict[str, TraceSession] = {s.session_id: s for s in trace.sessions}
        self._next_arrival: dict[str, tuple[float, float]] = {}  # id -> (finish, arrival)

    def observe(self, event: SessionEvent) -> None:
        if event.kind is EventKind.REQUEST_STARTED:
            self._next_arrival.pop(event.session_id, None)
            return
        if event.kind is not EventKind.REQUEST_FINISHED:
            return
        session = self._sessions.get(event.session_id)
        if session is None:
            return
        nxt = event.turn + 1
        if nxt >= len(session.requests):
            self._next_arrival[event.session_id] = (event.time_s, _NEVER_S)
            return
        req = session.requests[nxt]
        arrival = (
            event.time_s + req.gap_s if req.gap_s is not None else session.start_s + req.offset_s
        )
        self._next_arrival[event.session_id] = (event.time_s, max(arrival, event.time_s))

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        entry = self._next_arrival.get(session_id)
        if entry is None:
            return None
        finish, arrival = entry
        if arrival >= _NEVER_S:
            return ArrivalForecast(session_id, finish, (_NEVER_S,) * 3, 0.0, _NEVER_S, 1.0)
        gap = arrival - finish
        return ArrivalForecast(session_id, finish, (gap, gap, gap), 1.0, _NEVER_S, 1.0)

    def forget(self, session_id: str) -> None:
        self._next_arrival.pop(session_id, None)
