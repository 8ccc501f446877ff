"""The live scheduler: :class:`SchedulerCore` on a wall clock, fed by the gateway, the
engines and the prefetch agents.

``SchedulerService`` is a plain class (the Ray actor in :mod:`kvprefetch.controlplane.live.ray_app`
wraps it; tests drive it directly). It is a thin driver of the core, in rooms:

* :class:`~kvprefetch.controlplane.live.sessions.SessionRegistry`: sessions, tenancy, chunk names;
* :class:`~kvprefetch.controlplane.live.orders.OrderBook`: orders in flight, bounded de-duplication;
* :class:`~kvprefetch.controlplane.live.fleet.LiveFleet`: the core's view of the fleet, from
reports;
* :class:`~kvprefetch.controlplane.live.driver.LiveDriver`: the decisions under the lock: every
session
  event is journalled (:class:`~kvprefetch.controlplane.live.journal.LiveJournalWriter`: the event
  and
  the change of its chunk names), then applied by ``LiveDriver.apply``, the one path that
  live calls and resume share, so a resumed session has the context, turns and chunk names
  it had;
* :class:`~kvprefetch.controlplane.live.ports.AgentFanout`: the core's decisions
  (:class:`~kvprefetch.controlplane.core.step.StepOutput`) carried out as messages to the agents;
* a control loop that fires armed prefetch orders, expires lost orders and flushes the
  journal; it logs and counts every failure and never dies;
* a journal that fails closed: a call whose event cannot be journalled (a full disk)
  raises :class:`~kvprefetch.controlplane.base.errors.JournalUnavailableError` (503) having
  changed nothing, and is never replayed; :meth:`SchedulerService.check_health` reports the
  journal unwritable until it takes records again. A clean :meth:`SchedulerService.close`
  ends the journal with a stop record;
* journal compaction (:func:`~kvprefetch.controlplane.live.journal.compact_journal`): at start-up
  after a long replay, and in a background thread once ``journal_compact_records`` records
  were written since the last one. The journal is rewritten atomically without closed
  sessions' records, so a resume costs the live sessions' events, not the history.

Incarnations: each start replays the journal (damaged records are quarantined to a side
file and counted, never a failed start-up, which Ray would turn into a restart loop), then
takes the next epoch (:func:`next_epoch`, journalled); every order id carries it, so agents
and reports never confuse this incarnation's orders with a predecessor's.

Fleet changes: ``fleet.nodes`` is the capacity; nodes from ``initial_nodes`` on are out of
the fleet at start (the core's ``node_left``) and join when their agent first says hello
(``node_joined``: routed to from then on, warmed with idle sessions whose KV is local
nowhere), counted in the summary's ``nodes_joined``.

Limits and tenancy: every gateway call is checked against ``config.limits`` (names,
list lengths, token-id range) before it touches any state, and token ids are hashed into
chunk keys before the lock is taken, so one large request never holds up the small ones.
Sessions are keyed by (tenant, session id); a new session is refused with
:class:`~kvprefetch.controlplane.live.tenants.TenantQuotaError` while its tenant holds
``max_live_sessions`` live ones.

Threading: every public method may be called from any thread; one lock guards the state.
Messages to agents are sent after the lock is released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import ValidationError

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import (
    ConfigError,
    InvalidRequestError,
    JournalUnavailableError,
    WrongShardError,
)
from kvprefetch.controlplane.base.shards import ShardRing, shard_epoch
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    TierEvictions,
    TransferOrder,
    TransferReport,
)
from kvprefetch.controlplane.core.quotas import TenantQuotaStats
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.live.config import ServiceClock, ServiceConfig
from kvprefetch.controlplane.live.driver import LiveDriver
from kvprefetch.controlplane.live.fleet import LiveFleet
from kvprefetch.controlplane.live.journal import (
    JournalOpener,
    LiveJournalScanner,
    LiveJournalWriter,
    compact_journal,
    live_records,
    open_journal_file,
    publish_compacted,
    write_compacted,
)
from kvprefetch.controlplane.live.limits import check_call, prehash
from kvprefetch.controlplane.live.orders import OrderBook
from kvprefetch.controlplane.live.ports import (
    AgentFanout,
    AgentPort,
    NullMetrics,
    Outbox,
    SchedulerGauges,
    ServiceMetricsSink,
    ServiceStats,
)
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionRegistry, SessionState
from kvprefetch.controlplane.traces.journal import (
    EpochRecord,
    StopRecord,
    TimeLimits,
    quarantine,
)

log = logging.getLogger(__name__)

_Call = TypeVar("_Call", bound=api.RouteQuery | api.RequestStarted | api.RequestFinished
                | api.HintCall | api.SessionClosed)

#: Epochs from the wall clock count whole seconds from 2024-01-01 UTC (so that order ids,
#: epoch << 32 | n, stay below 2**63 until 2092).
EPOCH_ORIGIN_S = 1_704_067_200


#: How far the epoch skips ahead when the journal had damaged records (one of them may
#: have been the last scheduler's epoch record).
EPOCH_SKIP_AFTER_DAMAGE = 1_000


def next_epoch(last_epoch: int, calendar_s: float, *, damaged: bool = False) -> int:
    """The epoch of a scheduler that starts now: after the last one its journal records,
    and never below the wall clock's (whole seconds since :data:`EPOCH_ORIGIN_S`), so that
    epochs grow across restarts also without a journal. After damage it skips ahead
    (:data:`EPOCH_SKIP_AFTER_DAMAGE`): a lost epoch record of a predecessor that started
    within the same second must not be reused."""
    epoch = max(last_epoch + 1, int(calendar_s) - EPOCH_ORIGIN_S, 1)
    return epoch + EPOCH_SKIP_AFTER_DAMAGE if damaged else epoch


class SchedulerService:
    """See the module docstring."""

    def __init__(self, config: ServiceConfig, *, agents: Mapping[int, AgentPort] | None = None,
                 metrics: ServiceMetricsSink | None = None,
                 wall: Callable[[], float] = time.monotonic,
                 calendar: Callable[[], float] = time.time,
                 journal_opener: JournalOpener = open_journal_file) -> None:
        self.config = config
        #: Opens the journal file (a test injects one whose writes fail on demand).
        self._journal_opener = journal_opener
        self.policy = config.policy_spec
        self.clock = ServiceClock(config.time_compression, wall=wall)
        self._wall = wall
        #: Unix seconds: the epoch's floor and the journal's time checks.
        self._calendar = calendar
        #: This incarnation's epoch (set by :meth:`start`); every order id carries it.
        self.epoch = 0
        self._metrics: ServiceMetricsSink = metrics or NullMetrics()
        self.orders = OrderBook(config.fleet.nodes)
        self.fleet = LiveFleet(config.fleet, self.orders)
        self.fanout = AgentFanout(agents or {}, self._unsent)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        #: The outboxes of the calls of a :meth:`batch` under way (None: none).
        self._batched: list[Outbox] | None = None
        self._driver: LiveDriver | None = None
        self._journal: LiveJournalWriter | None = None
        #: The background compaction under way, if any.
        self._compactor: threading.Thread | None = None
        #: Records the journal kept at its last compaction (the next waits for as many).
        self._journal_kept = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_sync = 0.0
        self._ring = ShardRing(config.shards)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SchedulerService:
        """Load the predictor, replay the journal if there is one, open it for appending
        and start the control loop. Raises ConfigError / PluginError on a bad config."""
        if self._driver is not None:
            return self
        from kvprefetch.predictors.registry import load as load_predictor

        predictor = load_predictor(self.policy.predictor or self.config.predictor)
        # Suffix eviction cuts entries back to whole chunks of the agents' size.
        core = SchedulerCore(self.config.fleet, self.policy, predictor, self.fleet,
                             chunk_tokens=self.config.chunk_tokens,
                             tenant_quotas=self.config.tenant_quotas)
        driver = LiveDriver(self.config, core, self.fleet, self.orders, self.clock,
                            self._metrics, self._wall)
        # Node slots without an agent yet are out until their agent says hello (a journal
        # replayed next brings back those its events prove had joined).
        driver.mark_out(range(self.config.nodes_at_start, self.config.fleet.nodes), Outbox())
        path = self.config.journal_path
        last_epoch, next_seq = 0, 1
        if path is not None and Path(path).exists() and Path(path).stat().st_size > 0:
            scan = self._resume(driver, Path(path))
            last_epoch, next_seq = scan.last_epoch, scan.last_seq + 1
            limit = self.config.journal_compact_records
            if limit and scan.records >= limit:
                self._compact_at_start(driver, Path(path))
        self.epoch = shard_epoch(next_epoch(last_epoch, self._calendar(),
                                            damaged=driver.stats.journal_quarantined > 0),
                                 self.config.shard, self.config.shards)
        self.orders.begin_epoch(self.epoch)
        if path is not None:
            self._journal = driver.journal = LiveJournalWriter(
                path, metadata=self._journal_metadata(), next_seq=next_seq,
                opener=self._journal_opener).open()
            self._journal.write_epoch(EpochRecord(self.epoch, self.clock.now_s(),
                                                  self._calendar(),
                                                  self.config.time_compression))
            self._journal.flush(sync=True)
        self._driver = driver
        self._attach_metric_readers()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvprefetch-scheduler",
                                        daemon=True)
        self._thread.start()
        nodes = self.config.fleet.nodes
        log.info("scheduler service started: epoch %d, policy %s, %d of %d nodes in the "
                 "fleet, compression %g", self.epoch, self.policy.name,
                 nodes - len(driver.out_nodes), nodes, self.config.time_compression)
        return self

    def _resume(self, driver: LiveDriver, path: Path) -> LiveJournalScanner:
        """Replay the journal; quarantine its damaged records (never fail start-up on
        them: Ray would restart the scheduler into the same record forever). Returns the
        scan (last epoch, last sequence number, records read)."""
        scan = driver.resume(path, TimeLimits(now_wall_s=self._calendar()))
        damaged = scan.damaged
        if damaged:
            driver.stats.journal_quarantined = len(damaged)
            try:
                side = quarantine(path, damaged, wall_s=self._calendar())
            except OSError as exc:  # the records were skipped all the same
                log.error("journal %s: could not quarantine %d damaged records: %s", path,
                          len(damaged), exc)
            else:
                lines = ", ".join(f"{d.line} ({d.reason})" for d in damaged[:10])
                log.warning("journal %s: %d damaged records skipped and moved to %s: lines %s%s",
                            path, len(damaged), side, lines,
                            " ..." if len(damaged) > 10 else "")
        return scan

    def _journal_metadata(self) -> dict[str, Any]:
        return {"source": "kvprefetch-service", "policy": self.policy.name,
                "time_compression": self.config.time_compression}

    def _compact_at_start(self, driver: LiveDriver, path: Path) -> None:
        """Before the writer opens it: the journal without closed sessions' records (a
        failure is logged; the journal stays as it was)."""
        t0 = self._wall()
        try:
            result = compact_journal(path, metadata=self._journal_metadata())
        except OSError as exc:
            log.error("journal %s: compaction failed: %s", path, exc)
            return
        if result.damaged:
            log.error("journal %s: not compacted: %d damaged records left in it", path,
                      result.damaged)
            return
        self._journal_kept = result.records_after
        driver.stats.journal_compactions += 1
        driver.stats.journal_records_dropped += result.records_before - result.records_after
        log.info("journal %s compacted at start-up in %.2f s: %d records -> %d (%.1f -> "
                 "%.1f MiB)", path, self._wall() - t0, result.records_before,
                 result.records_after, result.bytes_before / (1 << 20),
                 result.bytes_after / (1 << 20))

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._compactor is not None:  # it gives up once it sees _stopping
            self._compactor.join(timeout=60)
            self._compactor = None
        if self._journal is not None:
            with self._lock:
                try:  # the journal's last record says the scheduler stopped cleanly
                    self._journal.write_stop(StopRecord(self.epoch, self.clock.now_s(),
                                                        self._calendar()))
                    self._journal.flush(sync=True)
                except (JournalUnavailableError, OSError) as exc:
                    log.error("journal %s: not closed cleanly: %s", self._journal.path, exc)
                self._journal.close()
                self._journal = None

    def check_health(self) -> None:
        """Raise :class:`JournalUnavailableError` while the journal takes no records (after
        a failed write; see :meth:`LiveJournalWriter.check_writable`). For ``/healthz`` and
        the actor's ``ping``; no I/O while the journal is healthy."""
        journal = self._journal
        if journal is not None:
            journal.check_writable()

    def __enter__(self) -> SchedulerService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def driver(self) -> LiveDriver:
        if self._driver is None:
            raise ConfigError("the scheduler service is not started; call start()")
        return self._driver

    @property
    def metrics(self) -> ServiceMetricsSink:
        return self._metrics

    @metrics.setter
    def metrics(self, sink: ServiceMetricsSink) -> None:
        """Swap the sink (e.g. a Prometheus registry created after start)."""
        self._metrics = sink
        if self._driver is not None:
            self._driver.metrics = sink
            self._attach_metric_readers()

    def _attach_metric_readers(self) -> None:
        """Let the metrics sink read the scheduler's gauges and the tenants' share books
        when it is read (counting a tenant's bytes scans every node's books: not per
        event)."""
        self._metrics.scheduler_gauges_from(self._gauges)
        if self.core.shares is not None:
            self._metrics.tenant_shares_from(self._share_books)

    def _gauges(self) -> SchedulerGauges:
        with self._lock:
            st = self.core.stats
            return SchedulerGauges(
                {self.node_name(n): self.orders.count(n) for n in range(self.config.fleet.nodes)},
                st.wasted_bytes, st.prefetch_used_bytes, st.prefetches_over_budget,
                st.warmup_bytes,
                {self.node_name(n): t.capacity_bytes for n, t in enumerate(self.core.dram)},
                orders_failed=self.stats.orders_failed, orders_lost=self.stats.orders_lost,
                loop_errors=self.stats.loop_errors)

    def _share_books(self) -> tuple[dict[tuple[str, str], int],
                                    dict[str, TenantQuotaStats]]:
        with self._lock:
            shares = self.core.shares
            assert shares is not None
            return ({(t, self.node_name(n)): b
                     for (t, n), b in shares.tier_bytes(self.core.dram).items()},
                    {t: replace(st) for t, st in shares.stats.items()})

    @property
    def core(self) -> SchedulerCore:
        return self.driver.core

    @property
    def stats(self) -> ServiceStats:
        return self.driver.stats

    @property
    def registry(self) -> SessionRegistry:
        return self.driver.registry

    def node_name(self, node: int) -> str:
        return self.driver.node_name(node)

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.config.fleet.nodes:
            raise InvalidRequestError(
                f"node {node} out of range (the fleet has {self.config.fleet.nodes} nodes)")

    @contextmanager
    def _step(self) -> Iterator[Outbox]:
        """Decide under the lock, then send what was decided (in a :meth:`batch`: when
        the batch ends)."""
        box = Outbox()
        with self._lock:
            yield box
            if self._batched is not None:
                self._batched.append(box)
                return
            self._wake.notify_all()  # new orders may be due before the loop's next wake-up
        self.fanout.send(box)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Many calls as one step (the actor's batched events and routes): the lock held
        across them, the control loop woken once, every call's messages sent once the
        lock is released. A call that fails inside still fails alone: the messages of
        those before it are sent."""
        boxes: list[Outbox] = []
        with self._lock:
            outer, self._batched = self._batched, boxes
            try:
                yield
            finally:
                self._batched = outer
                if outer is None:
                    self._wake.notify_all()
        if outer is not None:
            outer.extend(boxes)
            return
        for box in boxes:
            self.fanout.send(box)

    # ------------------------------------------------------------------ gateway calls
    def _check_owner(self, tenant: str, session_id: str) -> None:
        """Refuse a session another shard owns (a client that hashes to the wrong shard
        would otherwise split one session's state between two)."""
        if self.config.shards > 1:
            owner = self._ring.owner(tenant, session_id)
            if owner != self.config.shard:
                raise WrongShardError(
                    f"session {session_id!r} of tenant {tenant!r} belongs to shard {owner} "
                    f"of {self.config.shards}, not to this shard {self.config.shard}")

    def _admit(self, call: _Call) -> _Call:
        """Check ``call`` against the limits and hash its token ids, outside the lock."""
        check_call(call, self.config.limits, self.config.chunk_tokens)
        self._check_owner(call.tenant, call.session_id)
        if isinstance(call, api.RouteQuery | api.RequestStarted):
            return cast(_Call, prehash(call, self.config.chunk_tokens))
        return call

    def request_started(self, call: api.RequestStarted | api.RouteQuery | dict[str, Any]
                        ) -> api.Ack:
        started: api.RequestStarted | api.RouteQuery = self._admit(
            api.parse(api.RequestStarted, call) if isinstance(call, dict) else call)
        with self._step() as box:
            self.driver.start_request(started, box)
        return api.ACCEPTED

    def route(self, call: api.RouteQuery | dict[str, Any]) -> api.RouteAnswer:
        """Pick the node for a request; records ``request_started`` when the gateway has
        not sent it for this request."""
        checked: api.RouteQuery = self._admit(
            api.parse(api.RouteQuery, call) if isinstance(call, dict) else call)
        with self._step() as box:
            return self.driver.route(checked, box)

    def request_finished(self, call: api.RequestFinished | dict[str, Any]) -> api.Ack:
        checked: api.RequestFinished = self._admit(
            api.parse(api.RequestFinished, call) if isinstance(call, dict) else call)
        self._check_node(checked.node)
        with self._step() as box:
            self.driver.request_finished(checked, box)
        return api.ACCEPTED

    def hint(self, call: api.HintCall | dict[str, Any]) -> api.Ack:
        checked: api.HintCall = self._admit(
            api.parse(api.HintCall, call) if isinstance(call, dict) else call)
        with self._step() as box:
            self.driver.hint(checked, box)
        return api.ACCEPTED

    def session_closed(self, call: api.SessionClosed | dict[str, Any]) -> api.Ack:
        checked: api.SessionClosed = self._admit(
            api.parse(api.SessionClosed, call) if isinstance(call, dict) else call)
        with self._step() as box:
            self.driver.session_closed(checked, box)
        return api.ACCEPTED

    def session_state(self, call: SessionQuery | dict[str, Any]) -> SessionState:
        """The caller's live session; UnknownSessionError (404) when its tenant has none by
        that id, whoever else uses it. Read-only."""
        if isinstance(call, dict):
            try:
                call = SessionQuery.model_validate(call)
            except ValidationError as exc:
                raise InvalidRequestError(f"invalid SessionQuery: {exc}") from None
        check_call(call, self.config.limits)
        self._check_owner(call.tenant, call.session_id)
        with self._lock:
            return self.driver.session_state(call)

    # ------------------------------------------------------------------ engine calls
    def gpu_start(self, node: int, tenant: str, session_id: str, reused_tokens: int
                  ) -> GpuStartPlan:
        """The node's GPU picks the request up: the core may start its demand load; the
        engine waits for the order it is told of, then reads its local tier."""
        self._check_node(node)
        self._check_owner(tenant, session_id)
        with self._step() as box:
            return self.driver.gpu_start(node, tenant, session_id, reused_tokens, box)

    def use_local(self, node: int, tenant: str, session_id: str, reused_tokens: int,
                  done: TransferReport | None = None) -> int:
        """The engine is about to read its local tier: apply the report of the order it
        waited for (it may arrive here before the agent's own report), mark the DRAM entry
        read, and return the booked usable tokens."""
        self._check_owner(tenant, session_id)
        if done is not None:
            self.report_transfer(done)
        with self._lock:
            return self.driver.use_local(node, tenant, session_id, reused_tokens)

    def engine_report(self, report: EngineReport) -> None:
        self._check_node(report.node)
        with self._lock:
            self.driver.engine_report(report)

    # ------------------------------------------------------------------ agent calls
    def agent_hello(self, hello: AgentHello) -> None:
        """An agent (re)started: orders sent to its previous incarnation are lost (re-plan
        them); reconcile the node's books with what its tier really holds. The agent of a
        node out of the fleet (``initial_nodes``) joins it: the node is warmed with idle
        sessions whose KV is local nowhere, and routed to from now on."""
        self._check_node(hello.node)
        with self._step() as box:
            self.driver.agent_hello(hello, box)

    def node_status(self, status: AgentStatus) -> None:
        """An agent's periodic report of its tier: this shard's quota of the node follows
        the capacity it reports (:meth:`LiveDriver.node_status`)."""
        self._check_node(status.node)
        with self._step() as box:
            self.driver.node_status(status, box)

    def tier_evicted(self, evictions: TierEvictions) -> None:
        """The node's tier evicted these sessions' chunks by its own order: their books
        entries go (:meth:`LiveDriver.tier_evicted`)."""
        self._check_node(evictions.node)
        with self._step() as box:
            self.driver.tier_evicted(evictions, box)

    def report_transfer(self, report: TransferReport) -> None:
        """An agent finished (or gave up) an order. Idempotent per order id."""
        with self._step() as box:
            self.driver.report_transfer(report, box)

    def _unsent(self, order: TransferOrder, why: str) -> None:
        """An order could not be handed to its agent (called by the fan-out)."""
        with self._step() as box:
            self.driver.unsent(order, why, box)

    # ------------------------------------------------------------------ control loop
    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                delay = self.config.loop_interval_s
                timers = self._driver.timers if self._driver is not None else []
                if timers:
                    delay = min(delay, self.clock.wall_delay_s(timers[0][0]))
                if delay > 0:
                    self._wake.wait(delay)
                if self._stopping:
                    return
            try:
                self._tick()
            except Exception:  # the loop never dies: log, count, continue
                self.stats.loop_errors += 1
                log.exception("scheduler loop iteration failed")

    def _tick(self) -> None:
        wall = self._wall()
        with self._step() as box:
            now = self.clock.now_s()
            self.driver.fire_due(now, box)
            self.driver.sweep(now, box)
            self.driver.expire(wall, now, box)
            self.stats.plan_step_s.append(self._wall() - wall)
            self.stats.plan_steps += 1
        if self._journal is not None:
            sync = wall - self._last_sync > self.config.journal_sync_interval_s
            if sync:
                self._last_sync = wall
            self._journal.flush(sync=sync)
            self._maybe_compact()

    # ------------------------------------------------------------------ compaction
    def _maybe_compact(self) -> None:
        """From the loop: compact in the background once ``journal_compact_records``
        records (and as many as the last compaction kept) were written since."""
        limit, driver = self.config.journal_compact_records, self._driver
        if not limit or self._journal is None or driver is None or (
                self._compactor is not None and self._compactor.is_alive()):
            return
        if driver.journal_records < max(limit, self._journal_kept):
            return
        self._compactor = threading.Thread(target=self.compact_journal,
                                           name="kvprefetch-journal-compaction", daemon=True)
        self._compactor.start()

    def compact_journal(self) -> bool:
        """Compact the journal while the service runs: under the lock, note where the
        journal ends and which sessions are live; without it, copy their records to a new
        file; under the lock again, append what was written meanwhile, rename the copy
        over the journal and reopen the writer on it. Returns whether it compacted (a
        failure is logged and counted in ``loop_errors``; the journal stays as it was)."""
        journal, driver = self._journal, self._driver
        if journal is None or driver is None:
            return False
        path, t0 = journal.path, self._wall()
        try:
            with self._lock:
                journal.flush()
                upto = path.stat().st_size
                live = {info.sid for info in driver.registry}
                written, driver.journal_records = driver.journal_records, 0
            records, read, damaged = live_records(path, upto, live)
            if damaged:
                log.error("journal %s: not compacted: %d damaged records (the next start "
                          "quarantines them)", path, damaged)
                with self._lock:
                    driver.journal_records += written
                return False
            tmp = write_compacted(path, records, self._journal_metadata())
            with self._lock:
                if self._stopping or self._journal is not journal:
                    tmp.unlink(missing_ok=True)
                    return False
                journal.flush()
                size = publish_compacted(tmp, path, upto)
                journal.close()
                journal.open()
                self._journal_kept = len(records) + 1
                driver.stats.journal_compactions += 1
                driver.stats.journal_records_dropped += read - len(records) - 1
        except Exception:
            driver.stats.loop_errors += 1
            log.exception("journal %s: compaction failed; the journal stays as it was", path)
            return False
        log.info("journal %s compacted in %.2f s: %d records -> %d (%d live sessions, "
                 "%.1f MiB)", path, self._wall() - t0, read, len(records) + 1, len(live),
                 size / (1 << 20))
        return True

    # ------------------------------------------------------------------ introspection
    def sessions(self) -> int:
        with self._lock:
            return len(self.registry)

    def has_session(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            return self.registry.get(SessionKey(tenant, session_id)) is not None

    def summary(self) -> dict[str, Any]:
        with self._lock:
            out = self.driver.summary()
        if self.config.shards > 1:
            out["shard"], out["shards"] = self.config.shard, self.config.shards
        return out
