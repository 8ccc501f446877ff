"""``adaptive``: the empirical law of the next gap per context bucket, adapting online.

What it forecasts
-----------------
For every idle session, the whole law of the gap from its last response end to its next
request, as a :class:`~kvprefetch.controlplane.base.types.SurvivalCurve` on the forecast (never-
returning mass included). ``p_within``, ``expected_wait_s`` and ``arrival_quantile_after``
of the forecast read that curve and condition it *exactly* on the silence so far
(``S(a + t) / S(a)``), so P(return within h | silent for a) is calibrated by construction,
up to sampling error and drift between the training traffic and the served one. The three
gap quantiles and ``p_return`` (within the next 60 s, as the other trained models) are
filled from the same curve for the readers of those.

Context buckets
---------------
A bucket is (stop bucket of the response that just ended, class of the session's previous
gap): stop buckets are :func:`kvprefetch.predictors.features.stop_category` of the stop reason, plus
``unknown`` for a session that has never reported a stop reason (Mooncake, Azure: open-loop
traces without them); the previous gap is ``first`` (no gap yet), ``short`` (at most
:data:`SHORT_GAP_S`) or ``long``. Coarse on purpose: every Claude Code bucket that matters
holds hundreds of gaps in half the shared set (``train_info["bucket_counts"]``).

Training (``fit``)
------------------
Every response of the trace is replayed through the same per-session state machine that
serves (:class:`_SessionState`), labelled with the gap that followed (or "never" after a
session's last response, or a gap beyond the last knot). Per bucket: counts of gaps per
segment of :data:`GRID_S` and of "never"; a bucket is shrunk toward its stop bucket's pooled
counts, and that toward all responses, by :data:`SHRINK_PSEUDO` pseudo-observations, so a
thin bucket borrows its shape. The ``unknown`` bucket's table is not Claude Code's: it is a
broad law (:func:`_broad_prior`: half the pooled law, half log-uniform over 1 s..1 day, half
of all idle periods never returning), to be replaced by a deployment's own traffic.

Online adaptation (``observe``)
-------------------------------
Each completed gap (a ``request_started`` after a ``request_finished`` of the same session)
is folded into its bucket: the bucket's gap histogram is multiplied by :data:`DECAY` (a
lazy scale factor, O(1)) and the gap's segment gains weight 1 (O(log n) to find it). The
shipped table enters as the prior, worth :data:`PRIOR_WEIGHT` pseudo-observations
(:data:`UNKNOWN_PRIOR_WEIGHT` for ``unknown``) and decaying like the data, so after ~K gaps
of a bucket a deployment's own traffic weighs as much as the prior, and after a few
thousand (memory ``1 / (1 - DECAY)`` = 2,000 gaps) the prior is gone. The curve of a bucket
is rebuilt lazily on the next forecast that needs it (O(knots)), shared by all its sessions.

The never-returning share is learned only from explicit ends (``session_closed`` events or
hints, "the session will not return"): a gap says the session returned, but nothing but a
close says that one did not (silence is censored; ``forget`` is also called on expiry), so
counting returns alone would drive it to 0. A bucket's never share is therefore the shipped
one until its deployment has reported a close, then a decayed count of (returns, closes)
with the prior's share as ``PRIOR_WEIGHT`` pseudo-observations.
"""

from __future__ import annotations

import json
import math
import time
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np

from kvprefetch.controlplane.base.errors import PredictorError
from kvprefetch.controlplane.base.types import (
    FORECAST_LEVELS,
    ArrivalForecast,
    EventKind,
    HintKind,
    SessionEvent,
    SurvivalCurve,
    Trace,
    TraceSession,
)
from kvprefetch.predictors.artifacts import read_artifact, write_artifact
from kvprefetch.predictors.features import (
    KNOWN_STOP_REASONS,
    replay_session,
    session_group,
    stop_category,
)

