"""The ``true-law`` bound: forecasts from the generator's own laws (simulator only).

Synthetic traffic (:mod:`kvprefetch.controlplane.traces.synthetic`) draws every gap from a
known law: after a ``tool_use`` stop the tool's log-normal, after an ``end_turn`` the
person's think time plus, sometimes, an absence; and a session ends after a turn with the
chance its geometric number of turns gives. :class:`TrueLawPredictor` forecasts each idle
session from exactly that law, given its last stop reason (or the mixture over stop reasons
where the trace carries none) and conditioned on its silence so far. No forecast from a
session's history can know more about its next gap, so ``true-law`` (``predictive``'s
mechanisms fed this predictor) bounds what forecasts from history can buy on such traffic;
``perfect`` bounds what any forecast can.

The laws are exact; the curves are their survival at :data:`KNOTS` gaps spaced evenly in log
gap (linear between them, as every :class:`~kvprefetch.controlplane.base.types.SurvivalCurve`),
and the law of a think time plus an absence is the average of the absence's survival over
:data:`SUM_POINTS` quantiles of the think time.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.types import (
    FORECAST_LEVELS,
    ArrivalForecast,
    EventKind,
    SessionEvent,
    SurvivalCurve,
    Trace,
)
from kvprefetch.controlplane.traces.synthetic import PROFILES, SyntheticProfile
from kvprefetch.predictors.adaptive import MAX_CONFIDENCE, NEVER_S, RETURN_HORIZON_S

__all__ = ["KNOTS", "SUM_POINTS", "TRUE_LAW", "TrueLawPredictor", "true_law_predictor"]

#: The predictor name the ``true-law`` policy asks for.
TRUE_LAW = "true-law"
#: Knots of each law's survival curve, from :data:`MIN_GAP_S` to :data:`MAX_GAP_S`.
KNOTS = 240
MIN_GAP_S = 0.01
MAX_GAP_S = 1e7
#: Quantiles of the think time the law of think time plus absence averages over.
SUM_POINTS = 400
#: The sigma of an absence's log-normal (the generator's).
_AWAY_SIGMA = 1.0
_NORMAL = NormalDist()


def _lognormal_cdf(gap_s: float, median_s: float, sigma: float) -> float:
    if gap_s <= 0.0:
        return 0.0
    return _NORMAL.cdf(math.log(gap_s / median_s) / sigma)


def _gaps() -> list[float]:
    step = math.log(MAX_GAP_S / MIN_GAP_S) / (KNOTS - 1)
    return [MIN_GAP_S * math.exp(step * i) for i in range(KNOTS)]


def _curve(cdf: list[float], p_return: float) -> SurvivalCurve:
    """The survival ``1 - p_return * cdf`` at :func:`_gaps`, from ``(0, 1)``."""
    knots = [(0.0, 1.0)]
    floor = 1.0
    for gap, f in zip(_gaps(), cdf, strict=True):
        floor = min(floor, 1.0 - p_return * f)  # non-increasing against rounding
        knots.append((gap, floor))
    return SurvivalCurve.from_knots(knots)


def _tool_cdf(p: SyntheticProfile) -> list[float]:
    return [_lognormal_cdf(g, p.tool_median_s, p.tool_sigma) for g in _gaps()]


def _human_cdf(p: SyntheticProfile) -> list[float]:
    """Think time, plus with ``away_share`` an absence: P(gap <= g)."""
    thinks = [p.think_median_s * math.exp(p.think_sigma * _NORMAL.inv_cdf((i + 0.5) / SUM_POINTS))
              for i in range(SUM_POINTS)]
    out = []
    for g in _gaps():
        think = _lognormal_cdf(g, p.think_median_s, p.think_sigma)
        away = sum(_lognormal_cdf(g - t, p.away_median_s, _AWAY_SIGMA) for t in thinks
                   if t < g) / SUM_POINTS
        out.append((1.0 - p.away_share) * think + p.away_share * away)
    return out


class TrueLawPredictor:
    """Forecasts from a synthetic profile's own laws (module docstring)."""

    name = TRUE_LAW

    def __init__(self, profile: SyntheticProfile) -> None:
        end = 1.0 / profile.turns_mean  # a turn is the session's last
        tool = (1.0 - end) * profile.tool_share  # a turn stops for a tool (never the last)
        human = 1.0 - end - tool  # a turn ends, and another follows
        tool_cdf, human_cdf = _tool_cdf(profile), _human_cdf(profile)
        returns = tool + human
        mixed = [(tool * a + human * b) / returns if returns > 0 else 0.0
                 for a, b in zip(tool_cdf, human_cdf, strict=True)]
        #: The law after each stop reason; None: the stop reason is not in the trace.
        self.laws: dict[str | None, SurvivalCurve] = {
            "tool_use": _curve(tool_cdf, 1.0),
            "end_turn": _curve(human_cdf, human / (human + end) if human + end > 0 else 0.0),
            None: _curve(mixed, returns),
        }
        self._idle: dict[str, tuple[float, str | None]] = {}

    def observe(self, event: SessionEvent) -> None:
        sid = event.session_id
        if event.kind is EventKind.REQUEST_FINISHED:
            stop = event.stop_reason if event.stop_reason in self.laws else None
            self._idle[sid] = (event.time_s, stop)
        elif event.kind in (EventKind.REQUEST_STARTED, EventKind.SESSION_CLOSED):
            self._idle.pop(sid, None)

    def forget(self, session_id: str) -> None:
        self._idle.pop(session_id, None)

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        idle = self._idle.get(session_id)
        if idle is None:
            return None
        last, stop = idle
        curve = self.laws[stop]
        silence = max(0.0, now_s - last)
        q = tuple(min(NEVER_S, curve.quantile_after(silence, level))
                  for level in FORECAST_LEVELS)
        # As sharp as the shipped model would call a law this narrow.
        confidence = (min(MAX_CONFIDENCE, math.exp(-0.5 * (math.log1p(q[2]) - math.log1p(q[0]))))
                      if q[2] < NEVER_S else 0.0)
        return ArrivalForecast(session_id, last, q, curve.p_within(silence, RETURN_HORIZON_S),
                               silence + RETURN_HORIZON_S, confidence, conditioned=True,
                               survival=curve)


def true_law_predictor(trace: Trace) -> TrueLawPredictor:
    """The predictor of ``trace``'s own laws. ConfigError for a trace that is not drawn
    from a named synthetic profile (``random`` draws its profile per seed)."""
    prefix = "synthetic-"
    profile = PROFILES.get(trace.name[len(prefix):]) if trace.name.startswith(prefix) else None
    if profile is None:
        named = ", ".join(f"synthetic:{n}" for n, p in PROFILES.items() if p is not None)
        raise ConfigError(f"policy {TRUE_LAW!r} forecasts from a synthetic profile's own laws: "
                          f"it needs one of {named}, not trace {trace.name!r}")
    return TrueLawPredictor(profile)
