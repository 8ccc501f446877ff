"""The prefetch agent: one per GPU node, carrying out the scheduler's transfer orders.

It holds a connection to the remote token store (Valkey in front of S3,
:class:`~kvprefetch.agents.stores.TieredStore`) and the node backend the config names
(``backend``: a :class:`~kvprefetch.agents.backends.base.NodeBackend` from the registry,
:mod:`kvprefetch.agents.backends`), which lands each order's chunks where the node's engine
reads them. Per order the agent hands the order to the backend and reports one
:class:`~kvprefetch.controlplane.base.wire.TransferReport` to the scheduler; it passes evict
advice and the engine's write-through of new KV to the backend, and keeps the order
bookkeeping (which keys a starting or running order claims, so that no delete takes them).
With ``local`` the backend copies chunks into the node's own DRAM/disk tier (atomic
publish: a chunk is visible whole or not at all, also when the agent is killed
mid-transfer) and passes each order's ``deadline_s`` to the tier's eviction policy as the
predicted next use of its keys (``eviction: predicted``). With ``lmcache-mp`` the
node-local tier is the node's LMCache MP server's L1 instead: orders run as LMCache warm
prefetches, evict advice deletes from L1, the engine stores through LMCache itself, and
what L1 drops on its own reaches the scheduler from LMCache's KV events, as the local
tier's evictions do.

Who calls what: the scheduler sends ``execute`` (a few per second per node), ``cancel`` and
``evict``; the node's engine calls ``wait`` (blocks until an order ends) and
``write_local`` once per request; monitoring calls ``status``. All are thread-safe;
``execute`` is idempotent per order id. The agent's own calls on the scheduler (hello,
reports, status, the tier's evictions) are those of
:class:`~kvprefetch.controlplane.base.scheduler_api.NodeAPI`.

Scheduler incarnations: every order id carries the epoch of the scheduler that issued it
(:func:`~kvprefetch.controlplane.base.wire.order_epoch`). The agent outlives scheduler
restarts, so on the first order of a newer epoch it forgets the older epochs'
de-duplication state and reports (their ids are never reused, but an engine must not be
handed an old report), and it refuses orders of an epoch older than the newest it has seen
(a stale message from a scheduler that has been replaced), counting them in
``stale_orders``.

Warming yields to the engine (``warming``, :mod:`kvprefetch.agents.warm_gate`): while the
node's engine is busy (its load read from ``engine_url``'s Prometheus page) a new prefetch
is held until the engine is idle, its deadline comes near, or the engine waits on it; a
prefetch not started by its deadline plus ``warming.late_grace_s`` is dropped, reported not
done (``cancelled``, nothing moved) and counted in the status's ``orders_dropped_late``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvprefetch.agents.backends.base import BackendContext, NodeBackend, WarmHandleLike
from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
from kvprefetch.agents.backends.registry import BackendName, backend_spec, require_settings
from kvprefetch.agents.backends.sglang.warmer import SGLangWarmConfig
from kvprefetch.agents.lmcache.kv_events import KVEventStats
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.stores.s3.store import S3Store, S3StoreConfig
from kvprefetch.agents.stores.tiered import TieredStore, TieredStoreConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStore, ValkeyStoreConfig
from kvprefetch.agents.transfer import TransferConfig, TransferResult
from kvprefetch.agents.vllm.engine_load import EngineLoadProbe, metrics_url_of
from kvprefetch.agents.vllm.kv_events import (
    VLLMEventsConfig,
    VLLMEventStats,
    VLLMEventSubscriber,
)
from kvprefetch.agents.warm_gate import Verdict, WarmGate, WarmGateStats, WarmingConfig
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.keys import position_key_session
from kvprefetch.controlplane.base.shards import MAX_SHARDS
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    HbmReport,
    TierEvictions,
    TransferOrder,
    TransferReport,
    format_order_id,
    keys_digest,
    order_epoch,
)

log = logging.getLogger(__name__)

Reporter = Callable[[TransferReport], None]
#: How long ``wait`` waits for an order it has not seen yet (wall seconds).
UNSEEN_ORDER_GRACE_S = 5.0
#: Order ids remembered to run each order once, and reports kept for ``wait`` (bounded:
#: the oldest go first).
SEEN_MEMORY = 65_536
REPORT_MEMORY = 10_000
#: Keys the tier evicted by its own order, kept until the scheduler takes them (bounded:
#: past it the oldest go, counted; the node's next greeting reconciles the books in full).
EVICTION_MEMORY = 65_536


class RemoteStoreConfig(BaseModel):
    """The remote token store: Valkey and/or S3 (both: Valkey in front of S3)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    valkey: ValkeyStoreConfig | None = None
    s3: S3StoreConfig | None = None
    tiered: TieredStoreConfig = TieredStoreConfig()

    def build(self) -> ObjectStore:
        """A store object (no I/O until its ``start``)."""
        hot = ValkeyStore(self.valkey) if self.valkey is not None else None
        cold = S3Store(self.s3) if self.s3 is not None else None
        if hot is not None and cold is not None:
            return TieredStore(hot, cold, self.tiered)
        if hot is not None:
            return hot
        if cold is not None:
            return cold
        raise ConfigError("remote store: configure valkey, s3 or both")