#: A session silent this long (one day) is taken never to return: the last knot.
LAST_KNOT_S = 86400.0
#: Knots at every whole second up to this: gaps are recorded in whole seconds (Claude Code)
#: and cluster (a tool's 600 s timeout returns at 600-620 s), so ``S`` is exact at each.
DENSE_UNTIL_S = 1200
#: The knots of every survival curve: each second up to DENSE_UNTIL_S, then every ~5%.
GRID_S: tuple[float, ...] = tuple(sorted(
    {float(g) for g in range(DENSE_UNTIL_S + 1)}
    | {float(round(DENSE_UNTIL_S * 1.05**k)) for k in range(100)
       if DENSE_UNTIL_S * 1.05**k < LAST_KNOT_S}
    | {LAST_KNOT_S}
))
#: A bucket's curve is rebuilt after this many new gaps (or a close): O(knots) each time.
REBUILD_EVERY = 8


def check_grid(grid: Sequence[float]) -> tuple[float, ...]:
    """``grid`` as knots, or ValueError: starts at 0, increases strictly, ends at
    :data:`LAST_KNOT_S`."""
    out = tuple(float(g) for g in grid)
    if len(out) < 2 or out[0] != 0.0 or out[-1] != LAST_KNOT_S or any(
        not b > a for a, b in pairwise(out)
    ):
        raise ValueError("survival grid must start at 0, increase strictly and end at "
                         f"{LAST_KNOT_S:g} s")
    return out


#: Stop buckets: the known stop reasons, "other", and "unknown" (no stop reason reported).
UNKNOWN_STOP = "unknown"
STOP_BUCKETS: tuple[str, ...] = (*KNOWN_STOP_REASONS, "other", UNKNOWN_STOP)
#: Previous-gap classes: none yet, at most SHORT_GAP_S, longer.
GAP_CLASSES: tuple[str, ...] = ("first", "short", "long")
SHORT_GAP_S = 30.0
BUCKETS: tuple[str, ...] = tuple(f"{s}|{g}" for s in STOP_BUCKETS for g in GAP_CLASSES)

#: Pseudo-observations a bucket borrows from its parent's shape (stop bucket, then pooled).
SHRINK_PSEUDO = 20.0
#: The shipped table's weight, in gaps, as the prior of online adaptation.
PRIOR_WEIGHT = 200.0
#: The same for the ``unknown`` bucket (a broad guess: let traffic take over fast).
UNKNOWN_PRIOR_WEIGHT = 20.0
#: Per completed gap of a bucket, its older weight is multiplied by this (memory 2,000 gaps).
DECAY = 1.0 - 1.0 / 2000.0
#: Share of idle periods that never return in the broad ``unknown`` prior.
BROAD_NEVER = 0.5

#: ``p_return`` is within this many seconds of now (as the other trained models).
RETURN_HORIZON_S = 60.0
#: Gap reported for a session that will not return.
NEVER_S = 1e12
MAX_CONFIDENCE = 0.99
#: Version of the payload below (the container is :mod:`kvprefetch.predictors.artifacts`).
PAYLOAD_VERSION = 1
MIN_TRAIN_GAPS = 20


def bucket_of(stop: str, previous_gap_s: float | None) -> str:
    """The context bucket of a response that ended with ``stop`` (a stop bucket)."""
    if previous_gap_s is None:
        return f"{stop}|first"
    return f"{stop}|{'short' if previous_gap_s <= SHORT_GAP_S else 'long'}"


def segment_of(grid: Sequence[float], gap_s: float) -> int | None:
    """Index ``i`` of the grid segment ``(grid[i], grid[i + 1]]`` holding ``gap_s`` (a gap
    of 0 falls in the first), so that ``S(knot)`` is exactly the share of gaps longer than
    the knot; None beyond the last knot (counted as never returning)."""
    if gap_s > grid[-1]:
        return None
    return max(0, bisect_left(grid, gap_s) - 1)


