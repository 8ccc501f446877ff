"""Plain, frozen records shared by the trace loaders, the scheduling core, the predictors and
the simulator. No I/O, no third-party imports.

Time is in seconds (float) everywhere; token counts are ints; bytes are ints.
"""

from __future__ import annotations

import enum
import itertools
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvprefetch.controlplane.base.records import quick_init

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


@quick_init
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
    #: ``REQUEST_FINISHED``: tokens of KV the session holds now, where the client said so
    #: (otherwise input + output).
    context_tokens: int | None = None

    @property
    def context_after(self) -> int:
        """Tokens of KV the session holds after this finished request."""
        if self.context_tokens is not None:
            return self.context_tokens
        return self.input_tokens + self.output_tokens


# ---------------------------------------------------------------------------------------------
# Forecasts: what predictors return to the planner.
# ---------------------------------------------------------------------------------------------

#: The quantile levels every forecast carries, ascending.
FORECAST_LEVELS: tuple[float, ...] = (0.1, 0.5, 0.9)


@quick_init
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

    ``survival``: optionally, the whole law of the gap as a :class:`SurvivalCurve` measured
    from ``last_finish_s`` (unconditional, never-returning mass included). When present,
    :meth:`p_within`, :meth:`expected_wait_s` and :meth:`arrival_quantile_after` read it,
    conditioned exactly on the silence so far, and ignore the knots and ``p_return``
    (which a predictor still fills, from the same curve, for the readers of quantiles).
    When absent they use the parametric law of :class:`_GapLaw` between the knots.

    ``hinted``: the law is a client's word about this idle period (a tool running with its
    ETA, a user typing: :mod:`kvprefetch.predictors.hinted`), not a forecast from the
    session's history. The session is on its way; its silence since the hint only
    conditions that law, which a plan made on it already knew.
    """

    session_id: str
    last_finish_s: float
    gap_quantiles_s: tuple[float, ...]
    p_return: float
    horizon_s: float
    confidence: float
    levels: tuple[float, ...] = field(default=FORECAST_LEVELS)
    conditioned: bool = False
    survival: SurvivalCurve | None = None
    hinted: bool = False

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

    # -- the distribution behind the knots (see _GapLaw for the model and its tail) -------
    def p_within(self, h_s: float, now_s: float) -> float:
        """P(the next arrival comes in ``(now_s, now_s + h_s]`` | no arrival by ``now_s``).

        Counts the chance that the session never returns (``p_return``). A point mass (all
        quantiles equal: the oracle) is a step: ``p_return`` if the arrival falls in the
        window, else 0; a point mass already due counts as arriving now.
        """
        if h_s <= 0.0:
            return 0.0
        silence = max(0.0, now_s - self.last_finish_s)
        if self.survival is not None:
            return self.survival.p_within(silence, h_s)
        if self.p_return <= 0.0:
            return 0.0
        law = _GapLaw.of(self, silence)
        if law is None:  # point mass
            gap = max(self.gap_quantiles_s[0], silence)
            return min(1.0, self.p_return) if gap <= silence + h_s else 0.0
        return law.p_within(silence, h_s)

    def expected_wait_s(self, now_s: float, horizon_s: float) -> float:
        """E[min(T - now_s, horizon_s) | no arrival by now_s], T the next arrival (``inf``
        if the session never returns): how long KV warmed now would wait before its use
        (LHD's expected lifetime), capped at ``horizon_s``."""
        if horizon_s <= 0.0:
            return 0.0
        silence = max(0.0, now_s - self.last_finish_s)
        if self.survival is not None:
            return self.survival.expected_wait(silence, horizon_s)
        if self.p_return <= 0.0:
            return horizon_s
        law = _GapLaw.of(self, silence)
        if law is None:
            p = min(1.0, self.p_return)
            wait = max(0.0, self.gap_quantiles_s[0] - silence)
            return p * min(wait, horizon_s) + (1.0 - p) * horizon_s
        return law.expected_wait(silence, horizon_s)

    def arrival_quantile_after(self, level: float, now_s: float) -> float:
        """Absolute time of the ``level`` quantile of the next arrival given that the
        session returns and has not by ``now_s`` (never earlier than ``now_s``; ``inf`` for
        ``level >= 1``). For timing a prefetch to land before an early quantile."""
        if level >= 1.0:
            return math.inf
        silence = max(0.0, now_s - self.last_finish_s)
        if self.survival is not None:
            gap = self.survival.quantile_after(silence, max(0.0, level))
            return max(now_s, self.last_finish_s + gap)
        law = _GapLaw.of(self, silence)
        if law is None:
            return max(now_s, self.last_finish_s + self.gap_quantiles_s[0])
        return max(now_s, self.last_finish_s + law.quantile_after(silence, max(0.0, level)))


@dataclass(frozen=True, slots=True)
class SurvivalCurve:
    """The law of the gap from a session's last finish to its next request, as knots of its
    survival ``S(g) = P(gap > g)``.

    ``S`` is *unconditional*: it counts the chance that the session never returns, so it
    falls from ``S(0) = 1`` to ``S(g_last) = P(never returns)`` at the last knot and stays
    there (a session silent past the last knot is taken never to return). Between knots
    ``S`` is linear in the gap (the density is uniform within each segment), so its
    integral and its inverse are exact. ``gaps_s`` starts at 0 and increases strictly;
    ``survival`` starts at 1 and never increases.

    Conditioning on ``a`` seconds of silence is exact: ``S(a + t) / S(a)``. Built once per
    model state and shared by every forecast that uses it (the cumulative integral is
    precomputed); each query is a binary search over the knots.
    """

    gaps_s: tuple[float, ...]
    survival: tuple[float, ...]
    #: integral of S over [0, gaps_s[i]], per knot (None until :meth:`integral` first
    #: needs it, see :meth:`_areas`: only the value rule integrates a curve)
    _area: tuple[float, ...] | None = field(init=False, repr=False, compare=False)
    #: ``survival`` negated (non-decreasing, for bisect); any sequence of floats
    _neg: Sequence[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        g, s = self.gaps_s, self.survival
        if len(g) < 2 or len(g) != len(s):
            raise ValueError(f"a survival curve needs >= 2 knots of (gap, survival), got "
                             f"{len(g)} gaps and {len(s)} survivals")
        if g[0] != 0.0 or s[0] != 1.0:
            raise ValueError(f"a survival curve starts at (0, 1), got ({g[0]}, {s[0]})")
        for i in range(1, len(g)):
            if not g[i] > g[i - 1] or not math.isfinite(g[i]):
                raise ValueError(f"survival knot gaps must increase strictly and be finite: "
                                 f"{g[i - 1]} then {g[i]}")
            if not 0.0 <= s[i] <= s[i - 1]:
                raise ValueError(f"survival must not increase and stay in [0, 1]: "
                                 f"{s[i - 1]} then {s[i]} at gap {g[i]}")
        object.__setattr__(self, "_area", None)
        object.__setattr__(self, "_neg", tuple(-v for v in s))

    @classmethod
    def from_knots(cls, knots: Iterable[tuple[float, float]]) -> SurvivalCurve:
        """A curve from ``(gap_s, survival)`` pairs."""
        pairs = tuple(knots)
        return cls(tuple(float(g) for g, _ in pairs), tuple(float(v) for _, v in pairs))

    @property
    def knots(self) -> tuple[tuple[float, float], ...]:
        return tuple(zip(self.gaps_s, self.survival, strict=True))

    @property
    def p_never(self) -> float:
        """P(the session never returns) (its survival beyond the last knot)."""
        return self.survival[-1]

    def at(self, gap_s: float) -> float:
        """``S(gap_s)``: P(gap > gap_s), never-returning mass included."""
        g, s = self.gaps_s, self.survival
        if gap_s <= 0.0:
            return 1.0
        if gap_s >= g[-1]:
            return s[-1]
        j = bisect_right(g, gap_s)
        w = (gap_s - g[j - 1]) / (g[j] - g[j - 1])
        return s[j - 1] + w * (s[j] - s[j - 1])

    def _areas(self) -> tuple[float, ...]:
        """The knots' cumulative integral (trapezoids, exact for a curve linear between
        knots), computed on first use and kept."""
        area = self._area
        if area is None:
            g, s = self.gaps_s, self.survival
            acc = [0.0]
            for i in range(1, len(g)):
                acc.append(acc[-1] + 0.5 * (g[i] - g[i - 1]) * (s[i] + s[i - 1]))
            area = tuple(acc)
            object.__setattr__(self, "_area", area)
        return area

    def integral(self, gap_s: float) -> float:
        """Integral of ``S`` over [0, ``gap_s``]."""
        g, s = self.gaps_s, self.survival
        if gap_s <= 0.0:
            return 0.0
        if gap_s >= g[-1]:
            return self._areas()[-1] + (gap_s - g[-1]) * s[-1]
        j = bisect_right(g, gap_s)
        return self._areas()[j - 1] + 0.5 * (gap_s - g[j - 1]) * (s[j - 1] + self.at(gap_s))

    def p_within(self, silence_s: float, h_s: float) -> float:
        """P(gap in (a, a + h] | gap > a), ``a`` = ``silence_s``; 1 when no mass is left
        beyond ``a`` at all (the arrival is due)."""
        if h_s <= 0.0:
            return 0.0
        s_a = self.at(silence_s)
        if s_a <= 0.0:
            return 1.0
        return min(1.0, max(0.0, (s_a - self.at(silence_s + h_s)) / s_a))

    def expected_wait(self, silence_s: float, horizon_s: float) -> float:
        """E[min(gap - a, H) | gap > a] (``inf`` gap if it never returns)."""
        if horizon_s <= 0.0:
            return 0.0
        s_a = self.at(silence_s)
        if s_a <= 0.0:
            return 0.0
        wait = (self.integral(silence_s + horizon_s) - self.integral(silence_s)) / s_a
        return min(horizon_s, max(0.0, wait))

    def quantile_after(self, silence_s: float, level: float) -> float:
        """The gap ``g >= a`` with P(gap <= g | it returns, gap > a) = ``level``; ``inf``
        when no returning mass is left beyond ``a`` (or ``level >= 1``)."""
        s_a = self.at(silence_s)
        floor = self.survival[-1]
        alive_returning = s_a - floor
        if level >= 1.0 or alive_returning <= 1e-12:
            return math.inf
        target = floor + (1.0 - max(0.0, level)) * alive_returning
        j = bisect_left(self._neg, -target)  # first knot with survival <= target
        if j == 0:
            return silence_s
        if j >= len(self.gaps_s):
            return math.inf
        g, s = self.gaps_s, self.survival
        span = s[j - 1] - s[j]
        gap = g[j] if span <= 0.0 else g[j - 1] + (s[j - 1] - target) / span * (g[j] - g[j - 1])
        return max(silence_s, gap)


#: Survival of the gap law falls from 0.5 to 0.1 over the q50 -> q90 segment; the tail
#: beyond q90 keeps that log-slope (same model as :mod:`kvprefetch.predictors.distribution`).
_TAIL_SURVIVAL_DROP = math.log(5.0)
#: Smallest log1p step between knots used for the tail's decay (as the predictors' floor).
_MIN_LOG_STEP = 1e-3


def _log_integral(x: float) -> float:
    """An antiderivative of ``log1p(x)``."""
    return (1.0 + x) * math.log1p(x) - x


@dataclass(frozen=True, slots=True)
class _GapLaw:
    """The gap from the last finish to the next arrival, built from a forecast's 0.1, 0.5
    and 0.9 quantiles, in ``u = log1p(gap)``:

    * between the knots the CDF ``F`` (given that the session returns) is linear in ``u``;
    * below the 0.1 knot it falls linearly in ``u`` to 0 at the *anchor*: gap 0, or, for a
      ``conditioned`` forecast, the silence it was computed at (taken to be
      ``min(silence, q10)``: a learned forecast's quantiles are of the total gap, already
      conditioned on the silence up to the time it was asked for, and floored at it);
    * beyond the 0.9 knot a Pareto tail: survival ``0.1 * ((1 + g) / (1 + q90)) ** -rate``
      with the log-slope of the q50 -> q90 segment. Inter-request gaps are heavy tailed
      (a tool call returns in seconds, a person in minutes, hours or never), so the
      hazard must fall with age, as hazard-rate TTL caching observes; an exponential tail
      would claim a constant hazard and keep long-silent sessions valuable. It is also the
      model the learned predictors condition with, so the two agree.

    ``p_ever`` is the probability of ever returning: ``p_return`` is that of returning
    within ``horizon_s``, hence ``p_return / F(horizon_s)`` (capped at 1), the reading of
    :func:`kvprefetch.predictors.distribution.prob_return_within`.
    """

    g0: float
    g10: float
    g50: float
    g90: float
    u0: float
    u10: float
    u50: float
    u90: float
    rate: float
    p_ever: float

    @staticmethod
    def of(fc: ArrivalForecast, silence_s: float) -> _GapLaw | None:
        """The law of ``fc`` seen after ``silence_s`` of silence; None for a point mass."""
        g10 = max(0.0, fc.gap_at(0.1))
        g50 = max(g10, fc.gap_at(0.5))
        g90 = max(g50, fc.gap_at(0.9))
        if g90 <= g10:
            return None
        g0 = min(silence_s, g10) if fc.conditioned else 0.0
        u10, u50, u90 = math.log1p(g10), math.log1p(g50), math.log1p(g90)
        rate = _TAIL_SURVIVAL_DROP / max(u90 - u50, _MIN_LOG_STEP)
        law = _GapLaw(g0, g10, g50, g90, math.log1p(g0), u10, u50, u90, rate, 1.0)
        f_h = 1.0 - law.survival(fc.horizon_s)
        p_ever = min(1.0, fc.p_return / f_h) if f_h > 0.0 else min(1.0, fc.p_return)
        return _GapLaw(g0, g10, g50, g90, law.u0, u10, u50, u90, rate, p_ever)

    def _knots(self) -> tuple[tuple[float, float, float], ...]:
        """(gap, u, survival) at the anchor and the three quantiles."""
        return (
            (self.g0, self.u0, 1.0),
            (self.g10, self.u10, 0.9),
            (self.g50, self.u50, 0.5),
            (self.g90, self.u90, 0.1),
        )

    def survival(self, gap_s: float) -> float:
        """``1 - F(gap_s)``: P(gap > gap_s | the session returns)."""
        if gap_s <= self.g0:
            return 1.0
        u = math.log1p(gap_s)
        if u >= self.u90:
            return 0.1 * math.exp(-self.rate * (u - self.u90))
        knots = self._knots()
        for (_, u_lo, s_lo), (_, u_hi, s_hi) in itertools.pairwise(knots):
            if u < u_hi:
                return s_lo + (s_hi - s_lo) * (u - u_lo) / (u_hi - u_lo)
        return 0.1  # unreachable: u < u90 falls in a segment

    def _tail_integral(self, x0: float, x1: float, ref_g: float, ref_s: float) -> float:
        """Integral over [x0, x1] of ``ref_s * ((1 + g) / (1 + ref_g)) ** -rate``."""
        v0, v1 = (1.0 + x0) / (1.0 + ref_g), (1.0 + x1) / (1.0 + ref_g)
        k = 1.0 - self.rate
        inner = math.log(v1 / v0) if abs(k) < 1e-9 else (v1**k - v0**k) / k
        return ref_s * (1.0 + ref_g) * inner

    def survival_integral(self, x0: float, x1: float) -> float:
        """Integral of :meth:`survival` over the gaps [x0, x1]."""
        total = max(0.0, min(x1, self.g0) - x0)  # survival 1 up to the anchor
        knots = self._knots()
        for (g_lo, u_lo, s_lo), (g_hi, u_hi, s_hi) in itertools.pairwise(knots):
            a, b = max(x0, g_lo), min(x1, g_hi)
            if b <= a or u_hi <= u_lo:
                continue
            slope = (s_hi - s_lo) / (u_hi - u_lo)
            log_part = _log_integral(b) - _log_integral(a) - u_lo * (b - a)
            total += s_lo * (b - a) + slope * log_part
        a = max(x0, self.g90)
        if x1 > a:
            total += self._tail_integral(a, x1, self.g90, 0.1)
        return total

    def p_within(self, silence_s: float, h_s: float) -> float:
        p = self.p_ever
        s_now = self.survival(silence_s)
        alive = (1.0 - p) + p * s_now
        if alive <= 0.0:  # certain to return and deep in the tail (underflow): hazard form
            du = math.log1p(silence_s + h_s) - math.log1p(silence_s)
            return 1.0 - math.exp(-self.rate * du)
        got = p * (s_now - self.survival(silence_s + h_s)) / alive
        return min(1.0, max(0.0, got))

    def expected_wait(self, silence_s: float, horizon_s: float) -> float:
        p = self.p_ever
        s_now = self.survival(silence_s)
        alive = (1.0 - p) + p * s_now
        end = silence_s + horizon_s
        if alive <= 0.0:  # as in p_within: survival relative to now, in the tail
            return self._tail_integral(silence_s, end, silence_s, 1.0)
        # E[min(T - now, H)] = integral over [0, H] of P(T - now > t | alive).
        returned = p * (s_now * horizon_s - self.survival_integral(silence_s, end)) / alive
        return min(horizon_s, max(0.0, horizon_s - returned))

    def quantile_after(self, silence_s: float, level: float) -> float:
        """The gap at which P(gap <= g | returns, gap > silence) = ``level``."""
        s_now = self.survival(silence_s)
        target = s_now * (1.0 - level)
        if target <= 0.0:  # underflow deep in the tail: the tail is scale-free there
            return math.expm1(math.log1p(silence_s) - math.log1p(-level) / self.rate)
        if target <= 0.1:
            return math.expm1(self.u90 - math.log(target / 0.1) / self.rate)
        knots = self._knots()
        for (_, u_lo, s_lo), (_, u_hi, s_hi) in itertools.pairwise(knots):
            if target >= s_hi:  # survival at the knots falls strictly
                if target >= s_lo:
                    return math.expm1(u_lo)
                return math.expm1(u_lo + (u_hi - u_lo) * (s_lo - target) / (s_lo - s_hi))
        return self.g90  # unreachable: target in (0.1, 1] falls in a segment
