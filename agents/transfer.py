"""The transfer engine: moves lists of chunk keys from a store into a node-local tier.

Concurrency plan (tuned for time to last byte, not per-chunk latency): ``concurrency``
worker threads each move one chunk at a time, and each store fetches the parts of a chunk in
parallel on its own bounded pool (Valkey stripes, S3 ranges), so the link sees
``concurrency x parts`` requests in flight, capped by the store's connection count. Chunks
of all transfers are queued by (priority, submission order), so a more urgent prefetch
overtakes queued chunks of a less urgent one. A node-wide token bucket limits the bytes
written per second; cancellation stops queued chunks at once and in-flight ones between
parts, and a chunk that does not arrive whole is never published.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    ObjectStore,
    PayloadSink,
    PayloadWriter,
)
from kvprefetch.agents.stores.errors import CancelledError, StoreConfigError
from kvprefetch.agents.stores.format import ObjectHeader

log = logging.getLogger(__name__)
MIB = 1 << 20


class TransferConfig(BaseModel):
    """Engine knobs (one engine per node)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Chunks in flight at once (worker threads).
    concurrency: int = Field(4, ge=1, le=256)
    #: Node-wide cap on bytes moved per second (MiB/s); None = no cap.
    bandwidth_limit_mib_s: float | None = Field(None, gt=0)
    #: Bytes the bucket may hold: how far a burst may exceed the rate.
    burst_bytes: int = Field(4 * MIB, gt=0)
    #: Do not move chunks the local tier already holds.
    skip_present: bool = True


class TokenBucket:
    """Byte-rate limiter shared by all transfers of a node.

    ``acquire(n)`` takes ``n`` tokens, going into debt when there are too few, and sleeps
    until the debt is paid: over any interval the bytes let through stay within
    ``rate x interval + burst``, whatever the request sizes.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate_bytes_s
        self.burst = burst_bytes
        self._clock = clock
        self._tokens = float(burst_bytes)
        self._stamp = clock()
        self._lock = threading.Lock()

    def acquire(self, n: int, cancel: CancelToken | None = None) -> None:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            debt = -self._tokens
        if debt > 0:
            delay = debt / self.rate
            if cancel is not None:
                if cancel.wait(delay):
                    raise CancelledError(cancel.reason or "cancelled")
            else:
                time.sleep(delay)


@dataclass(frozen=True, slots=True)
class TransferProgress:
    """Handed to a progress callback after each chunk (from a worker thread)."""

    transfer_id: int
    keys_total: int
    keys_done: int
    bytes_done: int
    elapsed_s: float
    last_key: str
    last_ok: bool


@dataclass(frozen=True, slots=True)
class TransferResult:
    """The outcome of one transfer. ``ttlb_s`` runs from submission to the last byte of the
    last chunk published (queueing included); throughput is over the same interval."""

    transfer_id: int
    keys_total: int
    keys_moved: int
    keys_present: int
    keys_missed: int
    keys_failed: int
    bytes_moved: int
    ttlb_s: float
    cancelled: bool
    missed: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()

    @property
    def throughput_mib_s(self) -> float:
        return self.bytes_moved / MIB / self.ttlb_s if self.ttlb_s > 0 else 0.0

    @property
    def complete(self) -> bool:
        return self.keys_moved + self.keys_present == self.keys_total


class _ThrottledWriter:
    def __init__(self, inner: PayloadWriter, bucket: TokenBucket | None,
                 cancel: CancelToken, counted: Callable[[int], None]) -> None:
        self._inner = inner
        self._bucket = bucket
        self._cancel = cancel
        self._counted = counted

    def write_at(self, offset: int, data: Buffer) -> None:
        self._cancel.raise_if_cancelled()
        if self._bucket is not None:
            self._bucket.acquire(len(data), self._cancel)
        self._inner.write_at(offset, data)
        self._counted(len(data))

    def target(self, offset: int, length: int) -> memoryview | None:
        self._cancel.raise_if_cancelled()
        view = self._inner.target(offset, length)
        if view is not None and self._bucket is not None:
            self._bucket.acquire(length, self._cancel)  # before the bytes are fetched
        return view

    def written(self, offset: int, length: int) -> None:
        self._inner.written(offset, length)
        self._counted(length)

    def commit(self) -> None:
        self._cancel.raise_if_cancelled()
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class _ThrottledSink:
    def __init__(self, inner: PayloadSink, bucket: TokenBucket | None, cancel: CancelToken,
                 counted: Callable[[int], None]) -> None:
        self._inner = inner
        self._bucket = bucket
        self._cancel = cancel
        self._counted = counted

    def open(self, header: ObjectHeader) -> PayloadWriter:
        self._cancel.raise_if_cancelled()
        return _ThrottledWriter(self._inner.open(header), self._bucket, self._cancel,
                                self._counted)


@dataclass
class _Transfer:
    transfer_id: int
    keys: tuple[str, ...]
    priority: float
    on_progress: Callable[[TransferProgress], None] | None
    submitted_s: float
    cancel: CancelToken = field(default_factory=CancelToken)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done_event: threading.Event = field(default_factory=threading.Event)
    outstanding: int = 0
    moved: int = 0
    present: int = 0
    missed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    bytes_moved: int = 0
    bytes_written: int = 0
    last_s: float = 0.0
    result: TransferResult | None = None


class TransferHandle:
    """A submitted transfer: wait for it, watch it, or cancel it."""

    def __init__(self, transfer: _Transfer) -> None:
        self._t = transfer

    @property
    def transfer_id(self) -> int:
        return self._t.transfer_id

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the transfer: queued chunks are dropped, in-flight ones stop between parts;
        no partially fetched chunk is published. Idempotent."""
        self._t.cancel.cancel(reason)

    def done(self) -> bool:
        return self._t.done_event.is_set()

    def result(self, timeout_s: float | None = None) -> TransferResult:
        if not self._t.done_event.wait(timeout_s):
            raise TimeoutError(f"transfer {self._t.transfer_id} still running")
        assert self._t.result is not None
        return self._t.result

    @property
    def bytes_written(self) -> int:
        """Payload bytes written so far (chunks in flight included)."""
        return self._t.bytes_written


