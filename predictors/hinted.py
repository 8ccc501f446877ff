"""``hinted``: wraps any predictor and folds in client hints.

* ``session_closed`` (event or hint): the session will not return: ``p_return = 0``.
* ``tool_running`` (or ``user_typing``) with ``eta_s`` = expected time to the next request
  D: the gap is log-normal around (hint time + D) with :data:`ETA_SIGMA`.
* ``user_typing`` without an ETA: a person is composing the next turn: the gap is the
  hint time plus a log-normal wait, too vague to start a prefetch on its own
  (:data:`TYPING_CONFIDENCE`: its prefetches keep the record of forecasts from history)
  but enough to keep the session. The wait's median and sigma are those of the traffic at
  hand (:class:`TypingLaw`: the waits from typing hint to request seen so far, once there
  are :data:`TYPING_MIN_SAMPLES`); until then :data:`TYPING_MEDIAN_S` and
  :data:`TYPING_SIGMA`.

Either way the session returns at all with :data:`HINT_P_RETURN`, and the forecast carries
the law as a survival curve conditioned on the silence so far (``conditioned=True``): a
session whose ETA has passed is due soon, then less and less so the longer it stays silent,
and past the law's last knot (:data:`LAW_Z_SPAN` sigmas beyond its median) it is taken not
to return (the hint said when; a session silent far past it is not coming). Its ``p_return``
is the chance of a return within what is left of the law (at least the wrapped model's
horizon), not within the model's fixed horizon: a far ETA or a long typing spell is still
planned, timed by the law's early quantile. A law, rather than fixed quantiles floored at
"silent as long again", keeps a hinted prefetch from being re-planned ever later while the
session stays silent.

A hint holds until the session's next request starts. Without hints the wrapped model's
forecast is returned unchanged. ``hinted`` alone wraps ``ewma``; ``hinted:SPEC`` wraps any
other predictor spec (``hinted:gbm:FILE``, ``hinted:my.module:Model``) and ``hinted:FILE``
the trained model in FILE (whatever its kind); in code, ``HintedPredictor(inner)``. The
``default`` predictor is the shipped model with this layer (:func:`load_default`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from kvprefetch.controlplane.base.types import (
    FORECAST_LEVELS,
    ArrivalForecast,
    EventKind,
    HintKind,
    SessionEvent,
    SurvivalCurve,
    Trace,
)
from kvprefetch.predictors.adaptive import NEVER_S, RETURN_HORIZON_S
from kvprefetch.predictors.base import Predictor

#: Arrival after a "user is typing" hint with no ETA: q10, q50, q90 seconds after the hint.
#: What a typing indicator implies: the message's length over the person's typing speed.
#: The quantiles of Claude Code prompts typed at the speeds of Dhakal et al. (CHI 2018), as
#: the simulator's hint model (kvprefetch.controlplane.sim.hints) draws them on the public
#: Claude Code set, rounded (the figures: docs/results/constants.md); short chat messages
#: would be faster.
TYPING_QUANTILES_S = (8.0, 70.0, 450.0)
#: Those quantiles as a log-normal law: its median, and the sigma that puts its q90 / q50
#: at theirs (z(0.9) = 1.2816).
TYPING_MEDIAN_S = TYPING_QUANTILES_S[1]
TYPING_SIGMA = math.log(TYPING_QUANTILES_S[2] / TYPING_QUANTILES_S[1]) / 1.2816
#: Sigma of the log-normal error of a client's ETA (the true gap over the ETA): how
#: far a tool's runtime strays from what its caller expects. The simulator's hint model
#: draws ETAs with the same default noise (``--tool-eta-sigma``, 0.5: the true gap is
#: within a factor 1.9 of the ETA 80% of the time).
ETA_SIGMA = 0.5
#: A hint's law's knots: this many, evenly spaced in log-gap over +-LAW_Z_SPAN sigmas.
LAW_KNOTS = 25
LAW_Z_SPAN = 3.5
#: Shortest arrival a hint's law is centred on (s), so its knots stay apart.
MIN_LAW_CENTRE_S = 0.5
#: Confidence of a hinted forecast with an ETA.
HINT_CONFIDENCE = 0.9
#: Confidence of a "user typing" forecast without an ETA: below
#: ``planner.displace_min_confidence``, so its prefetches keep the record of forecasts
#: from history (:mod:`kvprefetch.controlplane.core.bets`). How long a person types is
#: unknown to the hint: a prefetch started on it may land minutes early and hold DRAM
#: that the sessions due first need, which its record then shows.
TYPING_CONFIDENCE = 0.5
#: Probability that a hinted session returns at all (an abandoned reply, a cancelled tool).
HINT_P_RETURN = 0.95
#: The waits from typing hint to request :class:`TypingLaw` keeps: the most recent ones.
TYPING_WINDOW = 512
#: ... and how many it needs before their law replaces the prior one.
TYPING_MIN_SAMPLES = 32
#: The narrowest typing law it fits (q90 / q50 of 1.14).
MIN_TYPING_SIGMA = 0.1


@dataclass(slots=True)
class _Hint:
    kind: HintKind
    time_s: float
    eta_s: float | None
    #: The gap law the hint implies, built on first use (keyed by the finish it is from).
    law: tuple[float, SurvivalCurve] | None = None


def lognormal_law(centre_s: float, sigma: float = ETA_SIGMA,
                  p_return: float = HINT_P_RETURN, *, after_s: float = 0.0) -> SurvivalCurve:
    """The survival of a gap of ``after_s`` plus a wait that is log-normal around
    ``centre_s`` (its median) with ``sigma``, returning at all with ``p_return``: knots
    evenly spaced in log-wait over +-:data:`LAW_Z_SPAN` sigmas (linear between them, as
    every :class:`SurvivalCurve`). ``after_s`` is when the hint came (seconds after the
    last response): the hint's uncertainty is in the wait it announces, not in the time
    already passed."""
    centre = max(MIN_LAW_CENTRE_S, centre_s)
    knots = [(0.0, 1.0)]
    for i in range(LAW_KNOTS):
        z = -LAW_Z_SPAN + 2.0 * LAW_Z_SPAN * i / (LAW_KNOTS - 1)
        cdf = 0.5 * math.erfc(-z / math.sqrt(2.0))
        knots.append((after_s + centre * math.exp(sigma * z), 1.0 - p_return * cdf))
    return SurvivalCurve.from_knots(knots)


class TypingLaw:
    """How long after its "user typing" hint a request comes on the traffic at hand: the
    log-normal through the median and the q90 of the last ``window`` waits seen (from a
    typing hint without an ETA to the session's next request), once there are
    ``min_samples``; before that the prior :data:`TYPING_QUANTILES_S`. A typing hint that
    no request follows gives no wait (:data:`HINT_P_RETURN` covers it). It learns from
    what has happened only, so a deployment and its simulated twin learn it alike."""

    def __init__(self, window: int = TYPING_WINDOW,
                 min_samples: int = TYPING_MIN_SAMPLES) -> None:
        self._waits: deque[float] = deque(maxlen=window)
        self._min_samples = min_samples
        self._law = (TYPING_MEDIAN_S, TYPING_SIGMA)
        self._stale = False

    def observe(self, wait_s: float) -> None:
        """A request came ``wait_s`` after its session's typing hint."""
        self._waits.append(max(MIN_LAW_CENTRE_S, wait_s))
        self._stale = True

    @property
    def samples(self) -> int:
        """Waits held."""
        return len(self._waits)

    def law(self) -> tuple[float, float]:
        """``(median_s, sigma)`` of the log-normal wait after a typing hint."""
        if self._stale and len(self._waits) >= self._min_samples:
            waits = sorted(self._waits)
            median = waits[len(waits) // 2]
            q90 = waits[min(len(waits) - 1, int(0.9 * len(waits)))]
            self._law = (median, max(MIN_TYPING_SIGMA, math.log(q90 / median) / 1.2816))
            self._stale = False
        return self._law


class HintedPredictor:
    """Hints first, then the wrapped model."""

    name = "hinted"

    def __init__(self, inner: Predictor | None = None) -> None:
        if inner is None:
            from kvprefetch.predictors.heuristics import EwmaPredictor

            inner = EwmaPredictor()
        self.inner = inner
        self._hints: dict[str, _Hint] = {}
        self._closed: set[str] = set()
        #: The waits from typing hint to request on this traffic.
        self.typing = TypingLaw()

    @property
    def fitted(self) -> bool:
        return bool(getattr(self.inner, "fitted", True))

    @property
    def train_info(self) -> dict[str, Any]:
        """The wrapped model's training record (empty for a model that is not trained)."""
        return dict(getattr(self.inner, "train_info", {}))

    def observe(self, event: SessionEvent) -> None:
        sid = event.session_id
        if event.kind is EventKind.REQUEST_STARTED:
            hint = self._hints.pop(sid, None)
            if hint is not None and hint.kind is HintKind.USER_TYPING and hint.eta_s is None:
                self.typing.observe(event.time_s - hint.time_s)
        elif event.kind is EventKind.SESSION_CLOSED or event.hint is HintKind.SESSION_CLOSED:
            self._closed.add(sid)
        elif event.kind is EventKind.HINT and event.hint is not None:
            self._hints[sid] = _Hint(event.hint, event.time_s, event.eta_s)
        self.inner.observe(event)

    def forget(self, session_id: str) -> None:
        self._hints.pop(session_id, None)
        self._closed.discard(session_id)
        self.inner.forget(session_id)

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        return self._apply(session_id, now_s, self.inner.forecast(session_id, now_s))

    def forecast_many(
        self, session_ids: Sequence[str], now_s: float | Sequence[float]
    ) -> list[ArrivalForecast | None]:
        nows = [now_s] * len(session_ids) if isinstance(now_s, int | float) else list(now_s)
        many = getattr(self.inner, "forecast_many", None)
        base = (
            many(session_ids, nows) if many is not None
            else [self.inner.forecast(s, t) for s, t in zip(session_ids, nows, strict=True)]
        )
        return [self._apply(s, t, f) for s, t, f in zip(session_ids, nows, base, strict=True)]

    def _apply(
        self, sid: str, now_s: float, base: ArrivalForecast | None
    ) -> ArrivalForecast | None:
        if base is None:
            return None
        if sid in self._closed:
            return ArrivalForecast(sid, base.last_finish_s, (NEVER_S,) * 3, 0.0, base.horizon_s,
                                   1.0)
        hint = self._hints.get(sid)
        if hint is None or hint.kind is HintKind.SESSION_CLOSED:
            return base
        elapsed = max(0.0, now_s - base.last_finish_s)
        since_hint = max(0.0, hint.time_s - base.last_finish_s)
        if hint.eta_s is not None:
            centre, sigma = max(0.0, hint.eta_s), ETA_SIGMA
            confidence = HINT_CONFIDENCE
        elif hint.kind is HintKind.USER_TYPING:
            centre, sigma = self.typing.law()
            confidence = TYPING_CONFIDENCE
        else:  # a tool is running, duration unknown: the model's view stands
            return base
        if hint.law is None or hint.law[0] != base.last_finish_s:
            hint.law = (base.last_finish_s, lognormal_law(centre, sigma, after_s=since_hint))
        curve = hint.law[1]
        q = tuple(min(NEVER_S, curve.quantile_after(elapsed, level)) for level in FORECAST_LEVELS)
        # The hint bounds when the session returns: the horizon spans what is left of its
        # law (at least the model's), so a far ETA or a long typing spell still plans.
        window = max(RETURN_HORIZON_S, curve.gaps_s[-1] - elapsed)
        return ArrivalForecast(sid, base.last_finish_s, q,
                               curve.p_within(elapsed, window),
                               elapsed + window, confidence, conditioned=True,
                               survival=curve, hinted=True)

    # -- training and artifacts delegate to the wrapped model --------------------------------
    def fit(self, trace: Trace, **kwargs: Any) -> Self:
        fit = getattr(self.inner, "fit", None)
        if fit is not None:
            fit(trace, **kwargs)
        return self

    def save(self, path: str | Path) -> Path:
        save = getattr(self.inner, "save", None)
        if save is None:
            from kvprefetch.controlplane.base.errors import PredictorError

            raise PredictorError(f"wrapped predictor {self.inner.name!r} cannot be saved")
        return Path(save(path))


class GatedHintedPredictor(HintedPredictor):
    """The hint layer over a model whose idle forecasts come from laws shared by groups of
    sessions (:class:`kvprefetch.controlplane.core.sweep.GatedPredictor`: ``adaptive``, the
    shipped model): a session without a hint keeps its group, so the scheduler's sweep
    still skips the sessions whose forecast cannot pass its gate; a hinted or closed
    session has no group (its forecast is the hint's law: always forecast)."""

    def idle_group(self, session_id: str) -> Hashable | None:
        if session_id in self._hints or session_id in self._closed:
            return None
        group: Hashable | None = self.inner.idle_group(session_id)  # type: ignore[attr-defined]
        return group

    def gate_region(self, group: Hashable, *, min_p_return: float, min_confidence: float,
                    max_silence_s: float) -> Sequence[tuple[float, float]]:
        region: Sequence[tuple[float, float]] = self.inner.gate_region(  # type: ignore[attr-defined]
            group, min_p_return=min_p_return, min_confidence=min_confidence,
            max_silence_s=max_silence_s)
        return region


def with_hints(predictor: Predictor) -> HintedPredictor:
    """``predictor`` reading client hints: wrapped once (a hinted model is returned as is);
    a model with group laws keeps what the scheduler's indexed sweep reads."""
    if isinstance(predictor, HintedPredictor):
        return predictor
    gated = callable(getattr(predictor, "idle_group", None)) and callable(
        getattr(predictor, "gate_region", None))
    return GatedHintedPredictor(predictor) if gated else HintedPredictor(predictor)


def load_default() -> HintedPredictor:
    """The ``default`` predictor every deployment, the simulator and the demo run: the
    shipped model (:func:`kvprefetch.predictors.adaptive.load_default`) with the hint layer.
    Without hints its forecasts are the shipped model's."""
    from kvprefetch.predictors.adaptive import load_default as load_shipped

    shipped: Any = load_shipped()  # its `name` is a class attribute, the protocol's an instance's
    return with_hints(shipped)