class AgentConfig(BaseModel):
    """One node's agent. ``backend`` picks where orders land: ``local`` = the project's own
    DRAM/disk tier (``dram``), ``lmcache-mp`` = the node's LMCache MP server's L1, warmed
    through its HTTP API (``lmcache``), ``sglang`` = the ``dram`` tier filled with SGLang's
    page objects, which our SGLang HiCache backend reads first (``sglang``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: int = Field(ge=0)
    node_name: str = ""
    backend: BackendName = "local"
    dram: LocalTierConfig | None = None
    lmcache: LMCacheBackendConfig | None = None
    sglang: SGLangWarmConfig | None = None
    #: The node's vLLM KV events (HBM stores and evictions); None: not followed.
    vllm: VLLMEventsConfig | None = None
    #: The node's engine's OpenAI base URL as the gateway reaches it, announced in the
    #: agent's hello: the gateway forwards the node's requests there ("" = the gateway's
    #: configured upstream of the node).
    engine_url: str = ""
    #: How prefetch warms yield to the engine and when a late one is dropped
    #: (:class:`~kvprefetch.agents.warm_gate.WarmingConfig`).
    warming: WarmingConfig = WarmingConfig()
    remote: RemoteStoreConfig
    transfer: TransferConfig = TransferConfig()
    #: Threads that wait on transfers and send their reports.
    report_threads: int = Field(16, ge=1, le=256)
    #: Scheduler shards that send this agent orders (each shard's epochs are congruent to
    #: its number modulo this; the agent tracks each shard's newest epoch on its own).
    scheduler_shards: int = Field(1, ge=1, le=MAX_SHARDS)
    #: Real bytes per byte the scheduler books (the engine emulator's ``kv_scale``; 1 on a
    #: real node): the scheduler divides the tier capacity this agent reports by it.
    kv_scale: float = Field(1.0, gt=0, le=1)
    #: Report the tier's capacity and occupancy (:meth:`PrefetchAgent.status`) to every
    #: scheduler shard this often, in wall seconds: each shard's quota of the node follows
    #: it. 0: never (the shards plan with the configured tier).
    status_interval_s: float = Field(5.0, ge=0)

    @model_validator(mode="after")
    def _backend_settings(self) -> AgentConfig:
        require_settings(self.backend, {"dram": self.dram, "lmcache": self.lmcache,
                                        "sglang": self.sglang},
                         {"lmcache": "the node's LMCache server: http_url, model_name ..."})
        return self


@dataclass(slots=True)
class _Running:
    order: TransferOrder
    handle: WarmHandleLike
    done: threading.Event


class PrefetchAgent:
    """See the module docstring."""

    def __init__(self, config: AgentConfig, *, reporter: Reporter | None = None,
                 store: ObjectStore | None = None) -> None:
        self.config = config
        self.node = config.node
        self.node_name = config.node_name or socket.gethostname()
        self._reporter = reporter
        self._store = store
        self._backend: NodeBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._appeared = threading.Condition(self._lock)
        self._running: dict[int, _Running] = {}
        #: Keys of orders admitted but whose transfer is not yet registered in ``_running``:
        #: evict advice that arrives meanwhile (Ray runs an actor's calls on many threads,
        #: in any order) must not delete a key the starting transfer has found present.
        self._starting: dict[int, tuple[str, ...]] = {}
        self._reports: OrderedDict[int, TransferReport] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()
        #: The newest scheduler epoch seen in an order, per scheduler shard.
        self._epochs: dict[int, int] = {}
        self.stale_orders = 0
        self.incarnation = uuid.uuid4().hex
        self._done = self._failed = self._bytes = self._evicted = 0
        #: Keys the tier's own policy evicted, for :meth:`take_evictions`.
        self._tier_evicted: deque[str] = deque()
        self._evictions = threading.Condition(threading.Lock())
        self.evictions_dropped = 0
        #: The engine's HBM changes not yet taken (:meth:`take_hbm`), and whether they
        #: are a full listing.
        self._hbm_pending: dict[str, int] = {}
        self._hbm_full = False
        self._hbm_events: VLLMEventSubscriber | None = None
        self._gate: WarmGate | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> PrefetchAgent:
        """Connect to the remote store, then build and start the node backend the config
        names (:mod:`kvprefetch.agents.backends`): for ``local`` it opens the local tier
        (dropping partial writes of a killed predecessor) and starts the transfer engine;
        for ``lmcache-mp`` it checks the node's LMCache server's settings against ours."""
        if self._pool is not None:
            return self
        cfg = self.config
        if self._store is None:
            self._store = cfg.remote.build()
        self._store.start()
        spec = backend_spec(cfg.backend)
        self._backend = spec.build(BackendContext(
            node=self.node, store=self._store, on_evict=self._on_tier_evict, dram=cfg.dram,
            transfer=cfg.transfer, settings=spec.settings_of(cfg)))
        try:
            self._backend.start()  # refuses an engine whose keys cannot match ours
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(cfg.report_threads,
                                        thread_name_prefix=f"agent{self.node}-report")
        self._gate = self._warm_gate(cfg)
        self._gate.start()
        if cfg.vllm is not None and cfg.vllm.kv_events != "off":
            self._follow_hbm(cfg.vllm)
        log.info("agent %d (%s) started: %s", self.node, self.node_name,
                 self._backend.describe())
        return self

    def _warm_gate(self, cfg: AgentConfig) -> WarmGate:
        """The gate of new prefetches: held while the engine at ``engine_url`` (or
        ``warming.engine_metrics_url``) is busy; none held without either."""
        url = cfg.warming.engine_metrics_url or metrics_url_of(cfg.engine_url)
        probe = (EngineLoadProbe(url, cfg.warming.engine_poll_interval_ms / 1000)
                 if url else None)
        return WarmGate(cfg.warming, probe.load if probe is not None else None,
                        self._start_held, self._drop_late, name=f"agent{self.node}-warm-gate")

    def _follow_hbm(self, cfg: VLLMEventsConfig) -> None:
        """Subscribe to the node's vLLM KV events (``vllm.kv_events``): ``required``
        refuses to start without the publisher, ``auto`` warns and keeps trying."""
        from kvprefetch.agents.vllm.hbm_residency import HbmResidency

        events = VLLMEventSubscriber(
            cfg.endpoint, self, replay_endpoint=cfg.replay_endpoint, topic=cfg.topic,
            timeout_s=cfg.connect_timeout_s, residency=HbmResidency(cfg.max_tracked_blocks),
            bind=cfg.bind, name=f"agent{self.node}-vllm-events")
        try:
            connected = events.start()
        except ImportError as exc:
            connected = False
            if cfg.kv_events == "required":
                self.close()
                raise ConfigError(f"agent {self.node}: vllm.kv_events required, but "
                                  f"{exc.name} is not installed") from exc
            log.warning("agent %d: vLLM's KV events not followed: %s", self.node, exc)
            return
        self._hbm_events = events
        if connected:
            return
        if cfg.kv_events == "required":
            self.close()
            raise ConfigError(f"agent {self.node}: vllm.kv_events is required, but vLLM's "
                              f"KV event publisher at {cfg.endpoint} did not answer within "
                              f"{cfg.connect_timeout_s:g} s (start vLLM with "
                              "--kv-events-config, or set vllm.kv_events: auto)")
        log.warning("agent %d: vLLM's KV event publisher at %s is not reachable yet: the "
                    "scheduler learns nothing of the node's HBM until it is (still trying)",
                    self.node, cfg.endpoint)

    def close(self) -> None:
        if self._gate is not None:
            for order in self._gate.close():
                self._end_unstarted(order, self._empty_report(order, error="agent closed",
                                                              cancelled=True))
            self._gate = None
        if self._hbm_events is not None:
            self._hbm_events.close()
            self._hbm_events = None
        if self._backend is not None:
            self._backend.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> PrefetchAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_reporter(self, reporter: Reporter | None) -> None:
        self._reporter = reporter

    @property
    def tier(self) -> LocalTier:
        """The node's local tier (``local`` and ``sglang`` backends, once started)."""
        tier = self._backend.tier if self._backend is not None else None
        if tier is None:
            raise ConfigError(f"agent {self.node} is not started")
        return tier

    @property
    def backend(self) -> NodeBackend:
        if self._backend is None:
            raise ConfigError(f"agent {self.node} is not started")
        return self._backend

    @contextmanager
    def _order_guard(self) -> Iterator[set[str]]:
        """The backend's guard around choosing and deleting keys: under the lock, the keys
        of every order starting or running."""
        with self._lock:
            yield self._busy_keys()

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            raise ConfigError(f"agent {self.node} is not started")
        return self._store

    def hello(self) -> AgentHello:
        return AgentHello(self.node, self.incarnation, self.node_name, self.inventory(),
                          os.getpid(), self.config.engine_url)

    # ------------------------------------------------------------------ orders
    def execute(self, order: TransferOrder) -> None:
        """Start moving the order's chunks (returns at once). Idempotent per order id."""
        backend, pool = self._backend, self._pool
        if pool is None or backend is None:
            raise ConfigError(f"agent {self.node} is not started")
        if order.node != self.node:
            log.warning("agent %d: order %d is for node %d; refused", self.node,
                        order.order_id, order.node)
            self._report(self._empty_report(order, error=f"wrong node {self.node}"))
            return
        with self._lock:
            if not self._admit(order):
                return
        verdict = self._gate.offer(order) if self._gate is not None else Verdict.START
        if verdict is Verdict.LATE:
            self._drop_late(order)
        elif verdict is Verdict.START:
            self._start(order)

    def _start(self, order: TransferOrder) -> None:
        """Hand an admitted order to the backend and wait for its end on the report
        pool."""
        backend, pool = self._backend, self._pool
        if pool is None or backend is None:
            raise ConfigError(f"agent {self.node} is not started")
        with self._lock:
            self._starting[order.order_id] = order.keys
        try:
            handle = backend.warm(order)
        except BaseException:
            with self._lock:
                self._starting.pop(order.order_id, None)
            raise
        running = _Running(order, handle, threading.Event())
        with self._lock:
            self._running[order.order_id] = running
            self._starting.pop(order.order_id, None)
            self._appeared.notify_all()
        pool.submit(self._finish, running)

    def _start_held(self, order: TransferOrder) -> None:
        """The gate releases a held order: start it; a failure to start is its report."""
        try:
            self._start(order)
        except Exception as exc:
            log.exception("agent %d: held order %d did not start", self.node, order.order_id)
            self._end_unstarted(order, self._empty_report(
                order, error=f"{type(exc).__name__}: {exc}"))

    def _drop_late(self, order: TransferOrder) -> None:
        """A prefetch not started by its deadline plus the grace: reported not done,
        nothing moved (the scheduler drops what it reserved and re-plans the session)."""
        log.info("agent %d: order %s (%s) not started by its deadline; dropped", self.node,
                 format_order_id(order.order_id), order.session_id)
        self._end_unstarted(order, self._empty_report(
            order, error="dropped: not started by its deadline", cancelled=True))

    def _end_unstarted(self, order: TransferOrder, report: TransferReport) -> None:
        """Book and send the report of an order that never reached the backend."""
        with self._lock:
            if self._current(order.order_id):
                self._reports[order.order_id] = report
                while len(self._reports) > REPORT_MEMORY:
                    self._reports.popitem(last=False)
            if not report.cancelled:
                self._failed += 1
            self._appeared.notify_all()
        self._report(report)

    def _busy_keys(self) -> set[str]:
        """Under the lock: the keys of every order starting or running."""
        busy = {k for keys in self._starting.values() for k in keys}
        busy.update(k for r in self._running.values() for k in r.order.keys)
        return busy

    def _current(self, order_id: int) -> bool:
        """Under the lock: whether the order is of its shard's newest epoch (or newer): an
        older one's scheduler incarnation is gone, so no one waits for it."""
        epoch = order_epoch(order_id)
        return epoch >= self._epochs.get(epoch % self.config.scheduler_shards, 0)

    def _admit(self, order: TransferOrder) -> bool:
        """Under the lock: whether to run ``order`` (new, and not of a replaced scheduler).
        The first order of a newer epoch drops the older epochs' state."""
        epoch = order_epoch(order.order_id)
        shard = epoch % self.config.scheduler_shards
        newest = self._epochs.get(shard, 0)
        if epoch < newest:
            self.stale_orders += 1
            log.warning("agent %d: order %s is from scheduler epoch %d, replaced by %d; "
                        "dropped", self.node, format_order_id(order.order_id), epoch, newest)
            return False
        if epoch > newest:
            if newest:
                log.info("agent %d: scheduler epoch %d replaces %d; forgetting %d seen "
                         "orders and %d reports", self.node, epoch, newest,
                         len(self._seen), len(self._reports))
            self._epochs[shard] = epoch
            self._seen = OrderedDict((oid, None) for oid in self._seen if self._current(oid))
            self._reports = OrderedDict((oid, r) for oid, r in self._reports.items()
                                        if self._current(oid))
        if order.order_id in self._seen:
            return False
        self._seen[order.order_id] = None
        while len(self._seen) > SEEN_MEMORY:
            self._seen.popitem(last=False)
        return True

    def _finish(self, running: _Running) -> None:
        order = running.order
        try:
            result = running.handle.result()
            report = self._to_report(order, result)
        except Exception as exc:  # never lose a report
            log.exception("agent %d: order %d failed", self.node, order.order_id)
            report = self._empty_report(order, error=f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._running.pop(order.order_id, None)
            if self._current(order.order_id):  # else no one may wait for it
                self._reports[order.order_id] = report
                while len(self._reports) > REPORT_MEMORY:  # bounded: oldest reports first
                    self._reports.popitem(last=False)
            if report.complete:
                self._done += 1
            else:
                self._failed += 1
            self._bytes += report.bytes_moved
        running.done.set()
        self._report(report)

    def _to_report(self, order: TransferOrder, r: TransferResult) -> TransferReport:
        error = ""
        if r.failed:
            error = r.failed[0][1]
        elif r.missed:
            error = f"{len(r.missed)} chunks not in the remote store"
        return TransferReport(
            order.order_id, order.session_id, order.node, order.prefetch,
            complete=r.complete and not r.cancelled, cancelled=r.cancelled,
            bytes_moved=r.bytes_moved, keys_moved=r.keys_moved, keys_present=r.keys_present,
            keys_missed=r.keys_missed, keys_failed=r.keys_failed, ttlb_wall_s=r.ttlb_s,
            incarnation=self.incarnation, error=error, done_wall_s=time.time(),
            keys_digest=keys_digest(order.keys))

    def _empty_report(self, order: TransferOrder, *, error: str, cancelled: bool = False
                      ) -> TransferReport:
        """Nothing moved: every key failed, or none was tried (``cancelled``)."""
        failed = 0 if cancelled else len(order.keys)
        return TransferReport(order.order_id, order.session_id, order.node, order.prefetch,
                              False, cancelled, 0, 0, 0, 0, failed, 0.0,
                              self.incarnation, error, time.time(), keys_digest(order.keys))

    def _report(self, report: TransferReport) -> None:
        if self._reporter is None:
            return
        try:
            self._reporter(report)
        except Exception:  # the scheduler may be restarting; it re-plans lost orders
            log.warning("agent %d: could not report order %d", self.node, report.order_id,
                        exc_info=True)

    def wait(self, order_id: int, timeout_s: float | None = None) -> TransferReport | None:
        """Block until the order ends (its report), or None after ``timeout_s`` or when
        this agent has not seen the order within ``UNSEEN_ORDER_GRACE_S`` (the order
        and the wait come from different callers, so the wait may arrive first)."""
        gate = self._gate
        held = gate.release(order_id) if gate is not None else None
        if held is not None:  # the engine waits on it: it yields no longer
            self._start_held(held)
        with self._lock:
            done = self._reports.get(order_id)
            running = self._running.get(order_id)
            if done is None and running is None and self._current(order_id):
                # The scheduler's execute and the engine's wait travel separately: the order
                # may still be on its way here. Give it a moment to appear.
                grace = UNSEEN_ORDER_GRACE_S if timeout_s is None else min(
                    timeout_s, UNSEEN_ORDER_GRACE_S)
                end = time.monotonic() + grace
                while done is None and running is None:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._appeared.wait(left)
                    done = self._reports.get(order_id)
                    running = self._running.get(order_id)
        if done is not None:
            return done
        if running is None:
            return None
        if not running.done.wait(timeout_s):
            return None
        with self._lock:
            return self._reports.get(order_id)

    def cancel(self, session_id: str, order_id: int | None = None) -> int:
        """Cancel the session's running or held orders (or one of them); returns how
        many."""
        held = self._gate.withdraw(session_id, order_id) if self._gate is not None else []
        for order in held:
            self._end_unstarted(order, self._empty_report(
                order, error="cancelled by the scheduler", cancelled=True))
        with self._lock:
            targets = [r for r in self._running.values()
                       if r.order.session_id == session_id
                       and (order_id is None or r.order.order_id == order_id)]
        for r in targets:
            r.handle.cancel("cancelled by the scheduler")
        return len(targets) + len(held)

    # ------------------------------------------------------------------ the tier
    def evict(self, prefixes: Sequence[str] = (), keys: Sequence[str] = ()) -> int:
        """Evict advice: delete these keys and every key under these prefixes. Keys of a
        transfer still running are left alone and advised as never needed again (first to
        go under ``eviction: predicted`` once they land). Returns how many were deleted.
        With the ``lmcache-mp`` backend, the sessions under ``prefixes`` leave LMCache's
        L1."""
        gone = self.backend.evict(prefixes, keys, self._order_guard)
        with self._lock:
            self._evicted += gone
        return gone

    def _on_tier_evict(self, keys: list[str]) -> None:
        """The tier evicted ``keys`` by its own order: the local tier to make room (called
        under its lock), LMCache's L1 by its policy or someone else's delete (called by the
        ``lmcache-mp`` backend, mostly from its KV-event thread)."""
        with self._evictions:
            self._tier_evicted.extend(keys)
            over = len(self._tier_evicted) - EVICTION_MEMORY
            if over > 0:
                for _ in range(over):
                    self._tier_evicted.popleft()
                self.evictions_dropped += over
            self._evictions.notify_all()

    def take_evictions(self, timeout_s: float) -> TierEvictions | None:
        """The sessions whose chunks the tier evicted by its own order (the local tier to
        fit a write; LMCache's L1 by its policy, a delete that was not our advice, or a gap
        in its KV events) since the last call, waiting up to ``timeout_s`` for one; keys
        written or warmed again since are left out (a newer copy landed). None if there are
        none. The scheduler's books of this node are stale for each session named (sent to
        its owner shard)."""
        with self._evictions:
            if not (self._tier_evicted or self._hbm_pending or self._hbm_full):
                self._evictions.wait(timeout_s)
            keys = list(dict.fromkeys(self._tier_evicted))
            self._tier_evicted.clear()
        if not keys:
            return None
        back = self.backend.holds(keys)
        sessions = {s for k, held in zip(keys, back, strict=True) if not held
                    and (s := position_key_session(k)) is not None}
        if not sessions:
            return None
        return TierEvictions(self.node, self.incarnation,
                             tuple(sorted(f"{t}/{sid}" for t, sid in sessions)))

    def hbm_changed(self, tokens: Mapping[str, int], *, full: bool) -> None:
        """The engine's HBM prefix cache changed (its KV events; called by the
        subscriber's thread): kept for :meth:`take_hbm`, a full listing replacing what
        was not taken yet."""
        with self._evictions:
            if full:
                self._hbm_pending.clear()
                self._hbm_full = True
            self._hbm_pending.update(tokens)
            self._evictions.notify_all()

    def take_hbm(self) -> HbmReport | None:
        """The engine's HBM changes since the last call (per session, its tokens in HBM
        now; ``full``: a listing), or None if there are none. Sent by the same sender as
        :meth:`take_evictions`, which wakes for them too."""
        with self._evictions:
            if not (self._hbm_pending or self._hbm_full):
                return None
            sessions = tuple(sorted(self._hbm_pending.items()))
            full, self._hbm_full = self._hbm_full, False
            self._hbm_pending.clear()
        events = self._hbm_events
        block = events.residency.block_tokens if events is not None else 0
        return HbmReport(self.node, self.incarnation, sessions, full, block)

    def relist_hbm(self) -> None:
        """Queue a full listing of the engine's HBM for :meth:`take_hbm` (a scheduler
        that restarted has no mirror of it). Nothing without vLLM's events."""
        events = self._hbm_events
        if events is not None:
            self.hbm_changed(events.residency.listing(), full=True)

    def vllm_events(self) -> VLLMEventStats | None:
        """The vLLM KV-event subscription's counters (None when not followed)."""
        events = self._hbm_events
        return events.stats() if events is not None else None

    def write_local(self, items: Sequence[tuple[str, bytes]], drop: Sequence[str] = ()
                    ) -> int:
        """The engine's write-through of new KV into the local tier; returns how many
        objects were stored (a full tier stores fewer: the remote store has them).
        ``drop``: chunks the new context superseded (the previous turn's last, partial
        chunk), deleted so that they do not crowd out live ones. With the ``lmcache-mp``
        backend the engine stores through LMCache itself: nothing to do here."""
        backend = self.backend
        stored = backend.write(items)
        if drop:
            backend.trim(drop, self._order_guard)
        return stored

    def inventory(self) -> tuple[str, ...]:
        return self.backend.listing()

    def has(self, keys: Sequence[str]) -> list[bool]:
        return self.backend.has(keys)

    def kv_events(self) -> KVEventStats | None:
        """The ``lmcache-mp`` backend's KV-event subscription counters (None on other
        backends, or when it does not follow the server's events)."""
        stats = self.backend.events()
        return stats if isinstance(stats, KVEventStats) else None

    def status(self) -> AgentStatus:
        """Occupancy and counters; ``orders_in_flight`` counts held orders too."""
        used, capacity, held = self.backend.stats()
        gate = self._gate.stats() if self._gate is not None else WarmGateStats()
        with self._lock:
            return AgentStatus(self.node, self.node_name, self.incarnation, os.getpid(),
                               used, capacity, held, len(self._running) + gate.held,
                               self._done, self._failed, self._bytes, self._evicted,
                               self.stale_orders, self.config.kv_scale,
                               orders_deferred=gate.deferred,
                               orders_dropped_late=gate.dropped_late)
