"""The one feature extractor shared by training and serving.

Learned predictors never compute features themselves: they keep a :class:`FeatureTracker`,
feed it the same :class:`~kvprefetch.controlplane.base.types.SessionEvent` stream in training
(replayed from a trace by :func:`replay_session`) and in serving (from the scheduler), and read its
rows. Train/serve skew is therefore impossible by construction; artifacts record
:data:`FEATURE_SCHEMA_VERSION` and :data:`FEATURE_NAMES` and refuse to load against another
schema.

A row describes a session *at the end of a response*: only what a live system knows then
(the finished request's stop reason, its token counts and API time, the turn index and the
gaps the session has shown so far) -- never the future think time.

Gaps are modelled on ``log1p(gap_s)``: they are heavy tailed (seconds for a tool call,
minutes to hours for a person).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvprefetch.controlplane.base.types import (
    EventKind,
    HintKind,
    SessionEvent,
    Trace,
    TraceSession,
)

#: Bump whenever a feature is added, removed, reordered or computed differently.
FEATURE_SCHEMA_VERSION = 1

#: Stop reasons with their own indicator; anything else (or unknown) is "other".
KNOWN_STOP_REASONS: tuple[str, ...] = ("tool_use", "end_turn", "max_tokens")

#: Ordered feature names of a row. ``log_*`` are ``log1p`` of the quantity; gap features are
#: -1 when the session has shown no such gap yet (with a matching ``has_*`` indicator).
FEATURE_NAMES: tuple[str, ...] = (
    "stop_tool_use",
    "stop_end_turn",
    "stop_max_tokens",
    "stop_other",
    "log_input_tokens",
    "log_output_tokens",
    "log_api_time_s",
    "log_input_growth_tokens",
    "log_turn",
    "is_child",
    "log_session_age_s",
    "has_gap",
    "log_last_gap_s",
    "log_prev_gap_s",
    "ewma_log_gap",
    "max_log_gap",
    "has_gap_same_stop",
    "ewma_log_gap_same_stop",
    "last_log_gap_same_stop",
    "frac_long_gaps_same_stop",
    "log_gaps_same_stop",
    "frac_end_turn",
    "log_last_end_turn_gap_s",
    "log_gaps",
    "mean_log_gap",
    "frac_long_gaps",
)

#: A gap longer than this (seconds) counts as "long" (a person, not a tool).
LONG_GAP_S = 60.0
_LOG_LONG_GAP = math.log1p(LONG_GAP_S)
N_FEATURES = len(FEATURE_NAMES)
_INDEX = {name: i for i, name in enumerate(FEATURE_NAMES)}

#: Rows of recent responses each session keeps for sequence models (``torch-seq``).
SEQUENCE_LENGTH = 16

#: Smoothing of the per-session EWMA of log gaps.
EWMA_ALPHA = 0.3


def feature_index(name: str) -> int:
    """Column of ``name`` in a feature row."""
    return _INDEX[name]


def stop_category(stop_reason: str | None) -> str:
    """The stop reason bucket a model keys on: a known reason or ``"other"``."""
    return stop_reason if stop_reason in KNOWN_STOP_REASONS else "other"


@dataclass(slots=True)
class SessionFeatures:
    """Per-session running state; :meth:`row` is valid after a ``REQUEST_FINISHED``."""

    first_start_s: float | None = None
    start_s: float | None = None
    last_finish_s: float | None = None
    in_flight: bool = False
    closed: bool = False
    is_child: bool = False
    turn: int = 0
    finished: int = 0
    end_turns: int = 0
    prev_input_tokens: int = 0
    last_stop: str = "other"
    gaps: int = 0
    last_log_gap: float = -1.0
    prev_log_gap: float = -1.0
    ewma_log_gap: float = -1.0
    max_log_gap: float = -1.0
    #: stop bucket of the response that preceded each gap -> EWMA of those log gaps
    ewma_by_stop: dict[str, float] = field(default_factory=dict)
    #: stop bucket -> [gaps, long gaps, last log gap]
    count_by_stop: dict[str, list[float]] = field(default_factory=dict)
    sum_log_gap: float = 0.0
    long_gaps: int = 0
    last_end_turn_log_gap: float = -1.0
    #: hint state (read by ``hinted``): kind, time and eta of the latest hint
    hint: HintKind | None = None
    hint_time_s: float | None = None
    hint_eta_s: float | None = None
    row: list[float] | None = None
    #: the rows of the last SEQUENCE_LENGTH responses, oldest first
    history: deque[list[float]] = field(default_factory=lambda: deque(maxlen=SEQUENCE_LENGTH))

    def on_start(self, time_s: float) -> float | None:
        """Record a request start; returns the gap it closed (seconds) if any."""
        gap: float | None = None
        if self.first_start_s is None:
            self.first_start_s = time_s
        if self.last_finish_s is not None and not self.in_flight:
            gap = max(0.0, time_s - self.last_finish_s)
            log_gap = math.log1p(gap)
            self.gaps += 1
            self.prev_log_gap = self.last_log_gap
            self.last_log_gap = log_gap
            self.max_log_gap = max(self.max_log_gap, log_gap)
            self.ewma_log_gap = (
                log_gap
                if self.ewma_log_gap < 0
                else (1 - EWMA_ALPHA) * self.ewma_log_gap + EWMA_ALPHA * log_gap
            )
            old = self.ewma_by_stop.get(self.last_stop)
            self.ewma_by_stop[self.last_stop] = (
                log_gap if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * log_gap
            )
            is_long = 1.0 if log_gap > _LOG_LONG_GAP else 0.0
            self.sum_log_gap += log_gap
            self.long_gaps += int(is_long)
            counts = self.count_by_stop.get(self.last_stop)
            if counts is None:
                self.count_by_stop[self.last_stop] = [1.0, is_long, log_gap]
            else:
                counts[0] += 1.0
                counts[1] += is_long
                counts[2] = log_gap
            if self.last_stop == "end_turn":
                self.last_end_turn_log_gap = log_gap
        self.in_flight = True
        self.start_s = time_s
        self.hint = self.hint_time_s = self.hint_eta_s = None
        return gap

    def on_finish(self, event: SessionEvent) -> None:
        api_time_s = 0.0 if self.start_s is None else max(0.0, event.time_s - self.start_s)
        if self.first_start_s is None:
            self.first_start_s = event.time_s
        self.in_flight = False
        self.last_finish_s = event.time_s
        self.turn = event.turn
        self.finished += 1
        stop = stop_category(event.stop_reason)
        self.last_stop = stop
        if stop == "end_turn":
            self.end_turns += 1
        growth = max(0, event.input_tokens - self.prev_input_tokens) if self.finished > 1 else 0
        self.prev_input_tokens = event.input_tokens
        same = self.ewma_by_stop.get(stop)
        counts = self.count_by_stop.get(stop)
        n_gaps = self.gaps
        self.row = [
            1.0 if stop == "tool_use" else 0.0,
            1.0 if stop == "end_turn" else 0.0,
            1.0 if stop == "max_tokens" else 0.0,
            1.0 if stop == "other" else 0.0,
            math.log1p(max(0, event.input_tokens)),
            math.log1p(max(0, event.output_tokens)),
            math.log1p(api_time_s),
            math.log1p(growth),
            math.log1p(max(0, event.turn)),
            1.0 if self.is_child else 0.0,
            math.log1p(max(0.0, event.time_s - self.first_start_s)),
            1.0 if self.gaps else 0.0,
            self.last_log_gap,
            self.prev_log_gap,
            self.ewma_log_gap,
            self.max_log_gap,
            0.0 if same is None else 1.0,
            -1.0 if same is None else same,
            -1.0 if counts is None else counts[2],
            -1.0 if counts is None else counts[1] / counts[0],
            0.0 if counts is None else math.log1p(counts[0]),
            self.end_turns / self.finished,
            self.last_end_turn_log_gap,
            math.log1p(n_gaps),
            self.sum_log_gap / n_gaps if n_gaps else -1.0,
            self.long_gaps / n_gaps if n_gaps else -1.0,
        ]
        self.history.append(self.row)


class FeatureTracker:
    """Per-session feature state driven by session events (O(1) per event).

    Called by every learned predictor's ``observe``; ``rows`` gathers the rows of many
    sessions into one ``float64`` matrix for a batched forecast.
    """

    def __init__(self) -> None:
        self.sessions: dict[str, SessionFeatures] = {}

    def observe(self, event: SessionEvent) -> float | None:
        """Fold one event in; returns the gap (seconds) a ``REQUEST_STARTED`` closed."""
        st = self.sessions.get(event.session_id)
        if st is None:
            st = self.sessions[event.session_id] = SessionFeatures(
                is_child=event.parent_id is not None
            )
        kind = event.kind
        if kind is EventKind.REQUEST_STARTED:
            return st.on_start(event.time_s)
        if kind is EventKind.REQUEST_FINISHED:
            st.on_finish(event)
        elif kind is EventKind.SESSION_CLOSED or event.hint is HintKind.SESSION_CLOSED:
            st.closed = True
        elif kind is EventKind.HINT and event.hint is not None:
            st.hint, st.hint_time_s, st.hint_eta_s = event.hint, event.time_s, event.eta_s
        return None

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def ready(self, session_id: str) -> SessionFeatures | None:
        """The state of an idle session that has finished a request, else ``None``."""
        st = self.sessions.get(session_id)
        if st is None or st.in_flight or st.row is None:
            return None
        return st

    def rows(self, states: Sequence[SessionFeatures]) -> np.ndarray:
        """Feature matrix (len(states), N_FEATURES) of ready sessions."""
        if not states:
            return np.zeros((0, N_FEATURES))
        flat = itertools.chain.from_iterable(st.row for st in states)  # type: ignore[misc]
        return np.fromiter(flat, dtype=np.float64, count=len(states) * N_FEATURES).reshape(
            len(states), N_FEATURES
        )


# ---------------------------------------------------------------------------------------------
# Replaying traces as events, and the training set built from them.
# ---------------------------------------------------------------------------------------------


def replay_session(session: TraceSession) -> Iterator[SessionEvent]:
    """The events a live system would see for one recorded session, in time order.

    Request ``k`` starts ``gap_s`` after request ``k-1`` finished (closed loop) or at its
    recorded offset when the gap is unknown; it finishes ``api_time_s`` later (0 if unknown).
    """
    sid, parent = session.session_id, session.parent_id
    finish: float | None = None
    for req in session.requests:
        if finish is None:
            start = session.start_s + req.offset_s
        elif req.gap_s is not None:
            start = finish + max(0.0, req.gap_s)
        else:
            start = max(finish, session.start_s + req.offset_s)
        yield SessionEvent(
            EventKind.REQUEST_STARTED, sid, start, turn=req.turn,
            input_tokens=req.input_tokens, reused_tokens=req.reused_tokens,
            tenant=session.tenant, parent_id=parent,
        )
        finish = start + max(0.0, req.api_time_s or 0.0)
        yield SessionEvent(
            EventKind.REQUEST_FINISHED, sid, finish, turn=req.turn,
            input_tokens=req.input_tokens, output_tokens=req.output_tokens,
            reused_tokens=req.reused_tokens, stop_reason=req.stop_reason,
            tenant=session.tenant, parent_id=parent,
        )


@dataclass(frozen=True)
class GapDataset:
    """One example per finished response: its features and what happened next.

    ``gap_s`` is the time to the session's next request (``inf`` when it never returned,
    i.e. after its last request); ``returned`` is ``isfinite(gap_s)``. ``group`` is the
    session's split group (a child session shares its parent's), ``session`` its id,
    ``finish_s`` the (replay) time the response ended, ``stop`` its stop bucket.
    """

    x: np.ndarray
    gap_s: np.ndarray
    session: np.ndarray
    group: np.ndarray
    finish_s: np.ndarray
    stop: np.ndarray

    @property
    def returned(self) -> np.ndarray:
        return np.isfinite(self.gap_s)

    def __len__(self) -> int:
        return int(self.gap_s.shape[0])

    def windows(self, length: int = SEQUENCE_LENGTH) -> tuple[np.ndarray, np.ndarray]:
        """Each example's last ``length`` rows of its session, oldest first, zero-padded on
        the left: (n, length, N_FEATURES) and a validity mask (n, length). Identical to the
        live ``SessionFeatures.history`` (rows of one session are consecutive here)."""
        n = len(self)
        if n == 0:
            return np.zeros((0, length, N_FEATURES)), np.zeros((0, length), dtype=bool)
        new_session = np.ones(n, dtype=bool)
        new_session[1:] = self.session[1:] != self.session[:-1]
        starts = np.maximum.accumulate(np.where(new_session, np.arange(n), 0))
        pos = np.arange(n) - starts
        back = np.arange(length - 1, -1, -1)
        idx = np.arange(n)[:, None] - back[None, :]
        valid = pos[:, None] >= back[None, :]
        seq = self.x[np.clip(idx, 0, None)] * valid[:, :, None]
        return seq, valid

    def subset(self, mask: np.ndarray) -> GapDataset:
        return GapDataset(
            self.x[mask], self.gap_s[mask], self.session[mask], self.group[mask],
            self.finish_s[mask], self.stop[mask],
        )


def session_group(session: TraceSession) -> str:
    """Split group of a session: a child (sub-agent) goes with its parent."""
    return session.parent_id or session.session_id


def build_dataset(trace: Trace | Iterable[TraceSession]) -> GapDataset:
    """Replay every session through a :class:`FeatureTracker` and label each response."""
    sessions = trace.sessions if isinstance(trace, Trace) else tuple(trace)
    rows: list[list[float]] = []
    gaps: list[float] = []
    sids: list[str] = []
    groups: list[str] = []
    finishes: list[float] = []
    stops: list[str] = []
    inf = math.inf
    for session in sessions:
        tracker = FeatureTracker()
        group = session_group(session)
        pending = False
        for event in replay_session(session):
            gap = tracker.observe(event)
            if event.kind is EventKind.REQUEST_STARTED:
                if pending:
                    gaps.append(inf if gap is None else gap)
                    pending = False
            else:
                st = tracker.sessions[session.session_id]
                assert st.row is not None
                rows.append(st.row)
                sids.append(session.session_id)
                groups.append(group)
                finishes.append(event.time_s)
                stops.append(st.last_stop)
                pending = True
        if pending:
            gaps.append(inf)  # the session's last response: it never returned
    x = np.array(rows, dtype=np.float64).reshape(len(rows), N_FEATURES)
    return GapDataset(
        x, np.array(gaps, dtype=np.float64), np.array(sids, dtype=object),
        np.array(groups, dtype=object), np.array(finishes, dtype=np.float64),
        np.array(stops, dtype=object),
    )