@dataclass(slots=True)
class _SessionState:
    """What the model keeps per session: enough to name the bucket of its idle period."""

    last_finish_s: float | None = None
    in_flight: bool = False
    closed: bool = False
    saw_stop: bool = False
    previous_gap_s: float | None = None
    bucket: str = BUCKETS[0]

    def on_start(self, time_s: float) -> float | None:
        """A request started; returns the gap it closed, if any."""
        gap = None
        if self.last_finish_s is not None and not self.in_flight:
            gap = max(0.0, time_s - self.last_finish_s)
            self.previous_gap_s = gap
        self.in_flight = True
        return gap

    def on_finish(self, time_s: float, stop_reason: str | None) -> None:
        self.in_flight = False
        self.last_finish_s = time_s
        if stop_reason is not None:
            self.saw_stop = True
        stop = stop_category(stop_reason) if self.saw_stop else UNKNOWN_STOP
        self.bucket = bucket_of(stop, self.previous_gap_s)


@dataclass(slots=True)
class _Bucket:
    """One bucket's law, as decayed weights: gaps per grid segment (given a return) and
    the (returned, never) counts of the never share. Stored weights are divided by ``scale``
    (decay multiplies ``scale``, O(1)); the curve is rebuilt lazily."""

    grid: tuple[float, ...]
    #: float64, one weight per grid segment (an array: a rebuild reads it without a copy)
    seg: np.ndarray
    returned: float
    never: float
    prior_never_share: float
    scale: float = 1.0
    closes_seen: bool = False
    curve: SurvivalCurve | None = field(default=None)
    #: gaps folded in since the curve was built
    pending: int = 0
    #: the curve's survival negated (non-decreasing, for bisect)
    neg: Sequence[float] = ()
    #: (curve, quantiles, p_return, confidence) read at silence 0 from that curve: what
    #: every forecast of a session that has just finished asks (see ``AdaptivePredictor._one``)
    fresh: tuple[SurvivalCurve, tuple[float, float, float], float, float] | None = None

    @classmethod
    def from_table(cls, grid: tuple[float, ...], seg_probs: Sequence[float],
                   never_share: float, weight: float) -> _Bucket:
        total = sum(seg_probs)
        seg = np.array([weight * p / total for p in seg_probs], dtype=np.float64)
        return cls(grid, seg, weight * (1.0 - never_share), weight * never_share, never_share)

    def _decay(self) -> None:
        self.scale *= DECAY
        if self.scale < 1e-150:  # fold the scale back in before it underflows
            self.seg = self.seg * self.scale
            self.returned *= self.scale
            self.never *= self.scale
            self.scale = 1.0

    def add_gap(self, gap_s: float) -> None:
        self._decay()
        i = segment_of(self.grid, gap_s)
        if i is None:
            self.never += 1.0 / self.scale
        else:
            self.seg[i] += 1.0 / self.scale
            self.returned += 1.0 / self.scale
        self.pending += 1

    def add_close(self) -> None:
        self._decay()
        self.never += 1.0 / self.scale
        self.closes_seen = True
        self.curve = None

    def never_share(self) -> float:
        if not self.closes_seen:
            return self.prior_never_share
        return self.never / (self.never + self.returned)

    def survival_curve(self) -> SurvivalCurve:
        """The bucket's curve, at most REBUILD_EVERY gaps stale."""
        if self.curve is None or self.pending >= REBUILD_EVERY:
            self.curve, self.neg = _bucket_curve(self.grid, self.seg, self.never_share())
            self.pending = 0
        return self.curve


def _bucket_curve(grid: tuple[float, ...], seg: np.ndarray, p_never: float
                  ) -> tuple[SurvivalCurve, Sequence[float]]:
    """A bucket's survival curve from its segment weights and never share, and its
    survival negated (for bisect).

    ``S(g_i) = P(never) + P(returns) * (weight beyond g_i) / total``, clipped to
    ``[P(never), 1]``; the running minimum keeps it monotone despite rounding, and the last
    knot is ``P(never)`` exactly. Every array operation here is elementwise or a
    left-to-right accumulation, so each number is the one the plain Python loops give, bit
    for bit (tests/predictors/test_adaptive_fast_path.py); the curve is valid by this
    construction, so it is made without :class:`SurvivalCurve`'s checks (its knot
    integral is left to the first ``integral`` call, as for any curve). A rebuild runs
    every :data:`REBUILD_EVERY` gaps of a bucket, so its cost shows in the scheduler's time
    per event (`kvprefetch bench control-plane`).
    """
    done = np.add.accumulate(seg)
    total = float(done[-1])  # the running sum's last value: the loops' total
    k = (1.0 - p_never) / total
    surv = np.empty(len(seg) + 1)
    surv[0] = 1.0
    np.minimum(1.0, np.maximum(p_never, 1.0 - k * done), out=surv[1:])
    np.minimum.accumulate(surv, out=surv)
    surv[-1] = p_never
    survival = tuple(surv.tolist())
    curve = object.__new__(SurvivalCurve)
    object.__setattr__(curve, "gaps_s", grid)
    object.__setattr__(curve, "survival", survival)
    object.__setattr__(curve, "_area", None)
    # Read only by bisect: a copy of the array's bytes, not 1,300 Python floats.
    neg = array("d")
    neg.frombytes((-surv).tobytes())
    object.__setattr__(curve, "_neg", neg)
    return curve, neg


