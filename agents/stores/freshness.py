"""Which tier copies may be older than the last acknowledged write, per key.

A tiered store acknowledges a put once one tier has the new version. The other tier may
then still hold an older one: Valkey's, when a put or delete could not reach it (it is
invalidated once Valkey answers again); S3's, while a write-back upload is pending, when it
failed, or when S3 was down during a put. :class:`StaleCopies` records those keys so that
reads skip the stale copy until it is repaired. It is the store's own memory: it protects
the readers of this process, not those of another process sharing the servers.

Every mark carries a generation; a clear names the generation it saw before its repair
started, so a clear never removes a mark made meanwhile (by a newer failed write).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Literal

Tier = Literal["hot", "cold"]


class StaleCopies:
    """Bounded sets of keys whose hot or cold copy may be stale. Thread-safe.

    Called by :class:`~kvprefetch.agents.stores.tiered.TieredStore` on every read (two
    emptiness checks when nothing is stale), on every put and delete, and by its
    background uploads. ``max_keys`` bounds each tier's set: :meth:`room` tells a writer
    whether it may leave that many more stale copies behind.
    """

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._gen = itertools.count(1)
        self._last = 0
        self._keys: dict[Tier, dict[str, int]] = {"hot": {}, "cold": {}}

    def generation(self) -> int:
        """The newest generation handed out so far (a clear up to it keeps later marks)."""
        with self._lock:
            return self._last

    def any(self, tier: Tier) -> bool:
        return bool(self._keys[tier])  # a dict's truth is atomic under the GIL

    def count(self, tier: Tier) -> int:
        with self._lock:
            return len(self._keys[tier])

    def room(self, tier: Tier, n: int) -> bool:
        with self._lock:
            return len(self._keys[tier]) + n <= self.max_keys

    def mark(self, tier: Tier, keys: Iterable[str]) -> None:
        with self._lock:
            marks = self._keys[tier]
            for key in keys:
                self._last = next(self._gen)
                marks[key] = self._last

    def clear(self, tier: Tier, keys: Iterable[str], upto: int) -> None:
        """Forget the marks of ``keys`` made at or before generation ``upto``."""
        with self._lock:
            marks = self._keys[tier]
            for key in keys:
                gen = marks.get(key)
                if gen is not None and gen <= upto:
                    del marks[key]

    def of(self, tier: Tier, keys: Sequence[str]) -> set[str]:
        """Those of ``keys`` marked stale in ``tier``."""
        if not self._keys[tier]:
            return set()
        with self._lock:
            marks = self._keys[tier]
            return {k for k in keys if k in marks}

    def keys(self, tier: Tier) -> list[str]:
        with self._lock:
            return list(self._keys[tier])


__all__ = ["StaleCopies"]
