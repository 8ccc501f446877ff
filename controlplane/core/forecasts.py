"""Forecasts and predicted-use eviction keys: :class:`ForecastCache`.

The one place the scheduling core asks its predictor about sessions. Called on every event
(a session's own forecast, for its plan and its write-through's eviction key) and on every
eviction decision (the keys of resident sessions, through
:class:`~kvprefetch.controlplane.core.tiers.PredictedUseEviction`, one at a time or in
batches of many). Two caches keep the predictor's calls down without changing an answer:

* the last forecast asked is answered again for the same (session, time) until anything is
  observed (a finish asks twice: its write-through's key and its prefetch plan);
* a forecast that carries its whole law (``survival``, conditioned) is reused for the
  session's eviction key for :data:`FORECAST_REUSE_S` after it was made, conditioned on
  the longer silence by the law itself, while the session is resident somewhere; any
  event of the session drops it (:meth:`ForecastCache.touch`).

Invariant the eviction index relies on: a session's predicted next use is non-decreasing in
time between its own events (see :mod:`kvprefetch.controlplane.core.tiers`). Times are
seconds on the driver's clock; ``inf`` is "never".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvprefetch.controlplane.base.config import PlannerConfig
from kvprefetch.controlplane.base.types import ArrivalForecast
from kvprefetch.controlplane.core.planner import predicted_use_s
from kvprefetch.controlplane.core.sessions import Sessions
from kvprefetch.controlplane.core.tiers import IndexedTier
from kvprefetch.predictors.base import Predictor

__all__ = ["FORECAST_REUSE_S", "ForecastCache"]

#: A session's forecast that carries its whole law (``survival``, conditioned) is reused for
#: its eviction key for this long (seconds) after it was made, conditioned on the longer
#: silence by the law itself, instead of asking the predictor again; any event of the
#: session drops it at once. What reuse cannot see is a predictor adapting a law shared
#: with other sessions within the window.
FORECAST_REUSE_S = 10.0


class ForecastCache:
    """The predictor behind the core's two caches (module docstring)."""

    def __init__(self, predictor: Predictor, planner: PlannerConfig, sessions: Sessions,
                 holders: dict[str, set[IndexedTier]]) -> None:
        self.predictor = predictor
        self._planner = planner
        self._sessions = sessions
        #: Which node tiers hold each session (kept by the tiers).
        self._holders = holders
        #: (session, time, forecast) of the last forecast asked.
        self._last: tuple[str, float, ArrivalForecast | None] | None = None
        #: (forecast, when it was made) of resident sessions whose eviction keys were
        #: asked, for forecasts that carry their whole law; dropped by any event of the
        #: session and when it is resident nowhere.
        self._laws: dict[str, tuple[ArrivalForecast, float]] = {}

    def observed(self) -> None:
        """The predictor saw an event: the last forecast may be stale."""
        self._last = None

    def touch(self, sid: str) -> None:
        """The session's state changed (an event, a prefetch): its eviction key may have
        moved, not only with time."""
        self._laws.pop(sid, None)
        for tier in self._holders.get(sid, ()):
            tier.invalidate(sid)

    def left_tier(self, sid: str) -> None:
        """The session left a node's books: once it is resident nowhere its key is not
        asked, and its law is not kept."""
        if sid not in self._holders:
            self._laws.pop(sid, None)

    def forecast(self, sid: str, now_s: float) -> ArrivalForecast | None:
        """The predictor's forecast of one session, the last one asked for again when
        nothing was observed since."""
        last = self._last
        if last is not None and last[0] == sid and last[1] == now_s:
            return last[2]
        fc = self.predictor.forecast(sid, now_s)
        self._last = (sid, now_s, fc)
        return fc

    def forecasts(self, sids: Sequence[str], now_s: float | Sequence[float]
                  ) -> list[ArrivalForecast | None]:
        """One forecast per session at ``now_s`` (one time, or one per session)."""
        many = getattr(self.predictor, "forecast_many", None)
        if many is not None and len(sids) > 1:
            return list(many(list(sids), now_s))
        if isinstance(now_s, int | float):
            return [self.forecast(sid, now_s) for sid in sids]
        return [self.forecast(sid, t) for sid, t in zip(sids, now_s, strict=True)]

    def next_uses(self, sids: Sequence[str], now_s: float | Sequence[float]) -> list[float]:
        """Predicted next use of each session at ``now_s`` (one time, or one per session):
        then if it is running, its planned use if a prefetch brought it in, else from the
        predictor (one batched call)."""
        times = ([float(now_s)] * len(sids) if isinstance(now_s, int | float)
                 else list(now_s))
        out: list[float] = [0.0] * len(sids)
        ask: list[int] = []
        for i, sid in enumerate(sids):
            s = self._sessions.get(sid)
            t = times[i]
            if s is not None and s.in_flight:
                out[i] = t
            elif s is not None and s.planned_use_s is not None and t <= s.planned_use_s:
                out[i] = s.planned_use_s  # brought in on purpose: keep until its predicted use
            else:
                use = self._reused_use(sid, t)
                if use is None:
                    ask.append(i)
                else:
                    out[i] = use
        if ask:
            at = [times[i] for i in ask]
            forecasts = self.forecasts([sids[i] for i in ask],
                                       at[0] if isinstance(now_s, int | float) else at)
            for i, fc in zip(ask, forecasts, strict=True):
                out[i] = self._use_from(sids[i], times[i], fc)
        return out

    def next_use(self, sid: str, now_s: float) -> float:
        """``next_uses([sid], now_s)[0]``, without the batch's lists when the session is
        running, was brought in on purpose or has a law to reuse (the eviction index's
        exact keys, one at a time)."""
        t = float(now_s)
        s = self._sessions.get(sid)
        if s is not None:
            if s.in_flight:
                return t
            if s.planned_use_s is not None and t <= s.planned_use_s:
                return s.planned_use_s
        use = self._reused_use(sid, t)
        return self._use_from(sid, t, self.forecast(sid, t)) if use is None else use

    def _use_from(self, sid: str, t: float, fc: ArrivalForecast | None) -> float:
        """The predicted use of a forecast made at ``t``; its law is kept for reuse while
        the session is resident somewhere."""
        if (fc is not None and fc.conditioned and fc.survival is not None
                and sid in self._holders):
            self._laws[sid] = (fc, t)
        return predicted_use_s(fc, self._planner, t)

    def _reused_use(self, sid: str, t: float) -> float | None:
        """The predicted use at ``t`` from the session's last whole-law forecast: what
        :func:`predicted_use_s` of a new forecast from the same law gives, its median
        conditioned on the silence at ``t``. None when there is none, it is older than
        :data:`FORECAST_REUSE_S`, or no returning mass is left (the predictor says what
        "never" is)."""
        held = self._laws.get(sid)
        if held is None:
            return None
        fc, made_s = held
        if not made_s <= t <= made_s + FORECAST_REUSE_S or fc.survival is None:
            return None
        gap = fc.survival.quantile_after(max(0.0, t - fc.last_finish_s), 0.5)
        return None if math.isinf(gap) else max(fc.last_finish_s + gap, t)
