"""What the L2 adapter believes Valkey and S3 hold: the index that answers lookups.

LMCache looks up every request's chunks before prefill, so a lookup must not wait for the
network per key. :class:`KeyIndex` holds the store names this adapter has seen stored,
loaded, or listed; the adapter adds to it on store and load, removes on delete and on a
load that found nothing, and reconciles it with full listings in the background.

It may be stale both ways: "present" for an object that left (evicted, deleted by another
process) -- the load then falls back from Valkey to S3 and, failing both, answers a miss for
that key and drops the entry; "absent" for an object another process stored -- the adapter
asks Valkey for those keys (one pipelined round trip per lookup) and the next listing adds
what lives only in S3.

Bounded: beyond ``max_keys`` the least recently confirmed entries are dropped (counted);
a dropped entry costs at most a Valkey round trip, or a recompute for an S3-only object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KeyIndexStats:
    keys: int
    #: Entries dropped to stay within ``max_keys``.
    evicted: int
    #: Completed reconciliations, and entries they added / removed.
    reconciles: int
    reconcile_added: int
    reconcile_removed: int
    #: Loads of keys the index called present that no tier had (the entry was dropped).
    stale_present: int


class KeyIndex:
    """A bounded set of store names with reconciliation. Thread-safe; no I/O."""

    def __init__(self, max_keys: int = 2_000_000) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be positive")
        self._max = max_keys
        self._lock = threading.Lock()
        #: name -> sequence number of its last confirmation (order = least recent first).
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._seq = 0
        #: Set while a listing runs: names removed since it began (a listing that saw them
        #: before they went must not bring them back).
        self._removed_during: set[str] | None = None
        self._counts = dict.fromkeys(
            ("evicted", "reconciles", "reconcile_added", "reconcile_removed",
             "stale_present"), 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def add(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                self._seq += 1
                self._entries[name] = self._seq
                self._entries.move_to_end(name)
            self._trim()

    def discard(self, names: Iterable[str], *, stale: bool = False) -> None:
        with self._lock:
            for name in names:
                if self._entries.pop(name, None) is not None and stale:
                    self._counts["stale_present"] += 1
                if self._removed_during is not None:
                    self._removed_during.add(name)

    def present(self, names: Sequence[str]) -> list[bool]:
        with self._lock:
            entries = self._entries
            return [name in entries for name in names]

    # -- reconciliation ----------------------------------------------------------------------

    def begin_reconcile(self) -> int:
        """Call before listing; returns the token for :meth:`finish_reconcile`."""
        with self._lock:
            self._removed_during = set()
            return self._seq

    def finish_reconcile(self, token: int, listed: Iterable[str]) -> None:
        """Make the index what the listing saw, except for what changed while it ran:
        entries confirmed after ``token`` stay, names removed since stay out."""
        with self._lock:
            removed = self._removed_during or set()
            self._removed_during = None
            seen = set(listed) - removed
            gone = [n for n, seq in self._entries.items() if seq <= token and n not in seen]
            for name in gone:
                del self._entries[name]
            added = 0
            for name in seen:
                if name not in self._entries:
                    self._seq += 1
                    self._entries[name] = self._seq
                    added += 1
            self._counts["reconciles"] += 1
            self._counts["reconcile_added"] += added
            self._counts["reconcile_removed"] += len(gone)
            self._trim()

    def abort_reconcile(self) -> None:
        with self._lock:
            self._removed_during = None

    def stats(self) -> KeyIndexStats:
        with self._lock:
            return KeyIndexStats(keys=len(self._entries), **self._counts)

    def _trim(self) -> None:
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
            self._counts["evicted"] += 1


__all__ = ["KeyIndex", "KeyIndexStats"]
