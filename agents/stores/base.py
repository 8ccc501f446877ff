"""The batched store protocol, its per-key result records, payload sinks and cancellation.

Every store (Valkey, S3, tiered, the node-local tiers, the in-memory test double) answers
the same four batched calls, per key, in the order of the keys given. A miss is an answer
(``GetResult.error`` is a miss error), not an exception; exceptions are kept for misuse
(bad config, a key over the size limit on ``put``) and for a store that was never started.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, Self, TypeVar, runtime_checkable

from kvprefetch.agents.stores.errors import CancelledError, StoreError
from kvprefetch.agents.stores.format import ObjectHeader

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")
X = TypeVar("X")


class CancelToken:
    """A cancellation flag shared by a caller and the threads working for it.

    Cheap to check; stores check it between parts, so a cancelled transfer stops after the
    parts already on the wire (bounded by the store's timeouts).
    """

    __slots__ = ("_event", "reason")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def cancel(self, reason: str = "cancelled") -> None:
        self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def raise_if_cancelled(self) -> None:
        if self._event.is_set():
            raise CancelledError(self.reason or "cancelled")

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True as soon as the token is cancelled."""
        return self._event.wait(timeout_s)


def check_cancel(cancel: CancelToken | None) -> None:
    if cancel is not None:
        cancel.raise_if_cancelled()


@dataclass(frozen=True, slots=True)
class GetResult:
    """The answer for one key of a batched ``get``.

    ``data`` holds the payload when the caller did not pass a sink; with a sink the payload
    went there and ``data`` is None. ``error`` is None on a hit.
    """

    key: str
    header: ObjectHeader | None = None
    data: memoryview | None = None
    error: StoreError | None = None
    #: Which tier served a hit ("valkey", "s3", "dram", ...), for tiered stores and stats.
    source: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def miss(self) -> bool:
        return self.error is not None and self.error.is_miss

    @property
    def payload_bytes(self) -> int:
        return self.header.payload_bytes if self.header is not None else 0


@dataclass(frozen=True, slots=True)
class OpResult:
    """The answer for one key of a batched ``exists``, ``put`` or ``delete``.

    ``ok`` means: present (exists), stored (put), was there and is gone (delete).
    ``pinned`` (a tiered store's put): acknowledged while only Valkey holds the value, kept
    there without expiry and confirmed durable until S3 has it.
    """

    key: str
    ok: bool
    error: StoreError | None = None
    pinned: bool = False


class PayloadWriter(Protocol):
    """Where one object's payload is written while it is fetched.

    Called by a store's fetching threads: ``write_at`` once per part, possibly from several
    threads at once for disjoint ranges; then exactly one of ``commit`` (every part arrived and
    verified) or ``abort`` (anything failed, or cancellation). Nothing is visible before
    ``commit``.
    """

    def write_at(self, offset: int, data: Buffer) -> None: ...

    def target(self, offset: int, length: int) -> memoryview | None:
        """A writable view of the destination of payload ``[offset, offset+length)`` for a
        store that can receive straight into it (no intermediate copy), or None. The store
        fills it, verifies it, then calls :meth:`written`."""
        ...

    def written(self, offset: int, length: int) -> None:
        """The range returned by :meth:`target` has been filled and verified."""
        ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class PayloadSink(Protocol):
    """Opens a :class:`PayloadWriter` per object; called once per key that hits, as soon as
    the store knows the object's header (before any payload byte is written)."""

    def open(self, header: ObjectHeader) -> PayloadWriter: ...


class MemoryWriter:
    """A writer into a preallocated bytearray (the default sink of ``get``)."""

    __slots__ = ("buffer", "committed", "header")

    def __init__(self, header: ObjectHeader) -> None:
        self.header = header
        self.buffer = bytearray(header.payload_bytes)
        self.committed = False

    def write_at(self, offset: int, data: Buffer) -> None:
        n = len(data)
        memoryview(self.buffer)[offset : offset + n] = data

    def target(self, offset: int, length: int) -> memoryview | None:
        return memoryview(self.buffer)[offset : offset + length]

    def written(self, offset: int, length: int) -> None:
        return None

    def commit(self) -> None:
        self.committed = True

    def abort(self) -> None:
        self.buffer = bytearray()


class MemorySink:
    """Collects payloads in memory; ``get`` without a sink uses one per call."""

    def open(self, header: ObjectHeader) -> MemoryWriter:
        return MemoryWriter(header)


@runtime_checkable
class ObjectStore(Protocol):
    """A batched key-value store of encoded objects (see :mod:`kvprefetch.agents.stores.format`).

    Called by the transfer engine (``get`` with a sink, one or a few keys per call, from
    several worker threads at once, as often as chunks move), by the tiered store (all four),
    by agents and LMCache adapters (``put`` after a request finishes, ``exists`` when
    planning) and by tests. Every method is thread-safe, takes many keys and answers per key
    in the order given. ``put`` and ``delete`` are idempotent. ``start`` does the I/O that
    constructors must not (connect, check credentials); ``close`` is idempotent.
    """

    name: str

    def start(self) -> None: ...

    def close(self) -> None: ...

    def exists(
        self, keys: Sequence[str], *, cancel: CancelToken | None = None
    ) -> list[OpResult]: ...

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]: ...

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
    ) -> list[OpResult]: ...

    def delete(
        self, keys: Sequence[str], *, cancel: CancelToken | None = None
    ) -> list[OpResult]: ...


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of one store since start (a snapshot)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    deletes: int = 0
    evictions: int = 0
    promotions: int = 0
    promotions_dropped: int = 0
    degraded_writes: int = 0


@dataclass
class StatsCounter:
    """Thread-safe mutable counters behind :class:`StoreStats`."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    values: dict[str, int] = field(default_factory=dict)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.values[name] = self.values.get(name, 0) + delta

    def snapshot(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self.values)

    def count_get(self, result: GetResult) -> GetResult:
        from kvprefetch.agents.stores.errors import CorruptObjectError

        if result.ok:
            self.add(hits=1, bytes_read=result.payload_bytes)
        elif isinstance(result.error, CorruptObjectError):
            self.add(corrupt=1, misses=1)
        elif result.miss:
            self.add(misses=1)
        else:
            self.add(errors=1)
        return result


class KeyPool:
    """Runs one function per key on a bounded thread pool, answering in key order.

    One key runs inline on the caller's thread (the engine already calls from many threads).
    """

    def __init__(self, threads: int, name: str) -> None:
        self._threads = threads
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
            return self._pool

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        return self._executor().submit(fn)

    def map(self, fn: Callable[[X], T], items: Sequence[X]) -> list[T]:
        if len(items) <= 1:
            return [fn(x) for x in items]
        pool = self._executor()
        return [f.result() for f in [pool.submit(fn, x) for x in items]]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class StoreLifecycle:
    """``with store:`` starts and closes a store; ``stats()`` snapshots its counters.
    Mixed into every store so that the four of them share one definition."""

    _stats: StatsCounter

    def start(self) -> object:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> StoreStats:
        return self._stats.snapshot()
