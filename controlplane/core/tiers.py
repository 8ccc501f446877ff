"""Capacity accounting of one node-local tier (HBM or DRAM) and its eviction strategies.

The scheduler core keeps this view of every node's tiers: in the simulator it *is* the
tier; in the live service it mirrors what the agents report. An entry is one session's
KV prefix (``tokens`` long). Eviction strategies are tiny classes returning a sort key:
the entry with the **largest** key is evicted first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

INF = float("inf")


@dataclass(slots=True)
class TierEntry:
    session_id: str
    tokens: int
    nbytes: int
    last_use_s: float
    #: When the bytes are usable; > now while a transfer into this entry is in flight.
    ready_at_s: float = 0.0
    pinned: int = 0
    #: Filled by a prefetch and not yet read by a request (counts as waste if evicted).
    prefetched_unused: bool = False


class EvictionStrategy(Protocol):
    """Eviction keys of entries at ``now_s``; the largest key goes first. Called once per
    eviction decision with every candidate, so a strategy can batch its work."""

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]: ...


class LruEviction:
    """Least recently used first."""

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return [-e.last_use_s for e in entries]


class PredictedUseEviction:
    """Furthest predicted next use first (Belady's rule when the predictor is exact).

    ``next_use`` maps sessions to their predicted next-use times (``inf`` = never), in one
    call for all candidates (a learned predictor answers a batch much faster).
    """

    def __init__(self, next_use: Callable[[Sequence[str], float], list[float]]) -> None:
        self._next_use = next_use

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return self._next_use([e.session_id for e in entries], now_s)


class Tier:
    """A capacity-bounded set of session entries. Never holds more than its capacity."""

    def __init__(self, name: str, capacity_bytes: int, strategy: EvictionStrategy) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.strategy = strategy
        self.used_bytes = 0
        self._entries: dict[str, TierEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[TierEntry]:
        return iter(self._entries.values())

    def get(self, session_id: str) -> TierEntry | None:
        return self._entries.get(session_id)

    def usable_tokens(self, session_id: str, now_s: float) -> int:
        e = self._entries.get(session_id)
        return e.tokens if e is not None and e.ready_at_s <= now_s else 0

    def remove(self, session_id: str) -> TierEntry | None:
        e = self._entries.pop(session_id, None)
        if e is not None:
            self.used_bytes -= e.nbytes
        return e

    def clear(self) -> list[TierEntry]:
        """Drop every unpinned entry (a node restart or a cold-start test)."""
        dropped = [e for e in self._entries.values() if not e.pinned]
        for e in dropped:
            self.remove(e.session_id)
        return dropped

    def victims_for(
        self,
        nbytes: int,
        now_s: float,
        *,
        exclude: str | None = None,
        min_key: float = -INF,
        strategy: EvictionStrategy | None = None,
    ) -> list[TierEntry] | None:
        """Entries to evict so that ``nbytes`` more fit, or None if impossible.

        Only unpinned entries whose key is strictly above ``min_key`` may go (a prefetch
        must not evict data that is needed sooner than its own). ``strategy`` overrides
        the tier's own strategy for this decision.
        """
        strategy = strategy or self.strategy
        free = self.capacity_bytes - self.used_bytes
        if nbytes <= free:
            return []
        if nbytes > self.capacity_bytes:
            return None
        movable = [e for e in self._entries.values() if not e.pinned and e.session_id != exclude]
        candidates = list(zip(strategy.keys(movable, now_s), (e.session_id for e in movable),
                              movable, strict=True))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        chosen: list[TierEntry] = []
        for key, _, e in candidates:
            if free >= nbytes:
                break
            if key <= min_key:
                break
            chosen.append(e)
            free += e.nbytes
        return chosen if free >= nbytes else None

    def put(self, entry: TierEntry) -> None:
        """Insert or replace; the caller has made room (see :meth:`victims_for`)."""
        old = self._entries.pop(entry.session_id, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        if self.used_bytes + entry.nbytes > self.capacity_bytes:
            if old is not None:  # restore: the invariant must hold even on caller error
                self._entries[old.session_id] = old
                self.used_bytes += old.nbytes
            raise ValueError(
                f"tier {self.name}: {entry.nbytes} bytes do not fit "
                f"({self.used_bytes}/{self.capacity_bytes} used)"
            )
        self._entries[entry.session_id] = entry
        self.used_bytes += entry.nbytes
