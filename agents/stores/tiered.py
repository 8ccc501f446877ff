"""Valkey in front of S3: read-through with promotion, write-through or write-back, and
graceful degradation when either tier is down.

A tier that fails with a connection error or a timeout is skipped for ``retry_down_after_s``
(a small circuit breaker), so that a dead server costs one failed request, not one per key:
reads with Valkey down go to S3 only (unless a put may be pinned, below: then they miss);
with S3 down, to Valkey only; both down → every key is a clean miss
(:class:`StoreUnavailableError`, ``is_miss``) and the engine recomputes. Puts follow the
consistency contract below. Nothing waits longer than the tiers' own connect and read
timeouts.

Repair: a copy that fails verification in one tier is rewritten from the other tier's copy
when that one verifies (in the background, counted in :meth:`TieredStore.repairs`). Hot
corrupt, cold good: the S3 copy read in its place is written back into Valkey. Cold corrupt
(S3 keeps it, quarantined): Valkey is read once more and, if it now serves the key, S3 is
rewritten from it. A tier with a ``repair`` method (:class:`RepairableStore`: both of ours)
replaces only the broken version, never one written meanwhile; others get a plain ``put``.

Consistency contract (the docs' operations page states it too; the tests check exactly
this). Any number of processes read and write through tiered stores over the same Valkey
and S3, each key written by one process at a time (writers of one key in several processes
write the same bytes, as content-addressed KV chunks do). (1) A put is acknowledged only
where the value is durable where every reader looks: in S3 and in Valkey (write-through),
or pinned in Valkey -- no expiry, a pending upload record beside it, fsynced to Valkey's
append-only file (``WAITAOF``, and ``pin_replicas`` replicas) -- until S3 has it
(write-back, and write-through with ``cold_down="pin"``; ``OpResult.pinned`` says so).
Otherwise the put is refused with a :class:`PutRefusedError` that says why: S3 did not take
it (:class:`ColdTierDownError`), Valkey could not be written or reached
(:class:`HotTierDownError`: a writer cut off from Valkey cannot invalidate the older copy
other processes read), or Valkey did not confirm the pin durable
(:class:`NotDurableError`). (2) A read, in any process, returns the newest acknowledged
value of the key, or the value of a later put that was refused (it may have reached a
tier), or a miss; never an older one. (3) Once both tiers answer and the writer's pending
uploads have run (:meth:`TieredStore.settle`, :meth:`TieredStore.flush`), a read returns
the newest acknowledged value, through S3 outages, Valkey restarts (that keep their
append-only file) and partitions of any process from either server: where puts may be
pinned (write-back, ``cold_down="pin"``), a process that cannot ask Valkey for the pending
upload records misses rather than read S3. Outside it: Valkey
losing its data (no append-only file, a lost disk), an ``allkeys-*`` eviction policy
(which may evict a pinned value), and puts of one key from two processes at once.

How: a read that misses Valkey takes a fill lease on the key (:class:`FillableStore`)
before it reads S3, and its promotion (or hot repair) lands only while that lease stands:
any put or delete of the key since cancels it, so a slow promotion never writes an old
version over, or after, a newer one. A hot tier without leases gets no promotions and no
hot repairs. A copy the writer knows to lag (a refused put that reached one tier, an
upload pending or failed) is recorded in
:class:`~kvprefetch.agents.stores.freshness.StaleCopies`, and this process's reads skip it
(Valkey's is deleted as soon as Valkey answers again). Other processes go by what is in
Valkey: a pinned put records its keys as pending uploads (``P w:<key>``,
:class:`~kvprefetch.agents.stores.tiered_uploads.PendingUploadStore`) *before* it writes
their values, and a read that misses Valkey checks the record before it reads S3 and
misses while it stands. The record of a key is removed, and the value given its TTL, only
after an upload of the newest value this process wrote has landed in S3
(:mod:`~kvprefetch.agents.stores.tiered_uploads`); an upload S3 refuses is tried again
once S3 is up, the value pinned meanwhile. A write-through put that goes to S3 while an
upload of the key is queued hands its payload to that upload, which could otherwise land
after it with the older value.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    GetResult,
    ObjectStore,
    OpResult,
    PayloadSink,
    PayloadWriter,
    StatsCounter,
    StoreLifecycle,
    check_cancel,
)
from kvprefetch.agents.stores.errors import (
    ColdTierDownError,
    CorruptObjectError,
    HotTierDownError,
    NotDurableError,
    ObjectNotFoundError,
    StoreConnectionError,
    StoreError,
    StoreUnavailableError,
)
from kvprefetch.agents.stores.format import ObjectHeader
from kvprefetch.agents.stores.freshness import StaleCopies
from kvprefetch.agents.stores.tiered_uploads import (
    PendingUploadStore,
    PinningStore,
    WriteBackUploads,
)

log = logging.getLogger(__name__)
_TIERS: tuple[Literal["hot", "cold"], ...] = ("hot", "cold")
#: Random bytes of a pending upload record's token (one per key per write-back put).
_RECORD_TOKEN_BYTES = 16


class TieredStoreConfig(BaseModel):
    """How the hot and cold tiers cooperate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``write-through``: a put returns once S3 (then Valkey) has it. ``write-back``: a put
    #: returns once Valkey holds it pinned and durable (see ``pin_replicas``); S3 is written
    #: in the background (``flush`` waits).
    write_mode: Literal["write-through", "write-back"] = "write-through"
    #: Write-through, a key S3 does not take (down, or the put failed): ``refuse`` the put
    #: (:class:`ColdTierDownError`), or ``pin`` it in Valkey, without expiry and confirmed
    #: durable, until S3 has it (acknowledged with ``pinned``).
    cold_down: Literal["refuse", "pin"] = "refuse"
    #: A pinned value is acknowledged once Valkey's append-only file has it fsynced and
    #: this many replicas too (``WAITAOF 1 pin_replicas``), within ``pin_timeout_s``;
    #: otherwise the put is refused (:class:`NotDurableError`). Valkey then needs
    #: ``appendonly yes``, and ``maxmemory-policy`` ``noeviction`` or ``volatile-*``;
    #: ``WAITAOF`` answers for one server, so pins are for a standalone Valkey (with its
    #: replicas), not a cluster.
    pin_replicas: int = Field(0, ge=0)
    pin_timeout_s: float = Field(1.0, gt=0)
    #: Copy objects read from S3 into Valkey (in the background).
    promote: bool = True
    #: TTL of objects written to or promoted into the hot tier.
    hot_ttl_s: float | None = Field(3600.0, gt=0)
    #: Skip a tier this long after it failed with a connection error or a timeout.
    retry_down_after_s: float = Field(2.0, ge=0)
    #: Background threads for promotions and write-backs; beyond ``max_pending`` queued
    #: promotions are dropped (write-backs never are).
    background_threads: int = Field(2, ge=1)
    max_pending: int = Field(64, ge=1)
    #: How long a read's fill lease holds: its promotion must land within this time.
    fill_lease_s: float = Field(10.0, gt=0)
    #: Keys per tier whose copy may lag the acknowledged version (see the module
    #: docstring); a put or delete that would leave more is refused before it writes.
    max_stale_keys: int = Field(1_000_000, ge=1)


