"""An example user-written predictor, loaded by ``module:Class``.

Run from the repository root (so ``examples`` is importable), or put this folder on
``PYTHONPATH``::

    kvprefetch eval-predictor --trace controlplane/data/traces/claude-code \\
        --predictor examples.custom_predictor:StopAwarePredictor

It implements the :class:`kvprefetch.predictors.base.Predictor` protocol with plain Python: a tool
call is expected back in seconds, the end of a turn in minutes.
"""

from __future__ import annotations

from kvprefetch.controlplane.base.types import ArrivalForecast, EventKind, SessionEvent

#: Gap quantiles (q10, q50, q90, seconds) and P(return within the horizon) per stop reason.
TABLE: dict[str, tuple[tuple[float, float, float], float]] = {
    "tool_use": ((3.0, 9.0, 80.0), 0.85),
    "end_turn": ((8.0, 250.0, 5000.0), 0.25),
}
DEFAULT = ((5.0, 20.0, 600.0), 0.5)
HORIZON_S = 60.0


class StopAwarePredictor:
    """Forecasts from the previous response's stop reason alone."""

    name = "stop-aware"

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, str | None]] = {}  # id -> (finish time, stop)

    def observe(self, event: SessionEvent) -> None:
        if event.kind is EventKind.REQUEST_STARTED:
            self._last.pop(event.session_id, None)
        elif event.kind is EventKind.REQUEST_FINISHED:
            self._last[event.session_id] = (event.time_s, event.stop_reason)

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        last = self._last.get(session_id)
        if last is None:
            return None
        finish_s, stop = last
        quantiles, p_return = TABLE.get(stop or "", DEFAULT)
        elapsed = max(0.0, now_s - finish_s)
        shifted = tuple(max(q, elapsed) for q in quantiles)
        return ArrivalForecast(session_id, finish_s, shifted, p_return, HORIZON_S, 0.3)

    def forget(self, session_id: str) -> None:
        self._last.pop(session_id, None)
