"""Eviction policies of the node-local tiers, in the project's one tier vocabulary.

A local tier keeps its objects as :class:`~kvprefetch.controlplane.base.tiers.TierEntry` records in
a
:class:`~kvprefetch.controlplane.base.tiers.Tier` and makes room with the policy's keys: one float
per entry, the **largest** key is evicted first (the convention of
:mod:`kvprefetch.controlplane.base.tiers`, shared with the scheduler's books).

A policy is an :class:`~kvprefetch.controlplane.base.tiers.EvictionStrategy` with a name and two
advice hooks. The tier calls ``keys`` under its lock each time an admission overflows its
capacity, and ``forget`` when objects leave it; the agent calls ``advise`` with what the
scheduler told it (see :class:`PredictedNextUsePolicy`). All are cheap, pure of I/O and
thread-safe.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvprefetch.controlplane.base.tiers import EvictionStrategy, LruEviction, TierEntry

__all__ = ["EvictionPolicy", "LruPolicy", "PredictedNextUsePolicy", "TierEntry",
           "make_policy"]

#: Advice kept at most (oldest dropped first): bounds what orders for keys that never land
#: leave behind. A tier of 32 MiB chunks would need 8 TiB to hold this many objects.
MAX_ADVICE = 1 << 18


class EvictionPolicy(EvictionStrategy, Protocol):
    """A local tier's eviction strategy, chosen by name (``LocalTierConfig.eviction``)."""

    name: str

    def advise(self, next_use_s: Mapping[str, float], *, now_s: float | None = None
               ) -> None:
        """Record the scheduler's predicted next use of keys (its clock; ``inf`` = never
        needed again). ``now_s``: the scheduler's present, when the caller knows it.
        Idempotent; later advice replaces earlier. Called by the agent per order and per
        evict advice."""
        ...

    def forget(self, keys: Iterable[str]) -> None:
        """The keys left the tier (deleted or evicted): drop their advice. Called by the
        tier under its lock."""
        ...


class LruPolicy(LruEviction):
    """Least recently used first; ignores the scheduler's advice."""

    name = "lru"

    def advise(self, next_use_s: Mapping[str, float], *, now_s: float | None = None
               ) -> None:
        return None

    def forget(self, keys: Iterable[str]) -> None:
        return None


class PredictedNextUsePolicy:
    """The scheduler's advice: evict the object whose predicted next use is furthest away.

    Advice is a time on the *scheduler's* clock (the agent records each order's
    ``deadline_s`` for the order's keys, and ``inf`` for keys the scheduler advised to
    evict that a running transfer kept). Advised times are only compared with each other,
    never with the tier's own clock. Eviction order, first to last:

    1. keys advised never to be needed again (``inf``), least recently used first;
    2. keys without advice (written by the engine, or whose advice is spent), least
       recently used first; they rank as if needed later than any advised key;
    3. advised keys, furthest predicted next use first.

    Advice is *spent* once the scheduler's clock has passed it: the agent passes the
    scheduler's present when it knows it (a demand load is needed at once, so its deadline
    is the scheduler's time of dispatch), and advice before that instant no longer protects
    its keys (as the core trusts a planned use only until it has passed). Without this,
    a key brought in for one visit would outrank every other key forever.
    """

    name = "predicted"

    def __init__(self, max_advice: int = MAX_ADVICE) -> None:
        self._advice: dict[str, float] = {}
        self._max_advice = max_advice
        #: The latest scheduler time known to have passed (-inf: none yet).
        self._scheduler_now_s = -math.inf
        self._lock = threading.Lock()

    def advise(self, next_use_s: Mapping[str, float], *, now_s: float | None = None
               ) -> None:
        with self._lock:
            if now_s is not None:
                self._scheduler_now_s = max(self._scheduler_now_s, now_s)
            for key, when in next_use_s.items():
                self._advice.pop(key, None)  # re-insert: the newest advice is kept longest
                self._advice[key] = when
            excess = len(self._advice) - self._max_advice
            if excess > 0:
                for key in list(self._advice)[:excess]:
                    del self._advice[key]

    def forget(self, keys: Iterable[str]) -> None:
        with self._lock:
            for k in keys:
                self._advice.pop(k, None)

    def next_use_s(self, key: str) -> float | None:
        """The key's live advice (scheduler's clock), or None when it has none or it is
        spent."""
        with self._lock:
            when = self._advice.get(key)
            return None if when is None or when < self._scheduler_now_s else when

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        """Ranks in the order above (the last to go gets 1.0): keys of one call compare
        with each other only, as advice and last uses are on different clocks."""
        def first_to_go(i: int) -> tuple[int, float, float]:
            when, last = advised[i], entries[i].last_use_s
            if when == math.inf:
                return (0, last, 0.0)
            if when is None:
                return (1, last, 0.0)
            return (2, -when, last)

        advised = [self.next_use_s(e.key) for e in entries]
        order = sorted(range(len(entries)), key=first_to_go)
        out = [0.0] * len(entries)
        for rank, i in enumerate(order):
            out[i] = float(len(entries) - rank)
        return out

def make_policy(name: str) -> EvictionPolicy:
    """A policy by name: ``lru`` or ``predicted``."""
    if name == "lru":
        return LruPolicy()
    if name == "predicted":
        return PredictedNextUsePolicy()
    from kvprefetch.agents.stores.errors import StoreConfigError

    raise StoreConfigError(f"unknown eviction policy {name!r}; known: lru, predicted")
