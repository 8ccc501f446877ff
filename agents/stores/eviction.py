"""Eviction policies of the node-local tiers: tiny classes that return a sort key.

A local tier that must make room sorts its evictable entries by the policy's key and evicts
from the smallest key up. Policies are pure (no I/O) and called under the tier's lock, once
per entry each time an admission overflows the tier's capacity.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TierEntry:
    """What a policy may know about one object in a local tier (times on the tier's clock)."""

    key: str
    size_bytes: int
    created_s: float
    last_access_s: float


class EvictionPolicy(Protocol):
    """Orders a tier's entries for eviction: the smallest ``sort_key`` goes first.

    Called by :class:`~agents.stores.local.LocalTier` under its lock whenever it must make
    room; must be cheap, pure and thread-safe.
    """

    name: str

    def sort_key(self, entry: TierEntry, now_s: float) -> tuple[float, ...]: ...


class LruPolicy:
    """Least recently used first."""

    name = "lru"

    def sort_key(self, entry: TierEntry, now_s: float) -> tuple[float, ...]:
        return (entry.last_access_s,)


class PredictedNextUsePolicy:
    """The scheduler's advice: evict the entry whose predicted next use is furthest away.

    Advice is a time on the tier's clock (the same clock as ``now_s``) at which the key is
    expected to be needed again; keys without advice are treated as never needed again and go
    first (least recently used first among them). A prediction already in the past is kept
    as-is: the session is overdue, so its data is the most urgent to keep.

    Advice comes from :meth:`advise` (the agent forwards the scheduler's evict-advice) or from
    an ``advice`` callable consulted at eviction time.
    """

    name = "predicted"

    def __init__(self, advice: Callable[[str], float | None] | None = None) -> None:
        self._lookup = advice
        self._advice: dict[str, float] = {}
        self._lock = threading.Lock()

    def advise(self, next_use_s: Mapping[str, float]) -> None:
        """Record predicted next-use times (idempotent; later advice replaces earlier)."""
        with self._lock:
            self._advice.update(next_use_s)

    def forget(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self._advice.pop(k, None)

    def next_use_s(self, key: str) -> float | None:
        with self._lock:
            known = self._advice.get(key)
        if known is None and self._lookup is not None:
            known = self._lookup(key)
        return known

    def sort_key(self, entry: TierEntry, now_s: float) -> tuple[float, ...]:
        when = self.next_use_s(entry.key)
        return (-(math.inf if when is None else when), entry.last_access_s)


def make_policy(name: str) -> EvictionPolicy:
    """A policy by name: ``lru`` or ``predicted``."""
    if name == "lru":
        return LruPolicy()
    if name == "predicted":
        return PredictedNextUsePolicy()
    from agents.stores.errors import StoreConfigError

    raise StoreConfigError(f"unknown eviction policy {name!r}; known: lru, predicted")