@runtime_checkable
class RepairableStore(Protocol):
    """A tier that can replace a copy it found broken without touching a newer version.

    Called by :class:`TieredStore` from a background thread, once per broken copy found by
    a read, with the other tier's verified payload; not idempotent in effect (a second call
    after a successful one answers ``ok`` False and writes nothing).
    """

    def repair(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None
               ) -> list[OpResult]: ...


@runtime_checkable
class FillableStore(Protocol):
    """A hot tier whose read-through fills never land over a newer version.

    Called by :class:`TieredStore`: ``lease`` once per read that missed, for the keys it
    missed, before they are read from the cold tier; ``fill`` from a background thread,
    once per copy read from the cold tier under a lease. A put or delete of a key cancels
    the leases taken on it before; ``fill`` then answers ``ok`` False and writes nothing.
    """

    def lease(self, keys: Sequence[str], *, ttl_s: float) -> list[bytes | None]: ...

    def fill(self, items: Sequence[tuple[str, Buffer, bytes]], *, ttl_s: float | None = None
             ) -> list[OpResult]: ...


class _TeeWriter:
    def __init__(self, inner: PayloadWriter, header: ObjectHeader,
                 on_commit: Callable[[ObjectHeader, bytearray], None]) -> None:
        self._inner = inner
        self._header = header
        self._copy = bytearray(header.payload_bytes)
        self._on_commit = on_commit

    def write_at(self, offset: int, data: Buffer) -> None:
        self._inner.write_at(offset, data)
        memoryview(self._copy)[offset : offset + len(data)] = data

    def target(self, offset: int, length: int) -> memoryview | None:
        return None  # the payload must pass through write_at to be copied for promotion

    def written(self, offset: int, length: int) -> None:
        return None

    def commit(self) -> None:
        self._inner.commit()
        self._on_commit(self._header, self._copy)

    def abort(self) -> None:
        self._inner.abort()


