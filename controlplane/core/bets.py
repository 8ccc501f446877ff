"""The forecast's track record against recency: :class:`DisplacementBets`.

Whatever room a prefetch takes, a resident's or free room, pushes residents out sooner
than recency alone would: it is a bet that the session it brings comes back before them
(those it displaces, or those its room would have kept the longest). Every such decision
is recorded whether or not it is taken (a shadow bet: arrivals do not depend on what the
tier holds) and settled by the first arrival among the candidate and those residents: the
candidate first is a win, a resident first a loss; so is a prefetch of the candidate
evicted before it was read (the room went, coming back first did not help). A bet none of
them settles within ``horizon_s`` is dropped. The prefetches taken keep a second record:
read by a request (won) or evicted unread (lost).

A prefetch starts in a bucket only while the bucket's bets show the forecast winning (the
one-sided 95% Wilson lower bound of their win share above ``min_win_share``, for its own
bets or for those pooled with the bets of the same sharpness at smaller leads, which are
harder to win: a bucket with few bets of its own borrows their record) and its
prefetches taken have not been shown to lose (the upper bound of their read share not
below it; such a bucket still takes one decision in :data:`EXPLORE_EVERY`, so that its
record can recover). Elsewhere nothing is prefetched and the tier keeps what recency
keeps, as under ``reactive``. So a forecast that does not beat recency on the traffic at
hand stops after a few bets, and one that does earns the right, per bucket; nothing here
is fitted offline. A certain forecast (confidence 1, the perfect-forecast bound) is not
gated.

Buckets (:meth:`DisplacementBets.bucket`): whether the forecast is sharp (a client's hint
with an ETA: ``confidence >= planner.displace_min_confidence``) and how much sooner it says
the candidate comes than the soonest of those residents (whole powers of two of the ratio
of waits, capped at :data:`LEAD_BINS`).

Who calls: the prefetcher when an order's start time comes (:meth:`place`,
:meth:`allows`, and :meth:`took` once it starts); the core at every request arrival
(:meth:`arrived`) and session close (:meth:`forget`); the tier books when a prefetch is
read (:meth:`read`) or evicted unread (:meth:`wasted`). Bounded: at most
:data:`MAX_OPEN_BETS` open bets (the oldest are dropped) and one taken prefetch per
session. Pure and deterministic.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvprefetch.controlplane.core.stats import CoreStats

__all__ = ["EXPLORE_EVERY", "LEAD_BINS", "MAX_OPEN_BETS", "BetRecord", "Bucket",
           "DisplacementBets", "wilson_lower", "wilson_upper"]

#: Lead buckets: the candidate is forecast 2**k times sooner than its soonest victim, k in
#: [0, LEAD_BINS] (the last bucket holds every larger lead and victims never forecast to
#: return).
LEAD_BINS = 6
#: Open bets kept at most; the oldest go first.
MAX_OPEN_BETS = 100_000
#: A bucket whose taken prefetches have lost still takes one decision in this many, so
#: that its record can recover when the traffic changes.
EXPLORE_EVERY = 16
#: Sharp or not, and the lead bucket.
Bucket = tuple[bool, int]
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


def wilson_upper(wins: int, n: int, z: float = _Z) -> float:
    """Upper Wilson score bound of a win share from ``wins`` of ``n`` (1 when ``n`` is 0)."""
    return 1.0 - wilson_lower(n - wins, n, z) if n > 0 else 1.0


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
    bucket: Bucket
    placed_s: float


@dataclass(slots=True)
class DisplacementBets:
    """Open and settled displacement bets, and the record of the prefetches taken (module
    docstring)."""

    min_win_share: float
    horizon_s: float
    #: The core's counters (``bets_won``, ``bets_lost``).
    stats: CoreStats = field(default_factory=CoreStats)
    #: Settled shadow bets per bucket: the candidate came back first (won) or not.
    records: dict[Bucket, BetRecord] = field(default_factory=dict)
    #: Prefetches taken per bucket: read by a request (won) or evicted unread (lost).
    taken: dict[Bucket, BetRecord] = field(default_factory=dict)
    _open: dict[int, _Bet] = field(default_factory=dict)
    _by_session: dict[str, set[int]] = field(default_factory=dict)
    _order: deque[int] = field(default_factory=deque)
    _next_id: int = 0
    #: The bucket of each session's prefetch in flight or unread.
    _took: dict[str, Bucket] = field(default_factory=dict)
    _explore: dict[Bucket, int] = field(default_factory=dict)

    @staticmethod
    def bucket(sharp: bool, now_s: float, candidate_use_s: float,
               victim_uses_s: Sequence[float]) -> Bucket:
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

    def allows(self, bucket: Bucket) -> bool:
        """Whether a prefetch in this bucket may start: its bets have been won (the lower
        bound of their win share above ``min_win_share``) and the prefetches taken have
        not been shown to lose (the upper bound of their read share not below it), save
        one in :data:`EXPLORE_EVERY`. Always, with a ``min_win_share`` of 0."""
        share = self.min_win_share
        if share <= 0.0:
            return True
        if not self._record_wins(bucket):
            return False
        took = self.taken.get(bucket)
        if took is None or wilson_upper(took.wins, took.settled) >= share:
            return True
        n = self._explore.get(bucket, 0) + 1
        self._explore[bucket] = n
        return n % EXPLORE_EVERY == 0

    def _record_wins(self, bucket: Bucket) -> bool:
        """Whether the bucket's bets show the forecast winning: its own record, or the
        record of its bets pooled with those of the same sharpness at smaller leads
        (harder bets: the candidate forecast less far ahead of the residents), which a
        bucket with few bets of its own borrows."""
        share = self.min_win_share
        rec = self.records.get(bucket)
        if rec is not None and wilson_lower(rec.wins, rec.settled) > share:
            return True
        sharp, lead = bucket
        wins = settled = 0
        for k in range(lead + 1):
            r = self.records.get((sharp, k))
            if r is not None:
                wins, settled = wins + r.wins, settled + r.settled
        return settled > 0 and wilson_lower(wins, settled) > share

    def place(self, candidate: str, victims: Sequence[str], bucket: Bucket,
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

    def took(self, sid: str, bucket: Bucket) -> None:
        """A prefetch of ``sid`` in ``bucket`` started."""
        self._took[sid] = bucket

    def read(self, sid: str) -> None:
        """A request read what a prefetch of ``sid`` brought: a win for its bucket."""
        bucket = self._took.pop(sid, None)
        if bucket is not None:
            self.taken.setdefault(bucket, BetRecord()).wins += 1

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
        """A prefetch of ``sid`` was evicted before any request read it: a loss for the
        bucket it was taken in, and its open bets as the candidate are lost (coming back
        first did not help; the room went)."""
        bucket = self._took.pop(sid, None)
        if bucket is not None:
            self.taken.setdefault(bucket, BetRecord()).losses += 1
        for bet_id in sorted(self._by_session.get(sid, ())):
            bet = self._open[bet_id]
            if bet.candidate == sid:
                self.records.setdefault(bet.bucket, BetRecord()).losses += 1
                self.stats.bets_lost += 1
                self._drop(bet_id)

    def forget(self, sid: str) -> None:
        """The session closed: its open bets are dropped unsettled."""
        self._took.pop(sid, None)
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