def _broad_prior(grid: Sequence[float], pooled: Sequence[float]) -> list[float]:
    """Half the pooled gap law, half log-uniform (uniform in log1p gap) over the grid."""
    total = sum(pooled) or 1.0
    logs = [math.log1p(g) for g in grid]
    span = logs[-1] - logs[0]
    return [0.5 * p / total + 0.5 * (logs[i + 1] - logs[i]) / span
            for i, p in enumerate(pooled)]


class AdaptivePredictor:
    """Per-bucket empirical survival with exact conditioning; see the module docstring."""

    name: ClassVar[str] = "adaptive"
    payload_encoding: ClassVar[str] = "json"

    def __init__(self) -> None:
        self.fitted = False
        self.train_info: dict[str, Any] = {}
        #: bucket -> (gaps per grid segment, never-returned responses): the training counts
        self.counts: dict[str, tuple[list[float], float]] = {}
        #: bucket -> (segment probabilities given a return, never share): the shipped table,
        #: derived from the counts (:func:`_shrunk_table`)
        self.table: dict[str, tuple[list[float], float]] = {}
        #: the knots of every curve (see :func:`make_grid`)
        self.grid: tuple[float, ...] = GRID_S
        self._buckets: dict[str, _Bucket] = {}
        self._sessions: dict[str, _SessionState] = {}
        #: bucket -> (the curve, the gate, the silences where it may pass): see
        #: :meth:`gate_region`
        self._regions: dict[str, tuple[SurvivalCurve, tuple[float, float, float],
                                       tuple[tuple[float, float], ...]]] = {}

    # -- the Predictor protocol ---------------------------------------------------------
    def observe(self, event: SessionEvent) -> None:
        st = self._sessions.get(event.session_id)
        if st is None:
            st = self._sessions[event.session_id] = _SessionState()
        kind = event.kind
        if kind is EventKind.REQUEST_STARTED:
            bucket = st.bucket
            gap = st.on_start(event.time_s)
            if gap is not None and self.fitted:
                self._buckets[bucket].add_gap(gap)
        elif kind is EventKind.REQUEST_FINISHED:
            st.on_finish(event.time_s, event.stop_reason)
        elif kind is EventKind.SESSION_CLOSED or event.hint is HintKind.SESSION_CLOSED:
            if not st.closed and not st.in_flight and st.last_finish_s is not None and (
                self.fitted
            ):
                self._buckets[st.bucket].add_close()
            st.closed = True

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        self._require_fitted()
        return self._one(session_id, float(now_s))

    def forecast_many(
        self, session_ids: Sequence[str], now_s: float | Sequence[float]
    ) -> list[ArrivalForecast | None]:
        """Forecasts for many sessions (``None`` where unknown or in flight); ``now_s`` is
        one time for all or one per session. Sessions of one bucket share its curve."""
        self._require_fitted()
        nows = [now_s] * len(session_ids) if isinstance(now_s, int | float) else now_s
        return [self._one(sid, float(now)) for sid, now in zip(session_ids, nows, strict=True)]

    def _one(self, sid: str, now_s: float) -> ArrivalForecast | None:
        st = self._sessions.get(sid)
        if st is None or st.in_flight or st.last_finish_s is None:
            return None
        last = st.last_finish_s
        if st.closed:
            return ArrivalForecast(sid, last, (NEVER_S,) * 3, 0.0, NEVER_S, 1.0)
        bucket = self._buckets[st.bucket]
        curve = bucket.survival_curve()
        silence = max(0.0, now_s - last)
        fresh = bucket.fresh
        if silence == 0.0 and fresh is not None and fresh[0] is curve:
            _, q, p_return, confidence = fresh
        else:
            q, p_return = _read_curve(curve, bucket.neg, silence)
            confidence = min(MAX_CONFIDENCE,
                             math.exp(-0.5 * (math.log1p(q[2]) - math.log1p(q[0]))))
            if silence == 0.0:
                bucket.fresh = (curve, q, p_return, confidence)
        return ArrivalForecast(
            sid, last, q, p_return, silence + RETURN_HORIZON_S,
            confidence, conditioned=True, survival=curve,
        )

    def curve_of(self, bucket: str) -> SurvivalCurve:
        """The current survival curve of one bucket (its shipped one until traffic moves
        it)."""
        self._require_fitted()
        return self._buckets[bucket].survival_curve()

    # -- what the scheduler's sweep needs (kvprefetch.controlplane.core.sweep.GatedPredictor)
    # --------
    def idle_group(self, session_id: str) -> str | None:
        """The bucket whose curve alone (with the silence) makes the session's forecast, or
        None when its forecast reads no curve (unknown, in flight or closed). It changes
        only when :meth:`observe` sees an event of the session."""
        st = self._sessions.get(session_id)
        if st is None or st.in_flight or st.closed or st.last_finish_s is None:
            return None
        return st.bucket

    def gate_region(self, group: str, *, min_p_return: float, min_confidence: float,
                    max_silence_s: float) -> tuple[tuple[float, float], ...]:
        """Silence intervals ``[lo, hi]`` (seconds since the last response) outside which
        no forecast of a session of ``group`` has ``p_return >= min_p_return`` and
        ``confidence >= min_confidence`` (a superset of where both hold, up to
        ``max_silence_s`` at least). Reads the bucket's curve as a forecast of one of its
        sessions would (rebuilding it when a forecast would), so calling it once per sweep
        for each bucket with idle sessions leaves the model where forecasting them all
        would; cached per curve."""
        self._require_fitted()
        curve = self._buckets[group].survival_curve()
        gate = (min_p_return, min_confidence, max_silence_s)
        held = self._regions.get(group)
        if held is not None and held[0] is curve and held[1] == gate:
            return held[2]
        region = _gate_region(curve, min_p_return, min_confidence, max_silence_s)
        self._regions[group] = (curve, gate, region)
        return region

    # -- training -----------------------------------------------------------------------
    def fit(self, trace: Trace | Iterable[TraceSession], *, seed: int | None = None,
            progress: bool = False) -> Self:
        """Tabulate every response of ``trace`` by bucket (deterministic; ``seed`` and
        ``progress`` are accepted for the common training interface and unused)."""
        started = time.perf_counter()
        sessions = trace.sessions if isinstance(trace, Trace) else tuple(trace)
        labelled = [lb for session in sessions for lb in _labelled_responses(session)]
        grid = GRID_S
        seg = {b: [0.0] * (len(grid) - 1) for b in BUCKETS}
        never = dict.fromkeys(BUCKETS, 0.0)
        responses = dict.fromkeys(BUCKETS, 0)
        for bucket, gap in labelled:
            responses[bucket] += 1
            i = None if gap is None else segment_of(grid, gap)
            if i is None:
                never[bucket] += 1.0
            else:
                seg[bucket][i] += 1.0
        gaps = sum(sum(v) for v in seg.values())
        groups = sorted({session_group(s) for s in sessions})
        if gaps < MIN_TRAIN_GAPS:
            name = trace.name if isinstance(trace, Trace) else "sessions"
            raise PredictorError(
                f"trace {name!r} is too small to train {self.name!r}: {int(gaps)} "
                f"inter-request gaps; need at least {MIN_TRAIN_GAPS}"
            )
        self.grid = grid
        self.counts = {b: (seg[b], never[b]) for b in BUCKETS}
        self.train_info = {
            "trace": trace.name if isinstance(trace, Trace) else "sessions",
            "responses": sum(responses.values()),
            "gaps": int(gaps),
            "groups": len(groups),
            "train_groups": groups,
            "bucket_counts": {b: responses[b] for b in BUCKETS},
            "fit_seconds": round(time.perf_counter() - started, 3),
        }
        self._install()
        return self

    def _install(self) -> None:
        """The shipped table from the counts, and fresh online state (after fit or load)."""
        self.table = _shrunk_table(
            self.grid, {b: c[0] for b, c in self.counts.items()},
            {b: c[1] for b, c in self.counts.items()},
        )
        self._buckets = {
            b: _Bucket.from_table(
                self.grid, probs, p_never,
                UNKNOWN_PRIOR_WEIGHT if b.startswith(UNKNOWN_STOP) else PRIOR_WEIGHT,
            )
            for b, (probs, p_never) in self.table.items()
        }
        self._regions = {}
        self.fitted = True

    def reset_adaptation(self) -> None:
        """Forget what traffic taught since fit/load: back to the shipped table."""
        self._require_fitted()
        self._install()

    def _require_fitted(self) -> None:
        if not self.fitted:
            raise PredictorError(
                f"predictor {self.name!r} is not trained: train it (kvprefetch train) and load "
                f"it as '{self.name}:FILE', or use 'default'"
            )

    # -- artifacts ----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the training counts (not what traffic taught since) to one artifact."""
        self._require_fitted()
        payload = {
            "version": PAYLOAD_VERSION,
            "grid_s": list(self.grid),
            "buckets": {b: {"gaps": {str(i): c for i, c in enumerate(seg) if c},
                            "never": never}
                        for b, (seg, never) in self.counts.items()},
        }
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        params = {"prior_weight": PRIOR_WEIGHT, "unknown_prior_weight": UNKNOWN_PRIOR_WEIGHT,
                  "decay": DECAY, "short_gap_s": SHORT_GAP_S, "payload_version": PAYLOAD_VERSION}
        return write_artifact(path, model=self.name, payload=blob,
                              payload_encoding=self.payload_encoding, params=params,
                              train=self.train_info)

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read a model written by :meth:`save`; :class:`PredictorError` names any problem."""
        header, blob = read_artifact(path, cls.name)
        where = f"predictor artifact {str(path)!r}"
        try:
            payload = json.loads(blob)
            version = payload["version"]
            if version != PAYLOAD_VERSION:
                raise PredictorError(f"{where}: {cls.name!r} payload version {version!r} is not "
                                     f"supported (this kvprefetch reads {PAYLOAD_VERSION}); "
                                     "retrain the model")
            grid = check_grid(payload["grid_s"])
            counts = {}
            for b in BUCKETS:
                entry = payload["buckets"][b]
                seg = [0.0] * (len(grid) - 1)
                for i, c in entry["gaps"].items():
                    if not float(c) >= 0.0:
                        raise ValueError(f"negative count in bucket {b!r}")
                    seg[int(i)] = float(c)
                never = float(entry["never"])
                if not never >= 0.0:
                    raise ValueError(f"negative never count in bucket {b!r}")
                counts[b] = (seg, never)
            if not sum(sum(seg) for seg, _ in counts.values()) > 0:
                raise ValueError("no gaps at all")
        except PredictorError:
            raise
        except Exception as exc:
            raise PredictorError(f"{where}: corrupt {cls.name!r} payload: {exc!r}") from exc
        obj = cls()
        obj.counts = counts
        obj.grid = grid
        obj.train_info = dict(header.get("train", {}))
        obj._install()
        return obj


def _survival_at(g: Sequence[float], s: Sequence[float], t: float) -> float:
    """``S(t)`` of a curve's knots ``g`` and survival ``s``: linear between knots, 1 before
    the first, the floor ``s[-1]`` from the last on (the float operations of
    ``SurvivalCurve``)."""
    if t <= 0.0:
        return 1.0
    if t >= g[-1]:
        return s[-1]
    j = bisect_right(g, t)
    w = (t - g[j - 1]) / (g[j] - g[j - 1])
    return s[j - 1] + w * (s[j] - s[j - 1])


def _read_curve(curve: SurvivalCurve, neg: Sequence[float], silence_s: float
                ) -> tuple[tuple[float, float, float], float]:
    """The forecast's numbers at a silence: ``min(NEVER_S, curve.quantile_after(silence_s,
    level))`` for the three :data:`FORECAST_LEVELS` and ``curve.p_within(silence_s,
    RETURN_HORIZON_S)``, computed by the same float operations (the same results, bit
    for bit: tests/predictors/test_adaptive_fast_path.py) with ``S(silence)`` read once;
    the hot path of every forecast. ``neg``: ``curve.survival`` negated."""
    g, s = curve.gaps_s, curve.survival
    last = len(g) - 1
    floor = s[last]
    s_a = _survival_at(g, s, silence_s)
    alive = s_a - floor
    quantiles: list[float] = []
    for level in FORECAST_LEVELS:
        if level >= 1.0 or alive <= 1e-12:
            quantiles.append(NEVER_S)
            continue
        target = floor + (1.0 - max(0.0, level)) * alive
        j = bisect_left(neg, -target)
        if j == 0:
            gap = silence_s
        elif j > last:
            gap = math.inf
        else:
            span = s[j - 1] - s[j]
            gap = (g[j] if span <= 0.0
                   else g[j - 1] + (s[j - 1] - target) / span * (g[j] - g[j - 1]))
            gap = max(silence_s, gap)
        quantiles.append(min(NEVER_S, gap))
    # p_within(silence, h)
    if s_a <= 0.0:
        p_return = 1.0
    else:
        s_b = _survival_at(g, s, silence_s + RETURN_HORIZON_S)
        p_return = min(1.0, max(0.0, (s_a - s_b) / s_a))
    return (quantiles[0], quantiles[1], quantiles[2]), p_return


#: Slack of :func:`_gate_region`'s bounds against rounding (probabilities, confidences).
_GATE_SLACK = 1e-9
#: Per grid: index of the first knot at or beyond (knot ``i + 1``) + RETURN_HORIZON_S.
_AHEAD: dict[tuple[float, ...], list[int]] = {}


def _ahead_index(grid: tuple[float, ...]) -> list[int]:
    ahead = _AHEAD.get(grid)
    if ahead is None:
        last = len(grid) - 1
        ahead = [min(last, bisect_left(grid, grid[min(i + 1, last)] + RETURN_HORIZON_S))
                 for i in range(len(grid))]
        _AHEAD[grid] = ahead
    return ahead


def _gate_region(curve: SurvivalCurve, min_p_return: float, min_confidence: float,
                 max_silence_s: float) -> tuple[tuple[float, float], ...]:
    """Where a forecast from ``curve`` may pass the planner's gate (see
    :meth:`AdaptivePredictor.gate_region`), by grid segment ``[g_i, g_i+1]`` (the last:
    ``[g_last, inf)``), from bounds that hold over the whole segment because ``S`` does
    not increase and both quantiles :meth:`_one` reads do not decrease with the silence:

    * ``p_return = 1 - S(a + h) / S(a) <= 1 - S(g_j) / S(g_i)``, ``g_j`` the first knot at
      or beyond ``g_i+1 + h`` (1 where ``S`` may reach 0 in the segment);
    * ``confidence = exp(-(log1p q90(a) - log1p q10(a)) / 2)`` is at most its value with
      ``q90(g_i)`` and ``q10(g_i+1)`` (not bounded where no returning mass is left).
    """
    g, s = curve.gaps_s, curve.survival
    last = len(g) - 1
    floor = s[last]
    ahead = _ahead_index(g)
    p_gate = min_p_return - _GATE_SLACK
    c_gate = min_confidence - _GATE_SLACK
    lo_level, hi_level = FORECAST_LEVELS[0], FORECAST_LEVELS[-1]
    out: list[list[float]] = []
    for i in range(last + 1):
        a0 = g[i]
        if a0 > max_silence_s:
            break
        a1 = g[i + 1] if i < last else math.inf
        s_end = s[i + 1] if i < last else floor
        if s_end <= 0.0:
            maybe = True
        else:
            maybe = 1.0 - s[ahead[i]] / s[i] >= p_gate
            if maybe and c_gate > 0.0 and s_end - floor > _GATE_SLACK:
                q90 = min(NEVER_S, curve.quantile_after(a0, hi_level))
                q10 = min(NEVER_S, curve.quantile_after(a1, lo_level))
                conf = math.exp(-0.5 * (math.log1p(q90) - math.log1p(q10)))
                maybe = min(MAX_CONFIDENCE, conf) >= c_gate
        if maybe:
            if out and a0 <= out[-1][1]:
                out[-1][1] = a1
            else:
                out.append([a0, a1])
    return tuple((lo, hi) for lo, hi in out)


def _labelled_responses(session: TraceSession) -> Iterable[tuple[str, float | None]]:
    """(bucket, gap that followed or None for never) per response, through the serving
    state machine."""
    st = _SessionState()
    pending: str | None = None
    for event in replay_session(session):
        if event.kind is EventKind.REQUEST_STARTED:
            bucket = st.bucket
            gap = st.on_start(event.time_s)
            if pending is not None:
                yield bucket, gap
                pending = None
        else:
            st.on_finish(event.time_s, event.stop_reason)
            pending = st.bucket
    if pending is not None:
        yield pending, None


def _shrunk_table(
    grid: tuple[float, ...], seg: dict[str, list[float]], never: dict[str, float]
) -> dict[str, tuple[list[float], float]]:
    """Per bucket: segment probabilities given a return and the never share, each bucket
    shrunk toward its stop bucket, that toward the pooled law (see the module docstring)."""
    known = [b for b in BUCKETS if not b.startswith(UNKNOWN_STOP)]
    n_seg = len(grid) - 1
    pooled_seg = [sum(seg[b][i] for b in known) + 1e-3 for i in range(n_seg)]
    pooled_never = sum(never[b] for b in known)
    pooled_n = sum(pooled_seg) + pooled_never
    pooled_share = pooled_never / pooled_n
    pooled_p = [w / sum(pooled_seg) for w in pooled_seg]

    def shrink(counts: list[float], nev: float, parent_p: list[float], parent_share: float
               ) -> tuple[list[float], float]:
        n_ret = sum(counts)
        probs = [(c + SHRINK_PSEUDO * p) / (n_ret + SHRINK_PSEUDO)
                 for c, p in zip(counts, parent_p, strict=True)]
        share = (nev + SHRINK_PSEUDO * parent_share) / (n_ret + nev + SHRINK_PSEUDO)
        return probs, share

    table: dict[str, tuple[list[float], float]] = {}
    for stop in STOP_BUCKETS:
        members = [f"{stop}|{g}" for g in GAP_CLASSES]
        if stop == UNKNOWN_STOP:
            broad = _broad_prior(grid, pooled_seg)
            for b in members:
                table[b] = (broad, BROAD_NEVER)
            continue
        stop_seg = [sum(seg[b][i] for b in members) for i in range(n_seg)]
        stop_probs, stop_share = shrink(stop_seg, sum(never[b] for b in members), pooled_p,
                                        pooled_share)
        for b in members:
            table[b] = shrink(seg[b], never[b], stop_probs, stop_share)
    return table


#: The shipped model (``predictors/models/regenerate.sh`` regenerates it).
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "models" / "default.kvp"


def load_default() -> AdaptivePredictor:
    """The shipped ``default`` predictor: :data:`DEFAULT_ARTIFACT`, with fresh online state
    (each call returns a new, independent instance)."""
    if not DEFAULT_ARTIFACT.is_file():
        raise PredictorError(
            f"the shipped predictor artifact is missing ({DEFAULT_ARTIFACT}); reinstall "
            "kvprefetch or regenerate it with predictors/models/regenerate.sh"
        )
    return AdaptivePredictor.load(DEFAULT_ARTIFACT)