class _TeeSink:
    """Passes a payload to the caller's sink and keeps a copy to promote into the hot tier."""

    def __init__(self, inner: PayloadSink,
                 on_commit: Callable[[ObjectHeader, bytearray], None],
                 wanted: Callable[[str], bool] = lambda key: True) -> None:
        self._inner = inner
        self._on_commit = on_commit
        self._wanted = wanted

    def open(self, header: ObjectHeader) -> PayloadWriter:
        if not self._wanted(header.key):
            return self._inner.open(header)
        return _TeeWriter(self._inner.open(header), header, self._on_commit)


class TieredStore(StoreLifecycle):
    """Valkey (``hot``) in front of S3 (``cold``); any two :class:`ObjectStore` work."""

    def __init__(self, hot: ObjectStore, cold: ObjectStore,
                 config: TieredStoreConfig | None = None, *, name: str = "tiered",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hot = hot
        self.cold = cold
        self.config = config or TieredStoreConfig()
        self.name = name
        self._clock = clock
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()
        self._stats = StatsCounter()
        self._repairs = {"hot": 0, "cold": 0}
        self._stale = StaleCopies(self.config.max_stale_keys)
        self._uploads = WriteBackUploads(
            name, hot, cold, self._stale,
            run=lambda task: self._background(task, droppable=False),
            cold_up=lambda: self._up(self.cold), observe=self._observe,
            hot_ttl_s=self.config.hot_ttl_s)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start both tiers. A tier that cannot be reached is marked down, not fatal (the
        store degrades); a configuration error (bad credentials) is raised."""
        for tier in (self.hot, self.cold):
            try:
                tier.start()
            except StoreConnectionError as exc:
                log.warning("%s: tier %s unreachable at start: %s", self.name, tier.name, exc)
                self._mark_down(tier)
        self._pool = ThreadPoolExecutor(self.config.background_threads,
                                        thread_name_prefix=f"{self.name}-bg")

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for pending promotions and write-backs."""
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout=timeout_s)

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.hot.close()
        self.cold.close()

    # -- health ------------------------------------------------------------------------------

    def _up(self, tier: ObjectStore) -> bool:
        with self._lock:
            return self._clock() >= self._down_until.get(tier.name, 0.0)

    def _mark_down(self, tier: ObjectStore) -> None:
        with self._lock:
            self._down_until[tier.name] = self._clock() + self.config.retry_down_after_s
        log.warning("%s: tier %s is down; skipping it for %.1f s", self.name, tier.name,
                    self.config.retry_down_after_s)

    def _observe(self, tier: ObjectStore, errors: Sequence[StoreError | None]) -> None:
        if any(isinstance(e, StoreConnectionError) for e in errors):
            self._mark_down(tier)

    def tier_up(self, which: Literal["hot", "cold"]) -> bool:
        return self._up(self.hot if which == "hot" else self.cold)

    # -- background --------------------------------------------------------------------------

    def _background(self, fn: Callable[[], None], *, droppable: bool) -> None:
        if self._pool is None:
            raise StoreError(f"store {self.name!r} is not started")
        with self._lock:
            if droppable and len(self._pending) >= self.config.max_pending:
                self._stats.add(promotions_dropped=1)
                return
            future = self._pool.submit(fn)
            self._pending.add(future)

        def done(f: Future[None]) -> None:
            with self._lock:
                self._pending.discard(f)
            if f.exception() is not None:
                log.warning("%s: background task failed: %s", self.name, f.exception())

        future.add_done_callback(done)

    def _fill(self, header: ObjectHeader, payload: Buffer, marker: bytes, *,
              repair: bool) -> None:
        """Copy an object read from the cold tier into the hot tier under the read's lease
        (a promotion, or the repair of a broken hot copy), in the background."""
        hot = self.hot
        assert isinstance(hot, FillableStore)

        def run() -> None:
            res = hot.fill([(header.key, payload, marker)], ttl_s=self.config.hot_ttl_s)
            self._observe(self.hot, [r.error for r in res])
            if not res[0].ok:
                return
            if repair:
                with self._lock:
                    self._repairs["hot"] += 1
                log.info("%s: %r repaired in %s from the other tier", self.name,
                         header.key, self.hot.name)
            else:
                self._stats.add(promotions=1)

        self._background(run, droppable=not repair)

    def stale_copies(self) -> dict[str, int]:
        """Keys whose hot or cold copy may lag the acknowledged version, per tier."""
        return {"hot": self._stale.count("hot"), "cold": self._stale.count("cold")}

    def settle(self) -> None:
        """Catch up with tiers that answer again: delete Valkey's stale copies, clear
        records and unpin values whose clear failed, start again the uploads S3 refused.
        Every read and put does this first; call it to catch up without either."""
        self._settle_hot()

    def _settle_hot(self) -> None:
        """Delete the Valkey copies that writes made while Valkey was unreachable left
        stale; each is trusted again once its delete is acknowledged. Clear the pending
        upload records (and unpin the values) that could not be cleared then; start again
        the uploads that failed while S3 was down."""
        uploads = self._uploads
        if uploads.uploads_waiting and self._up(self.cold):
            uploads.retry_uploads()
        if not (self._stale.any("hot") or uploads.clears_pending) or not self._up(self.hot):
            return
        uploads.retry_clears()
        if not self._stale.any("hot"):
            return
        upto = self._stale.generation()
        keys = self._stale.keys("hot")
        answers = self.hot.delete(keys)
        self._observe(self.hot, [a.error for a in answers])
        self._stale.clear("hot", [a.key for a in answers if a.error is None], upto)

    def repairs(self) -> dict[str, int]:
        """Broken copies rewritten from the other tier since start, per tier repaired."""
        with self._lock:
            return dict(self._repairs)

    def _repair(self, which: Literal["hot", "cold"], header: ObjectHeader,
                payload: Buffer) -> None:
        tier = self.hot if which == "hot" else self.cold
        ttl = self.config.hot_ttl_s if which == "hot" else None

        def run() -> None:
            items = [(header.key, payload)]
            if isinstance(tier, RepairableStore):
                res = tier.repair(items, ttl_s=ttl)
            else:
                res = tier.put(items, ttl_s=ttl)
            self._observe(tier, [r.error for r in res])
            if res[0].ok:
                with self._lock:
                    self._repairs[which] += 1
                log.info("%s: %r repaired in %s from the other tier", self.name,
                         header.key, tier.name)

        self._background(run, droppable=False)

    # -- ObjectStore -------------------------------------------------------------------------

    def exists(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        found: dict[str, OpResult] = {}
        for tier in (self.hot, self.cold):
            rest = [k for k in keys if not (k in found and found[k].ok)]
            if not rest or not self._up(tier):
                continue
            answers = tier.exists(rest, cancel=cancel)
            self._observe(tier, [a.error for a in answers])
            for a in answers:
                if a.ok or a.key not in found:
                    found[a.key] = a
        return [
            found.get(k) or OpResult(k, False, StoreUnavailableError("no tier is up"))
            for k in keys
        ]

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]:
        """Hot tier first; misses and hot-tier failures go to the cold tier; S3 hits are
        promoted into the hot tier in the background, under the fill lease the read took
        when it missed. A copy known to be stale is skipped (see the module docstring)."""
        check_cancel(cancel)
        self._settle_hot()
        results: dict[str, GetResult] = {}
        distrusted = self._stale.of("hot", keys)
        if self._up(self.hot):
            hot_keys = [k for k in keys if k not in distrusted] if distrusted else keys
            answers = self.hot.get(hot_keys, sink=sink, cancel=cancel) if hot_keys else []
            self._observe(self.hot, [a.error for a in answers])
            results.update((a.key, a) for a in answers)
        rest = [k for k in keys if k not in results or not results[k].ok]
        behind = self._stale.of("cold", rest) | self._pending_elsewhere(rest)
        rest = [k for k in rest if k not in behind] if behind else rest  # S3 is older: a miss
        if rest and self._up(self.cold):
            check_cancel(cancel)
            hot_broken = {k for k in rest
                          if k in results and isinstance(results[k].error, CorruptObjectError)}
            absent = [k for k in rest
                      if k in results and isinstance(results[k].error, ObjectNotFoundError)]
            markers = self._lease([*hot_broken, *absent] if self.config.promote
                                  else list(hot_broken))

            def cold_hit(header: ObjectHeader, payload: Buffer) -> None:
                marker = markers.get(header.key)
                if marker is not None:
                    self._fill(header, payload, marker, repair=header.key in hot_broken)

            cold_sink = sink
            if markers and sink is not None:
                cold_sink = _TeeSink(sink, cold_hit, markers.__contains__)
            answers = self.cold.get(rest, sink=cold_sink, cancel=cancel)
            self._observe(self.cold, [a.error for a in answers])
            for a in answers:
                prior = results.get(a.key)
                # Keep the more telling error: "not found" in S3 beats "Valkey down".
                if a.ok or prior is None or not isinstance(a.error, StoreConnectionError):
                    results[a.key] = a
                if a.ok and sink is None and a.data is not None and a.header:
                    cold_hit(a.header, a.data)
            self._repair_cold(
                [a.key for a in answers if isinstance(a.error, CorruptObjectError)],
                results, sink, cancel)
        out = []
        for k in keys:
            r = results.get(k)
            if r is None or (isinstance(r.error, StoreConnectionError) and not r.ok):
                cause = r.error if r is not None else None
                r = GetResult(k, error=StoreUnavailableError(
                    f"{k!r}: no tier could serve it ({cause or 'all tiers down'})"))
            out.append(self._stats.count_get(r))
        return out

    @property
    def _pins(self) -> bool:
        """Whether puts may leave a value pinned in Valkey that S3 lacks."""
        c = self.config
        return c.write_mode == "write-back" or c.cold_down == "pin"

    def _pending_elsewhere(self, keys: list[str]) -> set[str]:
        """Those of ``keys`` whose upload to S3 may be pending in any process, by the
        records in Valkey. When Valkey cannot tell (down, unreachable): every key where
        puts may be pinned, else none."""
        if not keys or not isinstance(self.hot, PendingUploadStore):
            return set()
        if not self._up(self.hot):
            return set(keys) if self._pins else set()
        try:
            return self.hot.pending_uploads(keys)
        except StoreError as exc:
            self._observe(self.hot, [exc])
            return set(keys) if self._pins else set()

    def _lease(self, keys: list[str]) -> dict[str, bytes]:
        """Fill leases on ``keys`` (answered absent or broken by the hot tier), taken before
        they are read from the cold tier; empty when the hot tier cannot fill."""
        if not keys or not isinstance(self.hot, FillableStore) or not self._up(self.hot):
            return {}
        taken = self.hot.lease(keys, ttl_s=self.config.fill_lease_s)
        return {k: m for k, m in zip(keys, taken, strict=True) if m is not None}

    def _repair_cold(self, broken: list[str], results: dict[str, GetResult],
                     sink: PayloadSink | None, cancel: CancelToken | None) -> None:
        """S3 answered ``broken`` corrupt: read them from Valkey once more (it may have
        missed a moment ago, during an overwrite); serve those it verifies and rewrite the
        S3 copies from them."""
        if not broken or not self._up(self.hot):
            return
        hot_sink = _TeeSink(sink, lambda h, p: self._repair("cold", h, p)) if sink else None
        answers = self.hot.get(broken, sink=hot_sink, cancel=cancel)
        self._observe(self.hot, [a.error for a in answers])
        for a in answers:
            if not a.ok:
                continue
            results[a.key] = a
            if sink is None and a.data is not None and a.header is not None:
                self._repair("cold", a.header, a.data)

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
    ) -> list[OpResult]:
        """Acknowledge each key only where the value is durable where every reader finds
        it (the consistency contract in the module docstring). Write-through: S3, then
        Valkey (``ttl_s``, else ``hot_ttl_s``); a key S3 did not take is refused
        (:class:`ColdTierDownError`) or, with ``cold_down="pin"``, pinned in Valkey until S3
        has it. Write-back: pinned in Valkey now, uploaded in the background (uploads of one
        key run one at a time, newest last). A key Valkey could not take is refused
        (:class:`HotTierDownError`), a pin Valkey did not confirm durable too
        (:class:`NotDurableError`); a pinned acknowledgement says ``pinned``. Refused
        before writing when that would mark more than ``max_stale_keys``."""
        hot_ttl = ttl_s if ttl_s is not None else self.config.hot_ttl_s
        check_cancel(cancel)
        self._settle_hot()
        if not items:
            return []
        if not self._up(self.hot):
            down = HotTierDownError(
                f"{self.hot.name} unreachable: another process could go on reading its "
                "older copies")
            return [OpResult(k, False, down) for k, _ in items]
        for which in _TIERS:
            if not self._stale.room(which, len(items)):
                full = StoreUnavailableError(
                    f"{self.config.max_stale_keys} keys already wait for the {which} tier "
                    "to catch up")
                return [OpResult(k, False, full) for k, _ in items]
        if self.config.write_mode == "write-back":
            out = self._put_pinned(items, cancel)
        else:
            out = self._put_through(items, hot_ttl, cancel)
        self._settle_hot()
        return [self._count_put(out[k]) for k, _ in items]

    def _count_put(self, r: OpResult) -> OpResult:
        if r.pinned and self.config.write_mode == "write-through":
            self._stats.add(degraded_writes=1)
        return r

    def _put_through(self, items: Sequence[tuple[str, Buffer]], hot_ttl: float | None,
                     cancel: CancelToken | None) -> dict[str, OpResult]:
        """S3 first; the keys it took, then Valkey; the others refused or pinned."""
        out: dict[str, OpResult] = {}
        cold_err: dict[str, StoreError | None] = {}
        handed: set[str] = set()
        if self._up(self.cold):
            handed = self._uploads.hand_off(items)
            answers = self.cold.put(items, cancel=cancel)
            self._observe(self.cold, [a.error for a in answers])
            cold_err = {a.key: a.error for a in answers if not a.ok}
        else:
            cold_err = dict.fromkeys((k for k, _ in items), None)
        through = [(k, p) for k, p in items if k not in cold_err]
        if through:
            before = self._stale.generation()
            answers = self.hot.put(through, ttl_s=hot_ttl, cancel=cancel)
            self._observe(self.hot, [a.error for a in answers])
            hot_ok = {a.key for a in answers if a.ok}
            # Valkey may still hold an older version (or a lease whose fill would write one).
            self._stale.mark("hot", [k for k, _ in through if k not in hot_ok])
            self._stale.clear("hot", hot_ok, before)
            self._stale.clear("cold", {k for k, _ in through} - handed, before)
            for a in answers:
                out[a.key] = a if a.ok else OpResult(a.key, False, HotTierDownError(
                    f"{a.key!r}: S3 took it, {self.hot.name} did not ({a.error}); its "
                    "older copy is invalidated once it answers"))
        missed = [(k, p) for k, p in items if k in cold_err]
        if missed and self.config.cold_down == "pin":
            out.update(self._put_pinned(missed, cancel))
        else:
            for k, _ in missed:
                out[k] = OpResult(k, False, ColdTierDownError(
                    f"{k!r}: {self.cold.name} did not take it "
                    f"({cold_err[k] or 'down'}); refused (cold_down='refuse')"))
        return out

    def _put_pinned(self, items: Sequence[tuple[str, Buffer]], cancel: CancelToken | None
                    ) -> dict[str, OpResult]:
        """Pending upload records, then the values without expiry, then ``WAITAOF``; the
        upload to S3 is queued for every value Valkey took (acknowledged or not), so that
        Valkey's copy, the records and S3 end on the newest version."""
        hot = self.hot
        if not isinstance(hot, PinningStore):
            cannot = NotDurableError(f"{hot.name} cannot hold values until S3 has them")
            return {k: OpResult(k, False, cannot) for k, _ in items}
        tokens = {k: os.urandom(_RECORD_TOKEN_BYTES) for k, _ in items}
        try:  # before the values: no moment when Valkey lacks both value and record
            hot.mark_pending_uploads(list(tokens.items()))
        except StoreError as exc:
            self._observe(hot, [exc])
            self._uploads.release(tokens)  # they may have landed: cleared once it answers
            down = HotTierDownError(f"{hot.name}: pending upload records not written: {exc}")
            return {k: OpResult(k, False, down) for k, _ in items}
        before = self._stale.generation()
        answers = hot.put_pinned(items, cancel=cancel)
        self._observe(hot, [a.error for a in answers])
        taken = {a.key for a in answers if a.ok}
        durable_error: StoreError | None = None
        try:
            hot.confirm_durable([(k, tokens[k]) for k in taken],
                                replicas=self.config.pin_replicas,
                                timeout_s=self.config.pin_timeout_s)
        except StoreError as exc:
            self._observe(hot, [exc])
            durable_error = exc if isinstance(exc, NotDurableError) else NotDurableError(
                f"{hot.name}: durability not confirmed: {exc}")
        self._stale.clear("hot", taken, before)
        self._uploads.queue([(k, p) for k, p in items if k in taken], tokens)
        self._uploads.release({k: t for k, t in tokens.items() if k not in taken})
        out = {}
        for a in answers:
            if not a.ok:
                out[a.key] = OpResult(a.key, False, HotTierDownError(
                    f"{a.key!r}: {hot.name} did not take it: {a.error}"))
            elif durable_error is not None:
                out[a.key] = OpResult(a.key, False, durable_error)
            else:
                out[a.key] = OpResult(a.key, True, pinned=True)
        return out

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        """Delete from both tiers; a tier that could not delete is marked stale for the key
        (its copy is skipped by this process's reads; Valkey's is deleted once it answers
        again), and a key Valkey did not delete answers with an error
        (:class:`HotTierDownError`): other processes may still read its copy."""
        gone = dict.fromkeys(keys, False)
        errors: dict[str, StoreError | None] = dict.fromkeys(keys)
        done: dict[str, set[str]] = {"hot": set(), "cold": set()}
        self._uploads.forget(keys)
        before = self._stale.generation()
        for which in _TIERS:
            tier = self.hot if which == "hot" else self.cold
            if not self._up(tier):
                continue
            answers = tier.delete(keys, cancel=cancel)
            self._observe(tier, [a.error for a in answers])
            for a in answers:
                gone[a.key] = gone[a.key] or a.ok
                errors[a.key] = errors[a.key] or a.error
                if a.error is None:
                    done[which].add(a.key)
        for which in _TIERS:
            self._stale.mark(which, [k for k in keys if k not in done[which]])
            self._stale.clear(which, done[which], before)
        for k in keys:  # another process could go on reading Valkey's copy
            if k not in done["hot"] and errors[k] is None:
                errors[k] = HotTierDownError(f"{k!r}: {self.hot.name} did not delete it")
        both = [k for k in keys if k in done["hot"] and k in done["cold"]]
        if both and isinstance(self.hot, PendingUploadStore):
            try:  # nothing is behind a key that no tier holds
                self.hot.drop_pending_uploads(both)
            except StoreError as exc:
                self._observe(self.hot, [exc])
        return [OpResult(k, gone[k], errors[k]) for k in keys]
