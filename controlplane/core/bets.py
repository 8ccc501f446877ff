"""The forecast's track record against recency: :class:`DisplacementBets`.

A prefetch that finds no free room on its node would displace residents: a bet that the
session it brings comes back before them. Every such decision is recorded whether or not
it is taken (a shadow bet: arrivals do not depend on what the tier holds) and settled by
the first arrival among the candidate and its would-be victims: the candidate first is a
win, a victim first a loss; so is a prefetch of the candidate evicted before it was read
(the room went, coming back first did not help). A bet none of them settles within
``horizon_s`` is dropped.

Displacement is allowed in a bucket only while the bucket's record shows the forecast
winning: the one-sided 95% Wilson lower bound of its win share above ``min_win_share``.
Elsewhere a prefetch fills free room only, and the tier keeps what recency keeps, as under
``reactive``. So a forecast that does not beat recency on the traffic at hand stops
displacing after a few bets, and one that does earns the right, per bucket; nothing here
is fitted offline. A certain forecast (confidence 1, the perfect-forecast bound) is not
gated.

Buckets (:meth:`DisplacementBets.bucket`): whether the forecast is sharp (a client's hint
with an ETA: ``confidence >= planner.displace_min_confidence``) and how much sooner it says
the candidate comes than the soonest victim (whole powers of two of the ratio of waits,
capped at :data:`LEAD_BINS`).

Who calls: the prefetcher when an order's start time comes and it would displace
(:meth:`place`, :meth:`allows`); the core at every request arrival (:meth:`arrived`) and
session close (:meth:`forget`); the tier books when a prefetch is evicted unread
(:meth:`wasted`). Bounded: at most :data:`MAX_OPEN_BETS` open bets (the
oldest are dropped). Pure and deterministic.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvprefetch.controlplane.core.stats import CoreStats

__all__ = ["LEAD_BINS", "MAX_OPEN_BETS", "BetRecord", "DisplacementBets", "wilson_lower"]

#: Lead buckets: the candidate is forecast 2**k times sooner than its soonest victim, k in
#: [0, LEAD_BINS] (the last bucket holds every larger lead and victims never forecast to
#: return).
LEAD_BINS = 6
#: Open bets kept at most; the oldest go first.
MAX_OPEN_BETS = 100_000
#: One-sided 95%.
_Z = 1.6448536269514722


def wilson_lower(wins: int, n: int, z: float = _Z) -> float:
    """Lower Wilson score bound of a win share from ``wins`` of ``n`` (0 when ``n`` is 0)."""
    if n <= 0:
        return 0.0
    p = wins / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (centre - spread) / (1 + z2 / n)


@dataclass(slots=True)
class BetRecord:
    """Settled bets of one bucket."""

    wins: int = 0
    losses: int = 0

    @property
    def settled(self) -> int:
        return self.wins + self.losses


@dataclass(slots=True)
class _Bet:
    candidate: str
    victims: tuple[str, ...]
    bucket: tuple[bool, int]
    placed_s: float


@dataclass(slots=True)
class DisplacementBets:
    """Open and settled displacement bets (module docstring)."""

    min_win_share: float
    horizon_s: float
    #: The core's counters (``bets_won``, ``bets_lost``).
    stats: CoreStats = field(default_factory=CoreStats)
    records: dict[tuple[bool, int], BetRecord] = field(default_factory=dict)
    _open: dict[int, _Bet] = field(default_factory=dict)
    _by_session: dict[str, set[int]] = field(default_factory=dict)
    _order: deque[int] = field(default_factory=deque)
    _next_id: int = 0

    @staticmethod
    def bucket(sharp: bool, now_s: float, candidate_use_s: float,
               victim_uses_s: Sequence[float]) -> tuple[bool, int]:
        """The bucket of a decision: sharpness and the forecast lead over the soonest
        victim (see the module docstring)."""
        soonest = min(victim_uses_s, default=math.inf)
        wait = max(candidate_use_s - now_s, 1e-3)
        other = soonest - now_s
        if not math.isfinite(other):
            return sharp, LEAD_BINS
        ratio = max(other, 0.0) / wait
        lead = 0 if ratio < 2.0 else min(LEAD_BINS, int(math.log2(ratio)))
        return sharp, lead

    def allows(self, bucket: tuple[bool, int]) -> bool:
        """Whether this bucket's record says its forecasts beat recency (always, with a
        ``min_win_share`` of 0: displacement wherever the forecast says so)."""
        if self.min_win_share <= 0.0:
            return True
        rec = self.records.get(bucket)
        if rec is None:
            return False
        return wilson_lower(rec.wins, rec.settled) > self.min_win_share

    def place(self, candidate: str, victims: Sequence[str], bucket: tuple[bool, int],
              now_s: float) -> None:
        """Record that ``candidate`` would displace ``victims`` now."""
        self._expire(now_s)
        if not victims:
            return
        bet_id = self._next_id
        self._next_id += 1
        bet = _Bet(candidate, tuple(victims), bucket, now_s)
        self._open[bet_id] = bet
        self._order.append(bet_id)
        for sid in (candidate, *bet.victims):
            self._by_session.setdefault(sid, set()).add(bet_id)
        while len(self._open) > MAX_OPEN_BETS:
            self._drop(self._order.popleft())
        if len(self._order) > 2 * MAX_OPEN_BETS:  # settled ids left behind an open one
            self._order = deque(i for i in self._order if i in self._open)

    def arrived(self, sid: str, now_s: float) -> None:
        """A request of ``sid`` arrived: the open bets it is part of are settled."""
        self._expire(now_s)
        ids = self._by_session.get(sid)
        if not ids:
            return
        for bet_id in sorted(ids):
            bet = self._open.get(bet_id)
            if bet is None:
                continue
            rec = self.records.setdefault(bet.bucket, BetRecord())
            if bet.candidate == sid:
                rec.wins += 1
                self.stats.bets_won += 1
            else:
                rec.losses += 1
                self.stats.bets_lost += 1
            self._drop(bet_id)

    def wasted(self, sid: str) -> None:
        """A prefetch of ``sid`` was evicted before any request read it: its open bets
        as the candidate are lost (coming back first did not help; the room went)."""
        for bet_id in sorted(self._by_session.get(sid, ())):
            bet = self._open[bet_id]
            if bet.candidate == sid:
                self.records.setdefault(bet.bucket, BetRecord()).losses += 1
                self.stats.bets_lost += 1
                self._drop(bet_id)

    def forget(self, sid: str) -> None:
        """The session closed: its open bets are dropped unsettled."""
        for bet_id in sorted(self._by_session.get(sid, ())):
            self._drop(bet_id)

    @property
    def open_bets(self) -> int:
        return len(self._open)

    def _expire(self, now_s: float) -> None:
        order, open_ = self._order, self._open
        while order:
            bet = open_.get(order[0])
            if bet is not None and now_s - bet.placed_s <= self.horizon_s:
                return
            self._drop(order.popleft())

    def _drop(self, bet_id: int) -> None:
        bet = self._open.pop(bet_id, None)
        if bet is None:
            return
        for sid in (bet.candidate, *bet.victims):
            ids = self._by_session.get(sid)
            if ids is not None:
                ids.discard(bet_id)
                if not ids:
                    del self._by_session[sid]
