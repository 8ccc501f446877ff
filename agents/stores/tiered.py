"""Valkey in front of S3: read-through with promotion, write-through or write-back, and
graceful degradation when either tier is down.

A tier that fails with a connection error or a timeout is skipped for ``retry_down_after_s``
(a small circuit breaker), so that a dead server costs one failed request, not one per key:
Valkey down → S3 only; S3 down → Valkey only; both down → every key is a clean miss
(:class:`StoreUnavailableError`, ``is_miss``) and the engine recomputes. Nothing waits longer
than the tiers' own connect and read timeouts.

Repair: a copy that fails verification in one tier is rewritten from the other tier's copy
when that one verifies (in the background, counted in :meth:`TieredStore.repairs`). Hot
corrupt, cold good: the S3 copy read in its place is written back into Valkey. Cold corrupt
(S3 keeps it, quarantined): Valkey is read once more and, if it now serves the key, S3 is
rewritten from it. A tier with a ``repair`` method (:class:`RepairableStore`: both of ours)
replaces only the broken version, never one written meanwhile; others get a plain ``put``.
"""

from __future__ import annotations

import logging
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
    CorruptObjectError,
    StoreConnectionError,
    StoreError,
    StoreUnavailableError,
)
from kvprefetch.agents.stores.format import ObjectHeader

log = logging.getLogger(__name__)


class TieredStoreConfig(BaseModel):
    """How the hot and cold tiers cooperate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``write-through``: a put returns once S3 (then Valkey) has it. ``write-back``: a put
    #: returns once Valkey has it; S3 is written in the background (``flush`` waits).
    write_mode: Literal["write-through", "write-back"] = "write-through"
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


@runtime_checkable
class RepairableStore(Protocol):
    """A tier that can replace a copy it found broken without touching a newer version.

    Called by :class:`TieredStore` from a background thread, once per broken copy found by
    a read, with the other tier's verified payload; not idempotent in effect (a second call
    after a successful one answers ``ok`` False and writes nothing).
    """

    def repair(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None
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

    def _promote(self, header: ObjectHeader, payload: Buffer) -> None:
        if not self.config.promote or not self._up(self.hot):
            return

        def run() -> None:
            res = self.hot.put([(header.key, payload)], ttl_s=self.config.hot_ttl_s)
            self._observe(self.hot, [r.error for r in res])
            if res[0].ok:
                self._stats.add(promotions=1)

        self._background(run, droppable=True)

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
        promoted into the hot tier in the background."""
        check_cancel(cancel)
        results: dict[str, GetResult] = {}
        if self._up(self.hot):
            answers = self.hot.get(keys, sink=sink, cancel=cancel)
            self._observe(self.hot, [a.error for a in answers])
            results.update((a.key, a) for a in answers)
        rest = [k for k in keys if k not in results or not results[k].ok]
        if rest and self._up(self.cold):
            check_cancel(cancel)
            promote = self.config.promote and self._up(self.hot)
            hot_broken = ({k for k in rest if isinstance(results[k].error, CorruptObjectError)}
                          if self._up(self.hot) else set())

            def cold_hit(header: ObjectHeader, payload: Buffer) -> None:
                if header.key in hot_broken:
                    self._repair("hot", header, payload)
                elif promote:
                    self._promote(header, payload)

            cold_sink = sink
            if (promote or hot_broken) and sink is not None:
                cold_sink = _TeeSink(sink, cold_hit, lambda k: promote or k in hot_broken)
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
        """Write-through: S3, then Valkey. Write-back: Valkey now, S3 in the background.
        A key counts as stored when at least one tier has it (degraded writes are logged)."""
        hot_ttl = ttl_s if ttl_s is not None else self.config.hot_ttl_s
        check_cancel(cancel)
        hot_up, cold_up = self._up(self.hot), self._up(self.cold)
        cold_res: dict[str, OpResult] = {}
        hot_res: dict[str, OpResult] = {}
        write_back = self.config.write_mode == "write-back" and hot_up
        if cold_up and not write_back:
            answers = self.cold.put(items, cancel=cancel)
            self._observe(self.cold, [a.error for a in answers])
            cold_res = {a.key: a for a in answers}
        if hot_up:
            answers = self.hot.put(items, ttl_s=hot_ttl, cancel=cancel)
            self._observe(self.hot, [a.error for a in answers])
            hot_res = {a.key: a for a in answers}
        if write_back and cold_up:
            stored = [(k, p) for k, p in items if hot_res.get(k, OpResult(k, False)).ok]
            if stored:
                def run() -> None:
                    res = self.cold.put(stored)
                    self._observe(self.cold, [r.error for r in res])
                self._background(run, droppable=False)
        out = []
        for key, _ in items:
            c, h = cold_res.get(key), hot_res.get(key)
            if (c and c.ok) or (h and h.ok):
                out.append(OpResult(key, True))
                if not (c and c.ok) and not write_back:
                    self._stats.add(degraded_writes=1)
            else:
                err = (c.error if c else None) or (h.error if h else None)
                out.append(OpResult(key, False, err or StoreUnavailableError("no tier is up")))
        return out

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        gone = dict.fromkeys(keys, False)
        errors: dict[str, StoreError | None] = dict.fromkeys(keys)
        for tier in (self.hot, self.cold):
            if not self._up(tier):
                continue
            answers = tier.delete(keys, cancel=cancel)
            self._observe(tier, [a.error for a in answers])
            for a in answers:
                gone[a.key] = gone[a.key] or a.ok
                errors[a.key] = errors[a.key] or a.error
        return [OpResult(k, gone[k], errors[k]) for k in keys]