class TransferEngine:
    """Moves chunk keys from ``source`` into ``target`` (see the module docstring).

    ``submit`` is called by the agent once per prefetch order (a few per second per node at
    most); progress callbacks run on worker threads after each chunk and must be quick.
    """

    def __init__(
        self,
        source: ObjectStore,
        target: PayloadSink,
        config: TransferConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        name: str = "engine",
    ) -> None:
        self.source = source
        self.target = target
        self.config = config or TransferConfig()
        self.name = name
        self._clock = clock
        limit = self.config.bandwidth_limit_mib_s
        self._bucket = (
            TokenBucket(limit * MIB, self.config.burst_bytes, clock) if limit else None
        )
        self._queue: list[tuple[float, int, str, _Transfer]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._workers: list[threading.Thread] = []
        self._closing = False
        self._active: set[int] = set()
        self._transfers: dict[int, _Transfer] = {}

    def start(self) -> None:
        if self._workers:
            return
        self._closing = False
        for i in range(self.config.concurrency):
            t = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def close(self) -> None:
        """Cancel every transfer and stop the workers (idempotent)."""
        with self._cv:
            self._closing = True
            transfers = list(self._transfers.values())
            self._cv.notify_all()
        for t in transfers:
            t.cancel.cancel("engine closed")
        for w in self._workers:
            w.join()
        self._workers = []
        for t in transfers:
            self._drain_cancelled(t)

    def __enter__(self) -> TransferEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        keys: Sequence[str],
        *,
        priority: float = 0.0,
        on_progress: Callable[[TransferProgress], None] | None = None,
    ) -> TransferHandle:
        """Queue ``keys`` (higher ``priority`` first; FIFO within a priority)."""
        if not self._workers:
            raise StoreConfigError(f"engine {self.name!r} is not started")
        t = _Transfer(next(self._ids), tuple(keys), priority, on_progress, self._clock())
        todo = list(t.keys)
        if self.config.skip_present and todo and hasattr(self.target, "exists"):
            present = {r.key for r in self.target.exists(todo) if r.ok}
            t.present = sum(1 for k in todo if k in present)
            todo = [k for k in todo if k not in present]
        t.outstanding = len(todo)
        handle = TransferHandle(t)
        if not todo:
            self._finish(t)
            return handle
        with self._cv:
            self._transfers[t.transfer_id] = t
            for k in todo:
                heapq.heappush(self._queue, (-priority, next(self._seq), k, t))
            self._cv.notify_all()
        return handle

    def transfer(
        self,
        keys: Sequence[str],
        *,
        priority: float = 0.0,
        on_progress: Callable[[TransferProgress], None] | None = None,
        timeout_s: float | None = None,
    ) -> TransferResult:
        """Submit and wait."""
        return self.submit(keys, priority=priority, on_progress=on_progress).result(timeout_s)

    # -- workers -----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                _, _, key, t = heapq.heappop(self._queue)
            try:
                self._move(t, key)
            except Exception:  # never let a worker die
                log.exception("%s: unexpected error moving %r", self.name, key)
                self._record(t, key, ok=False, error="internal error", nbytes=0)

    def _move(self, t: _Transfer, key: str) -> None:
        if t.cancel.cancelled:
            self._record(t, key, ok=False, error="cancelled", nbytes=0)
            return

        def counted(n: int) -> None:
            with t.lock:
                t.bytes_written += n

        sink = _ThrottledSink(self.target, self._bucket, t.cancel, counted)
        try:
            result = self.source.get([key], sink=sink, cancel=t.cancel)[0]
        except CancelledError:
            self._record(t, key, ok=False, error="cancelled", nbytes=0)
            return
        if result.ok:
            self._record(t, key, ok=True, error="", nbytes=result.payload_bytes)
        elif isinstance(result.error, CancelledError):
            self._record(t, key, ok=False, error="cancelled", nbytes=0)
        else:
            err = result.error
            self._record(t, key, ok=False, error=f"{type(err).__name__}: {err}",
                         nbytes=0, miss=bool(err and err.is_miss))

    def _record(self, t: _Transfer, key: str, *, ok: bool, error: str, nbytes: int,
                miss: bool = False) -> None:
        now = self._clock()
        with t.lock:
            if ok:
                t.moved += 1
                t.bytes_moved += nbytes
                t.last_s = now
            elif error == "cancelled":
                pass
            elif miss:
                t.missed.append(key)
            else:
                t.failed.append((key, error))
            t.outstanding -= 1
            finished = t.outstanding == 0
            progress = TransferProgress(
                t.transfer_id, len(t.keys), t.moved + t.present + len(t.missed) + len(t.failed),
                t.bytes_moved, now - t.submitted_s, key, ok,
            )
        if t.on_progress is not None:
            try:
                t.on_progress(progress)
            except Exception:
                log.exception("%s: progress callback failed", self.name)
        if finished:
            self._finish(t)

    def _finish(self, t: _Transfer) -> None:
        with t.lock:
            if t.result is not None:
                return
            end = t.last_s or self._clock()
            t.result = TransferResult(
                transfer_id=t.transfer_id,
                keys_total=len(t.keys),
                keys_moved=t.moved,
                keys_present=t.present,
                keys_missed=len(t.missed),
                keys_failed=len(t.failed),
                bytes_moved=t.bytes_moved,
                ttlb_s=max(end - t.submitted_s, 0.0) if t.moved else 0.0,
                cancelled=t.cancel.cancelled,
                missed=tuple(t.missed),
                failed=tuple(t.failed),
            )
        with self._cv:
            self._transfers.pop(t.transfer_id, None)
        t.done_event.set()

    def _drain_cancelled(self, t: _Transfer) -> None:
        """After close: account for chunks that never left the queue."""
        with self._cv:
            mine = [item for item in self._queue if item[3] is t]
            self._queue = [item for item in self._queue if item[3] is not t]
            heapq.heapify(self._queue)
        for _, _, key, _ in mine:
            self._record(t, key, ok=False, error="cancelled", nbytes=0)

