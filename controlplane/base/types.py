"""Plain, frozen records shared by the trace loaders, the scheduling core, the predictors and
the simulator. No I/O, no third-party imports.

Time is in seconds (float) everywhere; token counts are ints; bytes are ints.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

#: The tenant of sessions whose client names none.
DEFAULT_TENANT = "default"

# ---------------------------------------------------------------------------------------------
# Traces: what the loaders yield and the simulator replays.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request (turn) of a session, as recorded in a trace.

    ``gap_s`` is the client's idle time between the end of the previous response of this
    session and this request (think time, tool run time). When it is known the simulator
    replays the session *closed-loop*: the request arrives ``gap_s`` after the simulated
    previous response ended, as a real agent or user would. When it is ``None`` (traces with
    no response timing, such as Mooncake or Azure), the request arrives open-loop at
    ``session.start_s + offset_s``.

    ``reused_tokens`` is the length of the prefix this request shares with the session's
    previous context (its previous input and output), derived from the trace's block hashes;
    it is the part whose KV cache can be reused if it is still somewhere.
    """

    session_id: str
    turn: int
    offset_s: float
    input_tokens: int
    output_tokens: int
    reused_tokens: int = 0
    gap_s: float | None = None
    stop_reason: str | None = None
    api_time_s: float | None = None

    @property
    def new_tokens(self) -> int:
        """Tokens that must be prefilled even when all reusable KV is local."""
        return self.input_tokens - self.reused_tokens

    @property
    def context_tokens_after(self) -> int:
        """Tokens of KV the session holds once this request has finished (input + output)."""
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class TraceSession:
    """A session: an ordered list of requests sharing one growing context.

    ``start_s`` is on the replay clock (seconds since the replay started). ``parent_id`` is
    set for child sessions (Claude Code sub-agents).
    """

    session_id: str
    start_s: float
    requests: tuple[TraceRequest, ...]
    parent_id: str | None = None
    tenant: str = DEFAULT_TENANT

    @property
    def closed_loop(self) -> bool:
        return any(r.gap_s is not None for r in self.requests[1:])


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: sessions sorted by start time (ties by id), plus where it came from."""

    name: str
    sessions: tuple[TraceSession, ...]
    source_format: str
    block_tokens: int = 0

    @property
    def requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)

    def iter_requests(self) -> Iterator[TraceRequest]:
        for s in self.sessions:
            yield from s.requests

    def limit_sessions(self, n: int | None) -> Trace:
        """The first ``n`` sessions by start time (all of them when ``n`` is None)."""
        if n is None or n >= len(self.sessions):
            return self
        return Trace(self.name, self.sessions[:n], self.source_format, self.block_tokens)


# ---------------------------------------------------------------------------------------------
# Session events: what the gateway reports, the journal records and predictors observe.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class SessionKey:
    """The identity of one session: (tenant, session id). Session ids are unique within a
    tenant only. ``wire`` is its one string form ("tenant/session"), used wherever a single
    opaque name is needed (the core's and the predictors' session ids, the journal, order
    messages); :meth:`parse` reads it back. Session ids may themselves contain '/'
    (Claude Code sub-agents), tenants may not."""

    tenant: str
    session_id: str

    @property
    def wire(self) -> str:
        return f"{self.tenant}/{self.session_id}"

    @classmethod
    def parse(cls, wire: str) -> SessionKey:
        """The key of a ``wire`` name; a name without a tenant is the default tenant's."""
        tenant, sep, session_id = wire.partition("/")
        if not sep:
            return cls(DEFAULT_TENANT, wire)
        return cls(tenant, session_id)

    def __str__(self) -> str:
        return self.wire


class EventKind(enum.StrEnum):
    REQUEST_STARTED = "request_started"
    REQUEST_FINISHED = "request_finished"
    HINT = "hint"
    SESSION_CLOSED = "session_closed"


class HintKind(enum.StrEnum):
    USER_TYPING = "user_typing"  # a person is composing the next turn; eta_s optional
    TOOL_RUNNING = "tool_running"  # a tool call is executing; eta_s = expected duration
    SESSION_CLOSED = "session_closed"  # the session will not return


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """One event of one session.

    ``turn`` counts requests of the session from 0. For ``REQUEST_FINISHED`` the token
    counts are those of the finished request and ``stop_reason`` is the response's stop
    reason where known ("tool_use", "end_turn", ...). For ``HINT`` events ``hint`` and
    optionally ``eta_s`` are set.
    """

    kind: EventKind
    session_id: str
    time_s: float
    turn: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    reused_tokens: int = 0
    stop_reason: str | None = None
    hint: HintKind | None = None
    eta_s: float | None = None
    #: The node that served the request (``REQUEST_FINISHED``); None where not known.
    node: int | None = None
    tenant: str = DEFAULT_TENANT
    parent_id: str | None = None


# ---------------------------------------------------------------------------------------------
# Forecasts: what predictors return to the planner.
# ---------------------------------------------------------------------------------------------

#: The quantile levels every forecast carries, ascending.
FORECAST_LEVELS: tuple[float, ...] = (0.1, 0.5, 0.9)


@dataclass(frozen=True, slots=True)
class ArrivalForecast:
    """A predictor's view of when one idle session sends its next request.

    ``gap_quantiles_s`` are the quantiles of the time from ``last_finish_s`` to the next
    arrival at the levels of :data:`FORECAST_LEVELS` (non-decreasing), *given that the
    session returns*. ``p_return`` is the probability that it returns within ``horizon_s``
    of ``last_finish_s``. ``confidence`` in [0, 1] says how much the planner should trust
    the timing (0 = a guess from no history, 1 = certain, as for the oracle).
    ``conditioned``: the quantiles already account for the session's silence so far (a
    learned survival-style forecast evaluated at ``now``), so the planner adds no recency
    floor of its own.
    """

    session_id: str
    last_finish_s: float
    gap_quantiles_s: tuple[float, ...]
    p_return: float
    horizon_s: float
    confidence: float
    levels: tuple[float, ...] = field(default=FORECAST_LEVELS)
    conditioned: bool = False

    def gap_at(self, level: float) -> float:
        """Gap quantile at ``level``, linearly interpolated between the stored levels."""
        levels, values = self.levels, self.gap_quantiles_s
        if level <= levels[0]:
            return values[0]
        for i in range(1, len(levels)):
            if level <= levels[i]:
                lo, hi = levels[i - 1], levels[i]
                w = (level - lo) / (hi - lo)
                return values[i - 1] + w * (values[i] - values[i - 1])
        return values[-1]

    def arrival_at(self, level: float) -> float:
        """Absolute time of the ``level`` quantile of the next arrival."""
        return self.last_finish_s + self.gap_at(level)
