"""What the node backends share, so that none borrows from another: the node's local tier
with the transfer engine that fills it (:class:`TierCopier`), a pool that runs orders as
warms (:class:`OrderPool`) and the handle of one warm (:class:`WarmHandle`). The token store
the warmers read is :mod:`kvprefetch.agents.backends.tokens`."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count

from kvprefetch.agents.backends.base import BackendContext
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.stores.local import LocalTier
from kvprefetch.agents.transfer import TransferEngine, TransferResult
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.wire import TransferOrder


class TierCopier:
    """The node's local tier (``context.dram``) and the transfer engine that copies chunks
    into it from the remote store: what the ``local`` and ``sglang`` backends keep."""

    def __init__(self, context: BackendContext) -> None:
        self._context = context
        self.tier: LocalTier | None = None
        self.engine: TransferEngine | None = None

    def start(self) -> None:
        """Open the tier (dropping partial writes of a killed predecessor), then start the
        engine."""
        ctx = self._context
        if ctx.dram is None:
            raise ConfigError("a local tier needs 'dram'")
        self.tier = LocalTier(ctx.dram, name=f"dram{ctx.node}", on_evict=ctx.on_evict)
        self.tier.start()
        self.engine = TransferEngine(ctx.store, self.tier, ctx.transfer,
                                     name=f"agent{ctx.node}")
        self.engine.start()

    def close(self) -> None:
        """Stop the engine, then close the tier. Idempotent."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.tier is not None:
            self.tier.close()

    def started(self) -> tuple[LocalTier, TransferEngine]:
        if self.tier is None or self.engine is None:
            raise ConfigError(f"agent {self._context.node} is not started")
        return self.tier, self.engine

    def describe(self) -> str:
        dram = self._context.dram
        return f"tier {dram.path}, {dram.capacity_bytes} bytes" if dram else "no tier"


@dataclass
class WarmHandle:
    """A submitted warm: the agent waits on it like on a transfer handle."""

    transfer_id: int
    future: Future[TransferResult]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self, reason: str = "cancelled") -> None:
        """LMCache cannot stop a submitted warm; a cancelled one is reported cancelled
        (what it loaded stays in L1 for LMCache's eviction to judge)."""
        self.cancelled.set()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout_s: float | None = None) -> TransferResult:
        return self.future.result(timeout_s)


class OrderPool:
    """What the warmers of the ``lmcache-mp`` and ``sglang`` backends share: orders run on
    a pool of threads, one :class:`WarmHandle` each; a subclass implements :meth:`_run`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._ids = count(1)

    def _open_pool(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=self.name)

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _not_started(self) -> Exception:
        return StoreError(f"{self.name} is not started")

    def submit(self, order: TransferOrder) -> WarmHandle:
        if self._pool is None:
            raise self._not_started()
        tid = next(self._ids)
        handle = WarmHandle(tid, Future())
        handle.future = self._pool.submit(self._run, tid, order, handle.cancelled)
        return handle

    def _run(self, tid: int, order: TransferOrder, cancelled: threading.Event
             ) -> TransferResult:
        raise NotImplementedError
