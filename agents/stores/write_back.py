"""Write-back from Valkey to S3: a bounded, journaled, observable upload backlog.

A store is acknowledged once Valkey holds the object; :class:`WriteBackQueue` then copies
it to S3 in the background, reading it back from Valkey (so the backlog holds names, not
payloads: its memory is the uploaders' batches, whatever the backlog's size).

Who calls what: the writer (an LMCache store task) calls :meth:`WriteBackQueue.admit`
before writing to Valkey -- it waits while the backlog is at ``max_backlog_bytes`` (the
back-pressure) -- then :meth:`WriteBackQueue.enqueue` with the keys Valkey accepted (or
:meth:`WriteBackQueue.release` for the bytes it did not write). Deletes call
:meth:`WriteBackQueue.forget`. ``upload_threads`` threads upload the oldest keys first.

Durability: each queued key is journaled in one Valkey hash (``journal_key``, field = key,
value = ``<enqueued unix time>:<payload bytes>``) in the same call that queues it, and
removed from it once S3 has the object. :meth:`WriteBackQueue.start` re-queues whatever the
journal holds, so a restart (or another process over the same Valkey) finishes the uploads
that a crash or a bounded :meth:`close` left. A queued key that Valkey no longer holds when
its upload starts (evicted or expired first) cannot be uploaded: it is counted as
``lost_keys`` and logged, never dropped silently. Uploads are idempotent (S3 may receive the
same object twice after a crash between its write and the journal update).

Order: one key is uploaded by one uploader at a time. A key stored again while its upload
runs waits for that upload, then is uploaded again from Valkey (the newest version); the
finished upload retires only the entry it took, so S3 never ends on an older version and
the newer entry stays queued and journaled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.stores.base import Buffer, ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.stores.valkey.store import ValkeyStore, translate_valkey_errors

log = logging.getLogger(__name__)
GIB = 1 << 30


class WriteBackConfig(BaseModel):
    """The write-back backlog: its bound, its uploaders, its journal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Back-pressure: a store waits while the backlog holds this many payload bytes (one
    #: store larger than the bound is admitted alone, into an empty backlog).
    max_backlog_bytes: int = Field(4 * GIB, ge=1)
    #: How long a store waits for room before it fails (counted ``rejected_full``).
    full_wait_s: float = Field(30.0, ge=0)
    #: Threads uploading to S3, and keys per upload batch (one Valkey read, one S3 put).
    upload_threads: int = Field(2, ge=1, le=64)
    batch_keys: int = Field(2, ge=1)
    #: Wait this long before retrying a batch that failed (S3 or Valkey unreachable).
    retry_s: float = Field(1.0, ge=0)
    #: ``close`` waits this long for the backlog to drain; what is left stays journaled and
    #: is re-queued by the next start.
    close_drain_s: float = Field(60.0, ge=0)
    #: Uploads yield to the engine's critical path: they wait while the adapter runs store,
    #: lookup or load tasks (and ``quiet_s`` after the last one ended), for at most
    #: ``max_defer_s`` from the oldest upload's store (then they run regardless), and never
    #: while a store waits for room or someone waits for the drain (``close`` included).
    yield_to_foreground: bool = True
    quiet_s: float = Field(0.25, ge=0)
    max_defer_s: float = Field(5.0, ge=0)
    #: The journal's Valkey key (after the Valkey section's ``key_prefix``). Processes that
    #: share it finish each other's uploads after a restart.
    journal_key: str = "wb:pending"


@dataclass(frozen=True, slots=True)
class WriteBackStats:
    """A snapshot of the backlog and its counters (``report_status`` shows it)."""

    pending_keys: int
    pending_bytes: int
    #: Age of the oldest upload not yet in S3 (0 when the backlog is empty).
    oldest_pending_age_s: float
    uploaded_keys: int
    uploaded_bytes: int
    #: Acknowledged keys Valkey lost before their upload (evicted or expired first).
    lost_keys: int
    #: Batches that failed and were retried.
    failed_batches: int
    requeued_on_start: int
    #: Stores that waited for room, and stores refused after ``full_wait_s``.
    full_waits: int
    rejected_full: int


@dataclass(slots=True)
class _Pending:
    size: int
    enqueued_at: float
    in_flight: bool = False


class WriteBackQueue:
    """Uploads keys from ``hot`` (Valkey) to ``cold`` (S3) in the background.

    Thread-safe. ``start`` reads the journal (I/O); ``close`` drains for up to
    ``close_drain_s`` and stops the uploaders; both are called once.
    """

    def __init__(self, hot: ValkeyStore, cold: ObjectStore, config: WriteBackConfig | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.hot = hot
        self.cold = cold
        self.config = config or WriteBackConfig()
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._pending_bytes = 0
        self._reserved = 0
        #: Keys deleted while their upload was in flight: deleted from S3 once it lands.
        self._forgotten: set[str] = set()
        #: The entry each running upload took, by key (a key is uploaded by one at a time).
        self._in_flight: dict[str, _Pending] = {}
        self._counters: dict[str, int] = dict.fromkeys(
            ("uploaded_keys", "uploaded_bytes", "lost_keys", "failed_batches",
             "requeued_on_start", "full_waits", "rejected_full"), 0)
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._active = 0
        self._waiting_for_room = 0
        self._draining = 0
        self._last_busy = -float("inf")

    @property
    def journal(self) -> str:
        return self.hot.config.key_prefix + self.config.journal_key

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> int:
        """Re-queue the journal's keys (oldest first) and start the uploaders; returns how
        many keys were re-queued."""
        requeued: list[tuple[str, _Pending]] = []
        try:
            with translate_valkey_errors("read the write-back journal"):
                for field, value in self.hot.client.hscan_iter(self.journal, count=1000):
                    name = field.decode() if isinstance(field, bytes) else str(field)
                    raw = value.decode() if isinstance(value, bytes) else str(value)
                    at, _, size = raw.partition(":")
                    requeued.append((name, _Pending(int(size or 0), float(at or 0))))
        except StoreError as exc:
            log.warning("write-back: journal unreadable, nothing re-queued: %s", exc)
        requeued.sort(key=lambda item: item[1].enqueued_at)
        with self._cond:
            for name, entry in requeued:
                if name not in self._pending:
                    self._pending[name] = entry
                    self._pending_bytes += entry.size
            self._counters["requeued_on_start"] += len(requeued)
        if requeued:
            log.info("write-back: re-queued %d pending uploads from the journal", len(requeued))
        for i in range(self.config.upload_threads):
            t = threading.Thread(target=self._run, name=f"write-back-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return len(requeued)

    def close(self) -> None:
        """Drain for up to ``close_drain_s``, then stop the uploaders (an upload in flight
        finishes). Keys left stay journaled."""
        drained = self.drain(self.config.close_drain_s)
        with self._cond:
            self._stopping = True
            left = len(self._pending)
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._threads.clear()
        if not drained:
            log.warning("write-back: %d uploads left in the journal at close; the next start "
                        "re-queues them", left)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until the backlog is empty; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._draining += 1  # whoever waits for the backlog: uploads stop yielding
            self._cond.notify_all()
            try:
                while self._pending and not self._stopping:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                return not self._pending
            finally:
                self._draining -= 1

    # -- the writer's side -------------------------------------------------------------------

    def admit(self, nbytes: int) -> bool:
        """Reserve room for ``nbytes`` of new uploads, waiting up to ``full_wait_s`` while
        the backlog is full. False (counted) when no room came: do not write."""
        bound = self.config.max_backlog_bytes
        with self._cond:
            def room() -> bool:
                used = self._pending_bytes + self._reserved
                return used == 0 or used + nbytes <= bound
            if not room():
                self._counters["full_waits"] += 1
                self._waiting_for_room += 1
                self._cond.notify_all()  # uploads stop yielding while a store waits
                try:
                    if not self._cond.wait_for(room, self.config.full_wait_s):
                        self._counters["rejected_full"] += 1
                        return False
                finally:
                    self._waiting_for_room -= 1
            self._reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back reserved bytes that were not written."""
        with self._cond:
            self._reserved = max(0, self._reserved - nbytes)
            self._cond.notify_all()

    def enqueue(self, items: Sequence[tuple[str, int]], reserved: int) -> None:
        """Journal and queue ``(key, payload bytes)`` that Valkey now holds; ``reserved`` is
        what :meth:`admit` granted for them (the rest is released). Raises
        :class:`StoreError` when the journal cannot be written: the caller must not
        acknowledge those keys."""
        now = self._clock()
        if items:
            with translate_valkey_errors("journal write-back"):
                self.hot.client.hset(self.journal,
                                     mapping={name: f"{now:.3f}:{size}" for name, size in items})
        with self._cond:
            self._reserved = max(0, self._reserved - reserved)
            for name, size in items:
                self._forgotten.discard(name)
                old = self._pending.pop(name, None)
                if old is not None:
                    self._pending_bytes -= old.size
                self._pending[name] = _Pending(size, now)
                self._pending_bytes += size
            self._cond.notify_all()

    def forget(self, names: Sequence[str]) -> None:
        """The keys were deleted: drop their pending uploads (journal too)."""
        dropped = []
        with self._cond:
            for name in names:
                entry = self._pending.get(name)
                if entry is None:
                    continue
                if name in self._in_flight:
                    self._forgotten.add(name)
                    if entry.in_flight:
                        continue
                del self._pending[name]
                self._pending_bytes -= entry.size
                dropped.append(name)
            self._cond.notify_all()
        self._unjournal(dropped)

    def pending_names(self) -> list[str]:
        with self._cond:
            return list(self._pending)

    def pending_entries(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(key, payload bytes)`` of the queued uploads under ``prefix``, sorted by key."""
        with self._cond:
            return sorted((n, e.size) for n, e in self._pending.items() if n.startswith(prefix))

    def stats(self) -> WriteBackStats:
        with self._cond:
            oldest = next(iter(self._pending.values()), None)
            age = max(0.0, self._clock() - oldest.enqueued_at) if oldest is not None else 0.0
            return WriteBackStats(pending_keys=len(self._pending),
                                  pending_bytes=self._pending_bytes,
                                  oldest_pending_age_s=round(age, 3), **self._counters)

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """Around each store, lookup and load task: uploads wait meanwhile (see
        ``yield_to_foreground``)."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._last_busy = time.monotonic()
                self._cond.notify_all()

    # -- the uploaders -----------------------------------------------------------------------

    def _defer_for(self) -> float:
        """How long uploads should still wait for the foreground (0 = go). Under the lock."""
        c = self.config
        if (not c.yield_to_foreground or self._waiting_for_room or self._draining
                or not self._pending):
            return 0.0
        oldest = next(iter(self._pending.values()))
        budget = c.max_defer_s - (self._clock() - oldest.enqueued_at)
        if budget <= 0:
            return 0.0
        if self._active:
            return min(budget, max(c.quiet_s, 0.01))
        quiet_left = c.quiet_s - (time.monotonic() - self._last_busy)
        return min(budget, quiet_left) if quiet_left > 0 else 0.0

    def _take(self) -> list[str] | None:
        """The oldest keys not in flight (marked in flight); None when stopping."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                defer = self._defer_for()
                if defer > 0:
                    self._cond.wait(defer)
                    continue
                batch = []
                for name, entry in self._pending.items():
                    if not entry.in_flight and name not in self._in_flight:
                        entry.in_flight = True
                        self._in_flight[name] = entry
                        batch.append(name)
                        if len(batch) == self.config.batch_keys:
                            break
                if batch:
                    return batch
                self._cond.wait()

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                retry = self._upload(batch)
            except Exception:  # keep the uploader alive: log, count, retry
                log.exception("write-back: upload batch failed")
                retry = batch
            if retry:
                self._bump("failed_batches")
                with self._cond:
                    for name in retry:
                        entry = self._pending.get(name)
                        if entry is not None:
                            entry.in_flight = False
                        self._in_flight.pop(name, None)
                    self._cond.notify_all()
                    self._cond.wait(self.config.retry_s)  # woken early by close

    def _upload(self, batch: list[str]) -> list[str]:
        """Upload one batch; returns the keys to retry."""
        got = self.hot.get(batch)
        items: list[tuple[str, Buffer]] = []
        lost: list[str] = []
        retry: list[str] = []
        for r in got:
            if r.ok and r.data is not None:
                items.append((r.key, r.data))
            elif r.miss:
                lost.append(r.key)
            else:
                retry.append(r.key)
        done: list[str] = []
        if items:
            for a in self.cold.put(items):
                (done if a.ok else retry).append(a.key)
        sizes = {r.key: r.payload_bytes for r in got}
        deleted = []
        retired = []
        with self._cond:
            for name in done + lost:
                taken = self._in_flight.pop(name, None)
                entry = self._pending.get(name)
                if entry is not None and entry is taken:
                    del self._pending[name]
                    self._pending_bytes -= entry.size
                    retired.append(name)
                # else: stored again meanwhile; that entry stays queued (and journaled)
                if name in self._forgotten:
                    self._forgotten.discard(name)
                    deleted.append(name)
            really_lost = [n for n in lost if n not in deleted and n in retired]
            self._counters["uploaded_keys"] += len(done)
            self._counters["uploaded_bytes"] += sum(sizes[n] for n in done)
            self._counters["lost_keys"] += len(really_lost)
            self._cond.notify_all()
        if really_lost:
            log.warning("write-back: %d acknowledged keys left Valkey before their upload "
                        "(evicted or expired), e.g. %r", len(really_lost), really_lost[0])
        if deleted:  # deleted while uploading: the upload must not resurrect them in S3
            self.cold.delete([n for n in deleted if n in done])
        self._unjournal(retired)
        return retry

    def _unjournal(self, names: Sequence[str]) -> None:
        if not names:
            return
        try:
            with translate_valkey_errors("journal write-back"):
                self.hot.client.hdel(self.journal, *names)
        except StoreError as exc:  # re-uploaded after a restart: harmless
            log.warning("write-back: journal not updated for %d keys: %s", len(names), exc)

    def _bump(self, counter: str) -> None:
        with self._cond:
            self._counters[counter] += 1


def journal_backlog(hot: Any, journal: str) -> tuple[int, int]:
    """``(keys, payload bytes)`` in a journal, read with a plain valkey-py client."""
    keys = size = 0
    for _field, value in hot.hscan_iter(journal, count=1000):
        raw = value.decode() if isinstance(value, bytes) else str(value)
        keys += 1
        size += int(raw.partition(":")[2] or 0)
    return keys, size


__all__ = ["WriteBackConfig", "WriteBackQueue", "WriteBackStats", "journal_backlog"]
