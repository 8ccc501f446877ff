"""The scheduler core's tiers: the shared tier vocabulary plus predicted-use eviction.

The core keeps a :class:`Tier` of every node's DRAM tier: in the simulator it *is* the
tier; in the live service it mirrors what the agents report. Entries are keyed by session
id (``TierEntry(session_id, tokens, nbytes, last_use_s, ...)``). The entry record, the
strategy contract, LRU and ``Tier`` live in :mod:`kvprefetch.controlplane.base.tiers` (the engine
emulator and the agents use them too); only the strategy that asks the core's forecasts
lives here. Same convention: the **largest** key is evicted first.

Eviction without a scan
-----------------------
:class:`IndexedTier` (the core's DRAM books) chooses victims without asking a strategy for
every resident's key on every decision (a full sort re-forecasts every resident session
per write-through, dozens of forecasts per finish on a busy node). A
strategy that implements :class:`BoundedStrategy` gives, per entry, its key now and an
*upper bound* of its key until a time (``until_s``); the tier keeps the bounds in a
max-heap, refreshed lazily (an entry whose bound expired, or whose session the core marked
changed with :meth:`IndexedTier.invalidate`, is re-bounded at the next decision), and
takes victims in exactly the order a full sort by (key desc, name) would give: it computes
the exact key of heap tops only until the best exact key beats every remaining bound
(Fagin's threshold rule). Exact whenever each key is non-decreasing in time between the
session's own events: LRU's ``-last_use_s`` only falls; a predicted next use only moves
later as the silence grows (a conditioned median ``S^-1(S(a)/2)`` is non-decreasing in the
silence ``a``; recency floors and ``p_return`` gates only push it later). What a bound
cannot see: a predictor that adapts a law shared by many sessions (``adaptive``'s bucket
curves) may move a session's key without an event of its own; bounds expire after at most
``max_window_s`` for that, and a key found above its bound is counted
(``IndexStats.bound_misses``) and the decision is taken again with every entry re-bounded
(a miss is seen only when that entry is reached, so a rare decision can still differ from
a full sort's). Which keys are evaluated when matters too: the core keeps the law a key was
read from for reuse, so a full sort, this index and its bound windows refresh those laws
at different times, and a simulation with the index may differ slightly from one with
a full sort.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvprefetch.controlplane.base.tiers import INF, EvictionStrategy, LruEviction, Tier, TierEntry

__all__ = ["INF", "BoundedStrategy", "EvictionStrategy", "IndexStats", "IndexedLruEviction",
           "IndexedTier", "KeyBound", "LruEviction", "PredictedUseEviction", "Tier", "TierEntry"]


@dataclass(frozen=True, slots=True)
class KeyBound:
    """An entry's eviction key as of ``at_s`` (``now_key``; ``-inf`` if unknown) and an
    upper bound of it (``upper``) for every time up to ``until_s``."""

    now_key: float
    upper: float
    until_s: float

    @property
    def exact(self) -> bool:
        """The key is ``now_key`` at every time up to ``until_s`` (it can only rise, and
        its bound says it does not)."""
        return self.now_key == self.upper


@runtime_checkable
class BoundedStrategy(Protocol):
    """An eviction strategy whose keys :class:`IndexedTier` can keep in an index.

    ``keys`` is the :class:`EvictionStrategy` contract (exact keys now); ``bounds`` is
    called once per entry when it enters the tier, when its bound expires and after
    :meth:`IndexedTier.invalidate`: batched, for every entry due at that decision.
    """

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]: ...

    def bounds(self, entries: Sequence[TierEntry], now_s: float) -> list[KeyBound]: ...


class IndexedLruEviction(LruEviction):
    """LRU with bounds: ``-last_use_s`` only falls as entries are used, so the key at
    indexing time bounds it for ever (no expiry, no invalidation needed)."""

    def bounds(self, entries: Sequence[TierEntry], now_s: float) -> list[KeyBound]:
        return [KeyBound(-INF, -e.last_use_s, INF) for e in entries]


class PredictedUseEviction:
    """Furthest predicted next use first (Belady's rule when the predictor is exact).

    ``next_use`` maps sessions to their predicted next-use times (``inf`` = never), in one
    call for all candidates (a learned predictor answers a batch much faster); ``now_s``
    is one time for all or one per session.

    Bounds: a predicted next use is non-decreasing in time between the session's events,
    so its value at ``now + w`` bounds it until then. The window ``w`` grows with how far
    the next use is (``window_fraction`` of it, between ``min_window_s`` and
    ``max_window_s``): far keys are rarely near the victims' cut and need refreshing
    seldom; near ones get tight bounds. Where the key climbs steeply (a session that just
    finished: its conditioned median can rise seven seconds per second of silence), a
    bound over the whole window is loose, and every decision then computes the exact key
    of every such entry; so the window is halved, at most ``max_halvings`` times, for
    each entry whose bound exceeds its key by more than ``slack_fraction`` of the key's
    distance from now plus ``min_slack_s``. ``min_window_s`` only keeps a key due about
    now from being re-bounded at every decision; it is small, because sessions that return
    within a second or two need windows well under a second for their bounds to be
    tight.
    """

    def __init__(self, next_use: Callable[[Sequence[str], float | Sequence[float]],
                                          list[float]], *,
                 min_window_s: float = 0.05, max_window_s: float = 600.0,
                 window_fraction: float = 0.05, slack_fraction: float = 0.1,
                 min_slack_s: float = 0.05, max_halvings: int = 2,
                 next_use_one: Callable[[str, float], float] | None = None) -> None:
        self._next_use = next_use
        #: ``next_use`` of one session at one time, when the caller has a faster one (the
        #: index asks one exact key at a time, many per decision).
        self._next_use_one = next_use_one
        self.min_window_s = min_window_s
        self.max_window_s = max_window_s
        self.window_fraction = window_fraction
        self.slack_fraction = slack_fraction
        self.min_slack_s = min_slack_s
        self.max_halvings = max_halvings

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return self._next_use([e.key for e in entries], now_s)

    def exact_key(self, entry: TierEntry, now_s: float) -> float:
        """``keys([entry], now_s)[0]``."""
        one = self._next_use_one
        return self._next_use([entry.key], now_s)[0] if one is None else one(entry.key, now_s)

    def bounds(self, entries: Sequence[TierEntry], now_s: float) -> list[KeyBound]:
        if not entries:
            return []
        sids = [e.key for e in entries]
        now_keys = self._next_use(sids, now_s)
        untils = [now_s + min(self.max_window_s,
                              max(self.min_window_s, self.window_fraction * (k - now_s)))
                  for k in now_keys]
        uppers = self._next_use(sids, untils)
        for _ in range(self.max_halvings):
            loose = [i for i, (k, u) in enumerate(zip(now_keys, uppers, strict=True))
                     if u - k > self.slack_fraction * (k - now_s) + self.min_slack_s]
            if not loose:
                break
            for i in loose:
                untils[i] = now_s + 0.5 * (untils[i] - now_s)
            tighter = self._next_use([sids[i] for i in loose], [untils[i] for i in loose])
            for i, u in zip(loose, tighter, strict=True):
                uppers[i] = u
        return [KeyBound(k, max(k, u), t)
                for k, u, t in zip(now_keys, uppers, untils, strict=True)]


@dataclass(slots=True)
class IndexStats:
    """Work of an :class:`IndexedTier` (cumulative)."""

    #: Victim decisions that needed evictions (answered from the index).
    decisions: int = 0
    #: Bounds computed (entries indexed, expired or invalidated).
    bounds: int = 0
    #: Exact keys computed at decisions.
    exact_keys: int = 0
    #: Exact keys found above their bound (the key moved without an event of its session).
    bound_misses: int = 0
    #: Decisions refused from the bounds alone (no exact key computed).
    rejected: int = 0


class IndexedTier(Tier):
    """A :class:`Tier` whose victims come from an index of key bounds (see the module
    docstring) when its strategy is a :class:`BoundedStrategy`, from a full sort otherwise
    (and when a decision overrides the strategy with another one).

    ``holders`` (shared by a fleet's tiers) maps each key to the tiers that hold it, so
    that an event of a session reaches only the tiers it is in.
    """

    def __init__(self, name: str, capacity_bytes: int, strategy: EvictionStrategy, *,
                 holders: dict[str, set[IndexedTier]] | None = None) -> None:
        super().__init__(name, capacity_bytes, strategy)
        self._bounded: BoundedStrategy | None = (
            strategy if isinstance(strategy, BoundedStrategy) else None)
        #: one entry's exact key: the strategy's own way when it has one
        self._key_of: Callable[[TierEntry, float], float] = getattr(
            strategy, "exact_key", lambda e, now_s: strategy.keys([e], now_s)[0])
        self._holders = holders if holders is not None else {}
        #: key -> (sequence number, its current bound)
        self._bounds: dict[str, tuple[int, KeyBound]] = {}
        #: (-upper, key, seq): the largest bound on top; stale records skipped lazily
        self._heap: list[tuple[float, str, int]] = []
        #: (until_s, key, seq): the first bound to expire on top
        self._expiry: list[tuple[float, str, int]] = []
        #: keys with no current bound (new, invalidated)
        self._dirty: set[str] = set()
        #: key -> a lower bound of its key, as long as its bound is current: the key when
        #: it was bound, raised to every exact key computed since (keys only rise)
        self._lower: dict[str, float] = {}
        #: key -> its exact key at the time of the decision at hand (reset per decision)
        self._exact_now: dict[str, float] = {}
        self._seq = 0
        self.index_stats = IndexStats()

    # -- keeping the index -------------------------------------------------------------
    def put(self, entry: TierEntry) -> None:
        super().put(entry)
        self._holders.setdefault(entry.key, set()).add(self)
        self._unbind(entry.key)

    def remove(self, key: str) -> TierEntry | None:
        e = super().remove(key)
        if e is not None:
            self._bounds.pop(key, None)
            self._lower.pop(key, None)
            self._dirty.discard(key)
            held = self._holders.get(key)
            if held is not None:
                held.discard(self)
                if not held:
                    del self._holders[key]
        return e

    def invalidate(self, key: str) -> None:
        """The entry's key may have changed other than by the passage of time (an event of
        its session): re-bound it at the next decision."""
        if key in self._entries:
            self._unbind(key)

    def _unbind(self, key: str) -> None:
        if self._bounded is not None:
            self._bounds.pop(key, None)
            self._lower.pop(key, None)
            self._dirty.add(key)

    def _bind(self, now_s: float) -> None:
        """Bound every entry that is new, invalidated or whose bound expired."""
        assert self._bounded is not None
        due = self._dirty
        while self._expiry and self._expiry[0][0] < now_s:
            _, key, seq = heapq.heappop(self._expiry)
            cur = self._bounds.get(key)
            if cur is not None and cur[0] == seq:
                due.add(key)
        if not due:
            return
        keys = sorted(due)
        self._dirty = set()
        entries = [self._entries[k] for k in keys]
        for key, bound in zip(keys, self._bounded.bounds(entries, now_s), strict=True):
            self._seq += 1
            self._bounds[key] = (self._seq, bound)
            self._lower[key] = bound.now_key
            heapq.heappush(self._heap, (-bound.upper, key, self._seq))
            if bound.until_s < INF:
                heapq.heappush(self._expiry, (bound.until_s, key, self._seq))
        self.index_stats.bounds += len(keys)
        self._compact()

    def _compact(self) -> None:
        """Drop stale heap records once they outnumber the live ones."""
        live = len(self._bounds)
        if len(self._heap) > 2 * live + 64:
            self._heap = [r for r in self._heap if self._current(r[1], r[2])]
            heapq.heapify(self._heap)
        if len(self._expiry) > 2 * live + 64:
            self._expiry = [r for r in self._expiry if self._current(r[1], r[2])]
            heapq.heapify(self._expiry)

    def _current(self, key: str, seq: int) -> bool:
        cur = self._bounds.get(key)
        return cur is not None and cur[0] == seq

    # -- choosing victims --------------------------------------------------------------
    def victims_for(
        self,
        nbytes: int,
        now_s: float,
        *,
        exclude: str | None = None,
        min_key: float = -INF,
        strategy: EvictionStrategy | None = None,
    ) -> list[TierEntry] | None:
        """As :meth:`Tier.victims_for` (same victims, same order), from the index."""
        bounded = self._bounded
        if bounded is None or (strategy is not None and strategy is not bounded):
            return super().victims_for(nbytes, now_s, exclude=exclude, min_key=min_key,
                                       strategy=strategy)
        free = self.capacity_bytes - self.used_bytes
        if nbytes <= free:
            return []
        if nbytes > self.capacity_bytes:
            return None
        self.index_stats.decisions += 1
        misses = self.index_stats.bound_misses
        chosen = self._choose(nbytes - free, now_s, exclude, min_key)
        if self.index_stats.bound_misses != misses:
            # A key rose above its bound (a law shared with other sessions moved): the
            # order may be wrong. Re-bound every entry now and decide again (rare).
            for key in self._entries:
                self._unbind(key)
            chosen = self._choose(nbytes - free, now_s, exclude, min_key)
        return chosen

    def _choose(self, need: int, now_s: float, exclude: str | None, min_key: float
                ) -> list[TierEntry] | None:
        self._bind(now_s)
        self._exact_now = {}
        exact_keys = self.index_stats.exact_keys
        if not self._may_free(need, exclude, min_key, now_s):
            if self.index_stats.exact_keys == exact_keys:
                self.index_stats.rejected += 1
            return None
        chosen: list[TierEntry] = []
        gained = 0
        popped: list[tuple[float, str, int]] = []
        best = self._in_order(now_s, exclude, popped, min_key)
        try:
            for key, e in best:
                if gained >= need or key <= min_key:
                    break
                chosen.append(e)
                gained += e.nbytes
        finally:
            for rec in popped:  # still bound: back in the heap
                if self._current(rec[1], rec[2]):
                    heapq.heappush(self._heap, rec)
        return chosen if gained >= need else None

    def _exact_key(self, key: str, e: TierEntry, bound: KeyBound, now_s: float) -> float:
        """The entry's key at ``now_s`` (the decision's time), computed once per decision;
        it becomes the entry's lower bound. A key above its bound is a miss: the entry is
        re-bounded and the decision taken again (:meth:`victims_for`). A key below its
        lower bound (a shared law fell) only lowers it: like a rise above a bound, such a
        fall is seen only when that entry's key is computed (see the module doc)."""
        if bound.exact:
            return bound.now_key
        done = self._exact_now
        exact = done.get(key)
        if exact is not None:
            return exact
        exact = self._key_of(e, now_s)
        done[key] = exact
        self.index_stats.exact_keys += 1
        if exact > bound.upper:
            self.index_stats.bound_misses += 1
            self._unbind(key)
        else:
            self._lower[key] = exact
        return exact

    def _may_free(self, need: int, exclude: str | None, floor: float, now_s: float) -> bool:
        """Whether the evictable entries whose key is above ``floor`` hold ``need`` bytes:
        the question a decision answers first, and most answer no (the session that just
        finished is wanted sooner than the residents that could make room). Entries whose
        *bound* is at or below ``floor`` cannot count (an exact key is at most its bound);
        entries whose *lower* bound is above it do (keys only rise between events: the
        key when bound, or the last exact key computed, bounds it from below); exact keys
        are computed only for the entries in between, largest bound first, until the
        answer is certain. A walk of the heap from its top that skips every subtree at or
        below ``floor`` (a max-heap's children are no larger): the records above it, and
        their children."""
        heap = self._heap
        size = len(heap)
        stack = [0] if size else []
        sure = maybe = 0
        lower = self._lower
        unsure: list[tuple[float, str, TierEntry, KeyBound]] = []
        while stack:
            i = stack.pop()
            neg_upper, key, seq = heap[i]
            if -neg_upper <= floor:
                continue
            child = 2 * i + 1
            if child < size:
                stack.append(child)
                if child + 1 < size:
                    stack.append(child + 1)
            if key == exclude:
                continue
            cur = self._bounds.get(key)
            if cur is None or cur[0] != seq:
                continue
            e = self._entries[key]
            if e.pinned:
                continue
            maybe += e.nbytes
            if floor == -INF or lower[key] > floor:
                sure += e.nbytes
                if sure >= need:
                    return True
            else:
                unsure.append((neg_upper, key, e, cur[1]))
        if maybe < need:
            return False
        unsure.sort(key=lambda u: (u[0], u[1]))
        for _, key, e, bound in unsure:
            if self._exact_key(key, e, bound, now_s) > floor:
                sure += e.nbytes
                if sure >= need:
                    return True
            else:
                maybe -= e.nbytes
                if maybe < need:
                    return False
        return sure >= need

    def _in_order(self, now_s: float, exclude: str | None,
                  popped: list[tuple[float, str, int]], floor: float = -INF
                  ) -> Iterator[tuple[float, TierEntry]]:
        """Unpinned entries other than ``exclude`` with their exact keys, largest key
        first (ties by name), computing exact keys only for heap tops that could be next.
        Entries whose bound is at or below ``floor`` are not looked at (the caller stops
        at the first key there: none of them could come before it)."""
        assert self._bounded is not None
        heap = self._heap
        ready: list[tuple[float, str, TierEntry]] = []  # (-exact key, name, entry)
        while True:
            while heap:
                neg_upper, key, seq = heap[0]
                if -neg_upper <= floor:
                    break  # every key left is at or below the floor
                if ready and (-ready[0][0] > -neg_upper
                              or (-ready[0][0] == -neg_upper and ready[0][1] < key)):
                    break  # the best exact key beats every bound left
                heapq.heappop(heap)
                cur = self._bounds.get(key)
                if cur is None or cur[0] != seq:
                    continue
                popped.append((neg_upper, key, seq))
                e = self._entries[key]
                if e.pinned or key == exclude:
                    continue
                exact = self._exact_key(key, e, cur[1], now_s)
                heapq.heappush(ready, (-exact, key, e))
            if not ready:
                return
            neg, _, e = heapq.heappop(ready)
            yield -neg, e
