"""Dependency-free per-session heuristics: ``last-gap`` and ``ewma``.

Both keep, per session, the time of the last finished response and the gaps seen so far;
each forecast costs a handful of float operations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvprefetch.controlplane.base.types import (
    FORECAST_LEVELS,
    ArrivalForecast,
    EventKind,
    HintKind,
    SessionEvent,
)

#: Gap assumed for a session with no history yet (seconds): the median gap between
#: consecutive turns of the public Claude Code set (controlplane/data/traces/ATTRIBUTION.md).
DEFAULT_FIRST_GAP_S = 18.0
#: Forecasts cover this horizon; sessions silent for longer are treated as gone.
DEFAULT_HORIZON_S = 3600.0
#: Standard normal quantiles of the forecast levels (0.1, 0.5, 0.9), rounded.
_Z_BY_LEVEL = {0.1: -1.2816, 0.5: 0.0, 0.9: 1.2816}


@dataclass(slots=True)
class _SessionState:
    last_finish_s: float | None = None
    in_flight: bool = False
    closed: bool = False
    gaps: int = 0
    last_gap_s: float | None = None
    ewma_gap_s: float | None = None
    ewma_log_dev: float = 0.0
    hint_eta_s: float | None = None
    hint_time_s: float | None = None
    #: Stop reason of the last finished response ("tool_use", "end_turn", None).
    last_stop: str | None = None
    #: Last gap seen after a response with each stop reason: a tool call comes back in
    #: seconds, a person at the end of a turn in minutes, so one number for both misleads.
    last_gap_by_stop: dict[str | None, float] = field(default_factory=dict)


class _GapHeuristic:
    """Shared event bookkeeping; subclasses choose the centre and spread of the gap."""

    name = "gap-heuristic"

    def __init__(
        self,
        *,
        first_gap_s: float = DEFAULT_FIRST_GAP_S,
        horizon_s: float = DEFAULT_HORIZON_S,
    ) -> None:
        self.first_gap_s = first_gap_s
        self.horizon_s = horizon_s
        self._sessions: dict[str, _SessionState] = {}

    # -- events ---------------------------------------------------------------------------
    def observe(self, event: SessionEvent) -> None:
        st = self._sessions.get(event.session_id)
        if st is None:
            st = self._sessions[event.session_id] = _SessionState()
        kind = event.kind
        if kind is EventKind.REQUEST_STARTED:
            if st.last_finish_s is not None and not st.in_flight:
                gap = max(0.0, event.time_s - st.last_finish_s)
                self._update_gap(st, gap)
                st.last_gap_by_stop[st.last_stop] = gap
            st.in_flight = True
            st.hint_eta_s = st.hint_time_s = None
        elif kind is EventKind.REQUEST_FINISHED:
            st.in_flight = False
            st.last_finish_s = event.time_s
            st.last_stop = event.stop_reason
        elif kind is EventKind.SESSION_CLOSED or event.hint is HintKind.SESSION_CLOSED:
            st.closed = True
        elif kind is EventKind.HINT and event.eta_s is not None:
            st.hint_eta_s = event.eta_s
            st.hint_time_s = event.time_s

    def _update_gap(self, st: _SessionState, gap_s: float) -> None:
        st.gaps += 1
        st.last_gap_s = gap_s
        log_gap = math.log1p(gap_s)
        if st.ewma_gap_s is None:
            st.ewma_gap_s = gap_s
        else:
            prev_log = math.log1p(st.ewma_gap_s)
            alpha = self._alpha()
            st.ewma_log_dev = (1 - alpha) * st.ewma_log_dev + alpha * abs(log_gap - prev_log)
            st.ewma_gap_s = math.expm1((1 - alpha) * prev_log + alpha * log_gap)

    def _alpha(self) -> float:
        return 1.0

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    # -- forecasts ------------------------------------------------------------------------
    def _centre_and_spread(self, st: _SessionState) -> tuple[float, float]:
        raise NotImplementedError

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        st = self._sessions.get(session_id)
        if st is None or st.in_flight or st.last_finish_s is None:
            return None
        if st.closed:
            return ArrivalForecast(
                session_id, st.last_finish_s, (self.horizon_s,) * 3, 0.0, self.horizon_s, 1.0
            )
        if st.hint_eta_s is not None and st.hint_time_s is not None:
            gap = max(0.0, st.hint_time_s + st.hint_eta_s - st.last_finish_s)
            q = (gap * 0.8, gap, gap * 1.25 + 1.0)
            return ArrivalForecast(session_id, st.last_finish_s, q, 0.95, self.horizon_s, 0.8)
        centre, spread = self._centre_and_spread(st)
        # Log-normal-ish band around the centre: the gaps are heavy tailed.
        log_c = math.log1p(centre)
        quantiles = tuple(
            max(0.0, math.expm1(log_c + _Z_BY_LEVEL[lvl] * spread)) for lvl in FORECAST_LEVELS
        )
        elapsed = now_s - st.last_finish_s
        if elapsed > quantiles[1]:
            # Overdue: the longer a session has been silent, the longer it is likely to stay
            # silent (heavy tail). Shift the band past now.
            quantiles = tuple(elapsed + q for q in quantiles)
        p_return = 1.0 if elapsed <= self.horizon_s else 0.0
        p_return *= math.exp(-max(0.0, elapsed - quantiles[-1]) / self.horizon_s)
        confidence = min(1.0, st.gaps / 5.0) * math.exp(-spread)
        return ArrivalForecast(
            session_id, st.last_finish_s, quantiles, p_return, self.horizon_s, confidence
        )


class LastGapPredictor(_GapHeuristic):
    """Predicts that the next gap equals the last one (the simplest useful model)."""

    name = "last-gap"

    def _centre_and_spread(self, st: _SessionState) -> tuple[float, float]:
        same_stop = st.last_gap_by_stop.get(st.last_stop)
        if same_stop is not None:
            return same_stop, 0.5
        if st.last_gap_s is None:
            return self.first_gap_s, 1.0
        return st.last_gap_s, 0.75


class EwmaPredictor(_GapHeuristic):
    """Exponentially weighted mean of the log gap, with an EWMA of its absolute deviation
    as the spread."""

    name = "ewma"

    def __init__(self, *, alpha: float = 0.3, **kwargs: float) -> None:
        super().__init__(**kwargs)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha

    def _alpha(self) -> float:
        return self.alpha

    def _centre_and_spread(self, st: _SessionState) -> tuple[float, float]:
        if st.ewma_gap_s is None:
            return self.first_gap_s, 1.0
        return st.ewma_gap_s, max(0.25, 1.25 * st.ewma_log_dev)
