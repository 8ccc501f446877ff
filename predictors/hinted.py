"""``hinted``: wraps any predictor and folds in client hints.

* ``session_closed`` (event or hint): the session will not return: ``p_return = 0``.
* ``tool_running`` with ``eta_s`` = expected tool duration D: the next request is due about
  D after the hint: quantiles around that arrival, a high return probability if it falls
  inside the horizon.
* ``user_typing`` (``eta_s`` optional): a person is composing the next turn: arrival at the
  ETA, or within :data:`TYPING_QUANTILES_S` of the hint without one.

A hint holds until the session's next request starts. Without hints the wrapped model's
forecast is returned unchanged. ``hinted`` alone wraps ``ewma``; ``hinted:FILE`` wraps the
trained model in FILE (whatever its kind); in code, ``HintedPredictor(inner)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from controlplane.base.types import ArrivalForecast, EventKind, HintKind, SessionEvent, Trace
from predictors.base import Predictor

#: Arrival after a "user is typing" hint with no ETA: q10, q50, q90 seconds after the hint.
#: What a typing indicator implies: the message's length over the person's typing speed.
#: Claude Code prompts typed at the speeds of Dhakal et al. (CHI 2018; 51.6 +- 20.2 wpm)
#: take q10/q50/q90 = 8 / 71 / 453 s (the simulator's hint model, controlplane.sim.hints,
#: on the shared Claude Code set); short chat messages would be faster.
TYPING_QUANTILES_S = (8.0, 70.0, 450.0)
#: Relative spread around a hinted ETA (q10, q90 = eta * factor), plus this slack (s).
ETA_SPREAD = (0.8, 1.3)
ETA_SLACK_S = 1.0
#: Confidence of a hinted forecast with an ETA.
HINT_CONFIDENCE = 0.9
#: Confidence of a "user typing" forecast without an ETA: below the planner's default
#: ``min_confidence`` (0.7), so it ranks the session for eviction (due soon: kept) but
#: starts no prefetch. How long a person types is unknown to the hint; measured in the
#: simulator (typing time from the new user tokens at Dhakal-2018 speeds), prefetches it
#: started landed minutes early and 87% of their bytes were evicted unused.
TYPING_CONFIDENCE = 0.5
#: Probability of returning within the horizon when a hint says it is due inside it.
HINT_P_RETURN = 0.95


@dataclass(slots=True)
class _Hint:
    kind: HintKind
    time_s: float
    eta_s: float | None


class HintedPredictor:
    """Hints first, then the wrapped model."""

    name = "hinted"

    def __init__(self, inner: Predictor | None = None) -> None:
        if inner is None:
            from predictors.heuristics import EwmaPredictor

            inner = EwmaPredictor()
        self.inner = inner
        self._hints: dict[str, _Hint] = {}
        self._closed: set[str] = set()

    @property
    def fitted(self) -> bool:
        return bool(getattr(self.inner, "fitted", True))

    def observe(self, event: SessionEvent) -> None:
        sid = event.session_id
        if event.kind is EventKind.REQUEST_STARTED:
            self._hints.pop(sid, None)
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
            return ArrivalForecast(sid, base.last_finish_s, (1e12,) * 3, 0.0, base.horizon_s, 1.0)
        hint = self._hints.get(sid)
        if hint is None or hint.kind is HintKind.SESSION_CLOSED:
            return base
        elapsed = max(0.0, now_s - base.last_finish_s)
        since_hint = max(0.0, hint.time_s - base.last_finish_s)
        if hint.eta_s is not None:
            eta = max(0.0, hint.eta_s)
            lo, hi = ETA_SPREAD
            q = (since_hint + eta * lo, since_hint + eta, since_hint + eta * hi + ETA_SLACK_S)
            confidence = HINT_CONFIDENCE
        elif hint.kind is HintKind.USER_TYPING:
            q = tuple(since_hint + d for d in TYPING_QUANTILES_S)  # type: ignore[assignment]
            confidence = TYPING_CONFIDENCE
        else:  # a tool is running, duration unknown: the model's view stands
            return base
        q = tuple(max(v, elapsed) for v in q)  # type: ignore[assignment]
        horizon = max(base.horizon_s, elapsed)
        p = HINT_P_RETURN if q[1] <= horizon else base.p_return
        return ArrivalForecast(sid, base.last_finish_s, q, p, base.horizon_s, confidence)

    # -- training and artifacts delegate to the wrapped model --------------------------------
    def fit(self, trace: Trace, **kwargs: Any) -> Self:
        fit = getattr(self.inner, "fit", None)
        if fit is not None:
            fit(trace, **kwargs)
        return self

    def save(self, path: str | Path) -> Path:
        save = getattr(self.inner, "save", None)
        if save is None:
            from controlplane.base.errors import PredictorError

            raise PredictorError(f"wrapped predictor {self.inner.name!r} cannot be saved")
        return Path(save(path))

    @classmethod
    def load(cls, path: str | Path) -> Self:
        from predictors.registry import load_artifact

        return cls(load_artifact(path))
