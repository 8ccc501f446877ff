"""One tier vocabulary: the entry record, the eviction-strategy contract, LRU and ``Tier``.

Shared by every tier the project models or runs: the scheduler core's books of each node's
DRAM tier, the simulator's and the engine emulator's HBM, and the agents' local tiers
(:mod:`kvprefetch.agents.stores.local`). An entry is one named object: a session's KV prefix in the
core's books (named by session id), one chunk in an agent's tier (named by chunk key).

Sort-key convention (the only one in the project): an eviction strategy returns one float
per entry, and the entry with the **largest** key is evicted first. A key reads as "how far
away the next use is": for predicted-use eviction it is the predicted next-use time itself
(``inf`` = never needed again, so first to go; Belady's rule when the prediction is exact),
for LRU it is ``-last_use_s``. Ties go in name order, so that runs are deterministic.

Pure (no I/O, no clock of its own): callers pass ``now_s`` on whatever clock they keep.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

INF = float("inf")


@dataclass(slots=True)
class TierEntry:
    """One object held by a tier. Mutable: the owner of the tier updates the times and pins
    in place (under its own lock where it has threads)."""

    #: The object's name in the tier: a session id in the core's books, a chunk key in an
    #: agent's tier.
    key: str
    #: Modelled tokens (the core's books; 0 where a tier holds bytes it does not model).
    tokens: int
    nbytes: int
    last_use_s: float
    #: When the bytes are usable; > now while a transfer into this entry is in flight.
    ready_at_s: float = 0.0
    pinned: int = 0
    #: Bytes of the entry (its suffix) that a prefetch brought and no request has read
    #: yet: counted as waste if they are evicted or cut, as used when a request reads
    #: the entry. The prefix a prefetch extended was not brought by it.
    prefetch_unused_bytes: int = 0

    @property
    def prefetched_unused(self) -> bool:
        """Holds bytes a prefetch brought that no request has read."""
        return self.prefetch_unused_bytes > 0

    @property
    def session_id(self) -> str:
        """The key, by the name the scheduler's books use (they key entries by session)."""
        return self.key


class EvictionStrategy(Protocol):
    """Eviction keys of ``entries`` at ``now_s``; the largest key goes first.

    Called by :meth:`Tier.victims_for` once per eviction decision with every candidate (so
    a strategy can batch its work, e.g. one predictor call for all candidates). Must be
    pure with respect to the tier: it may not add or remove entries.
    """

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]: ...


class LruEviction:
    """Least recently used first."""

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return [-e.last_use_s for e in entries]


class Tier:
    """A capacity-bounded set of entries, one per key. Never admits an entry past its
    capacity (an owner that lowers ``capacity_bytes`` under what it holds evicts to fit).

    Not thread-safe: an owner with threads holds its own lock around every call.
    """

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

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> TierEntry | None:
        return self._entries.get(key)

    def usable_tokens(self, key: str, now_s: float) -> int:
        e = self._entries.get(key)
        return e.tokens if e is not None and e.ready_at_s <= now_s else 0

    def remove(self, key: str) -> TierEntry | None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.used_bytes -= e.nbytes
        return e

    def clear(self) -> list[TierEntry]:
        """Drop every unpinned entry (a node restart or a cold-start test)."""
        dropped = [e for e in self._entries.values() if not e.pinned]
        for e in dropped:
            self.remove(e.key)
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
        the tier's own strategy for this decision. Removes nothing: the caller evicts.
        """
        strategy = strategy or self.strategy
        free = self.capacity_bytes - self.used_bytes
        if nbytes <= free:
            return []
        if nbytes > self.capacity_bytes:
            return None
        movable = [e for e in self._entries.values() if not e.pinned and e.key != exclude]
        candidates = list(zip(strategy.keys(movable, now_s), (e.key for e in movable),
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

    def trim(self, key: str, tokens: int, nbytes: int) -> int:
        """Cut an entry down to its first ``tokens`` tokens (``nbytes`` bytes; keeping the
        prefix is the caller's business, the tier only keeps the books). Returns the bytes
        freed (0 if there is no such entry or it is no larger)."""
        e = self._entries.get(key)
        if e is None or nbytes >= e.nbytes:
            return 0
        freed = e.nbytes - max(0, nbytes)
        e.tokens = min(e.tokens, max(0, tokens))
        e.nbytes -= freed
        self.used_bytes -= freed
        return freed

    def put(self, entry: TierEntry) -> None:
        """Insert or replace; the caller has made room (see :meth:`victims_for`)."""
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        if self.used_bytes + entry.nbytes > self.capacity_bytes:
            if old is not None:  # restore: the invariant must hold even on caller error
                self._entries[old.key] = old
                self.used_bytes += old.nbytes
            raise ValueError(
                f"tier {self.name}: {entry.nbytes} bytes do not fit "
                f"({self.used_bytes}/{self.capacity_bytes} used)"
            )
        self._entries[entry.key] = entry
        self.used_bytes += entry.nbytes
