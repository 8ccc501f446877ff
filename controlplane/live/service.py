"""The live scheduler: :class:`SchedulerCore` on a wall clock, fed by the gateway, the
engines and the prefetch agents.

``SchedulerService`` is a plain class (the Ray actor in
:mod:`kvprefetch.controlplane.live.ray_app` wraps it; tests drive it directly) that
implements :class:`~kvprefetch.controlplane.live.protocol.SchedulerAPI`. It is a thin driver
of the core, in rooms:

* :class:`~kvprefetch.controlplane.live.driver.LiveDriver`: the decisions under the lock
  (sessions, orders, the fleet's members, transfer outcomes): every session event is
  journalled, then applied by ``LiveDriver.apply``, the one path that live calls and
  resume share;
* :class:`~kvprefetch.controlplane.journal.lifecycle.ServiceJournal`: the journal over
  the service's life (replay and quarantine at start, fail-closed writes, fsync on the
  loop's interval, compaction, the stop record);
* :class:`~kvprefetch.controlplane.live.ports.AgentFanout`: the core's decisions
  (:class:`~kvprefetch.controlplane.core.step.StepOutput`) carried out as messages to the
  agents;
* a control loop that fires armed prefetch orders, re-plans idle sessions every sweep
  interval, expires lost orders and flushes the journal; it logs and counts every failure
  and never dies.

Incarnations: each start replays the journal, then takes the next epoch
(:func:`next_epoch`, journalled); every order id carries it, so agents and reports never
confuse this incarnation's orders with a predecessor's.

Fleet changes: ``fleet.nodes`` is the capacity; nodes from ``initial_nodes`` on are out of
the fleet at start (the core's ``node_left``) and join when their agent first says hello
(``node_joined``: routed to from then on, warmed with idle sessions whose KV is local
nowhere), counted in the summary's ``nodes_joined``.

Idempotent routes: a route with a ``request_id`` is applied once; a retry with the id
answers the first answer, also after a restart (the answer is journalled), and
:meth:`SchedulerService.cancel_route` undoes a route whose answer the caller never used
(:mod:`kvprefetch.controlplane.live.routes.ledger`).

Limits and tenancy: every gateway call is checked against ``config.limits`` (names,
list lengths, token-id range) before it touches any state, and token ids are hashed into
chunk keys before the lock is taken, so one large request never holds up the small ones.
Sessions are keyed by (tenant, session id); a new session is refused with
:class:`~kvprefetch.controlplane.live.tenants.TenantQuotaError` while its tenant holds
``max_live_sessions`` live ones. With ``shards > 1`` a session another shard owns is
refused with :class:`~kvprefetch.controlplane.base.errors.WrongShardError`.

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
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pydantic import ValidationError

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import (
    ConfigError,
    InvalidRequestError,
    WrongShardError,
)
from kvprefetch.controlplane.base.scheduler_api import NodeAPI
from kvprefetch.controlplane.base.shards import ShardRing, shard_epoch
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    HbmReport,
    TierEvictions,
    TransferOrder,
    TransferReport,
)
from kvprefetch.controlplane.core.quotas import TenantQuotaStats
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.journal.lifecycle import ServiceJournal
from kvprefetch.controlplane.journal.writer import JournalOpener, open_journal_file
from kvprefetch.controlplane.live.config import ServiceClock, ServiceConfig
from kvprefetch.controlplane.live.driver import LiveDriver, check_node
from kvprefetch.controlplane.live.fleet import LiveFleet
from kvprefetch.controlplane.live.limits import check_call, prehash
from kvprefetch.controlplane.live.node_registry import NodeListing
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
from kvprefetch.controlplane.live.protocol import SchedulerAPI
from kvprefetch.controlplane.live.routes.calls import cancel_route, route_once
from kvprefetch.controlplane.live.routes.claims import ClaimHolder, RequestIdClaims
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionRegistry, SessionState
from kvprefetch.controlplane.live.summary import driver_summary

log = logging.getLogger(__name__)

#: The calls of the gateway that record a session event.
_GatewayCall = (api.RouteQuery | api.RequestStarted | api.RequestFinished | api.HintCall
                | api.SessionClosed)
_Call = TypeVar("_Call", bound=_GatewayCall)
_Answer = TypeVar("_Answer")

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
        #: ``journal_opener`` opens the journal file (a test injects one whose writes fail).
        self.journal = ServiceJournal(config, self.clock, self._lock, wall=wall,
                                      calendar=calendar, opener=journal_opener,
                                      stopping=lambda: self._stopping)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ring = ShardRing(config.shards)
        #: The request ids that hash to this shard, claimed for their sessions.
        self._claims = RequestIdClaims(config.route_memory_per_tenant)

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
        driver.members.mark_out(range(self.config.nodes_at_start, self.config.fleet.nodes),
                                Outbox())
        last_epoch, next_seq = self.journal.replay(driver)
        self.epoch = shard_epoch(next_epoch(last_epoch, self._calendar(),
                                            damaged=driver.stats.journal_quarantined > 0),
                                 self.config.shard, self.config.shards)
        self.orders.begin_epoch(self.epoch)
        self.journal.open(driver, next_seq, self.epoch)
        self._driver = driver
        self._attach_metric_readers()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvprefetch-scheduler",
                                        daemon=True)
        self._thread.start()
        nodes = self.config.fleet.nodes
        log.info("scheduler service started: epoch %d, policy %s, %d of %d nodes in the "
                 "fleet, compression %g", self.epoch, self.policy.name,
                 nodes - len(driver.members.out_nodes), nodes, self.config.time_compression)
        return self

    def close(self) -> None:
        """Stop the control loop, then end the journal with a stop record. Idempotent."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.journal.close(self.epoch)

    def check_health(self) -> None:
        """Raise :class:`JournalUnavailableError` while the journal takes no records (after
        a failed write; see :meth:`LiveJournalWriter.check_writable`). For ``/healthz`` and
        the actor's ``ping``; no I/O while the journal is healthy."""
        self.journal.check_health()

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
                loop_errors=self.stats.loop_errors, bets_won=st.bets_won,
                bets_lost=st.bets_lost,
                agent_orders_deferred={self.node_name(n): w[0]
                                       for n, w in self.stats.agent_warming.items()},
                agent_orders_dropped_late={self.node_name(n): w[1]
                                           for n, w in self.stats.agent_warming.items()})

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

    @contextmanager
    def try_batch(self) -> Iterator[bool]:
        """A :meth:`batch` if no other thread holds the lock now: True inside it; else
        False at once, nothing held (the caller runs its batch where it may wait). Lets
        an event loop apply calls in place while the service is free, and never block
        on the control loop's step."""
        if not self._lock.acquire(blocking=False):
            yield False
            return
        try:
            with self.batch():
                yield True
        finally:
            self._lock.release()

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

    def _gateway_call(self, kind: type[_GatewayCall], call: _GatewayCall | dict[str, Any],
                      decide: Callable[[LiveDriver, Any, Outbox], _Answer]) -> _Answer:
        """Every gateway call: a dict is parsed as ``kind`` at this edge; the call is checked
        against the limits and the shard ring and its token ids hashed, outside the lock;
        then the driver's ``decide`` runs under it (:meth:`_step`)."""
        parsed: _GatewayCall = api.parse(kind, call) if isinstance(call, dict) else call
        checked = self._admit(parsed)
        with self._step() as box:
            return decide(self.driver, checked, box)

    def request_started(self, call: api.RequestStarted | api.RouteQuery | dict[str, Any]
                        ) -> api.Ack:
        self._gateway_call(api.RequestStarted, call, LiveDriver.start_request)
        return api.ACCEPTED

    def route(self, call: api.RouteQuery | dict[str, Any]) -> api.RouteAnswer:
        """Pick the node for a request; records ``request_started`` when the gateway has
        not sent it for this request. Idempotent per ``request_id`` (a call again with the
        id answers the first answer, RequestIdConflictError for another body):
        :func:`~kvprefetch.controlplane.live.routes.calls.route_once`."""
        return self._gateway_call(api.RouteQuery, call, route_once)

    def cancel_route(self, call: api.RouteCancel | dict[str, Any]) -> api.RouteCancelled:
        """Undo the route of ``call.request_id``, whose request the caller abandoned;
        idempotent (:func:`~kvprefetch.controlplane.live.routes.calls.cancel_route` says what undo
        means)."""
        parsed: api.RouteCancel = (api.parse(api.RouteCancel, call) if isinstance(call, dict)
                                   else call)
        check_call(parsed, self.config.limits)
        self._check_owner(parsed.tenant, parsed.session_id)
        with self._step() as box:
            return cancel_route(self.driver, parsed, box)

    def request_finished(self, call: api.RequestFinished | dict[str, Any]) -> api.Ack:
        """The response ended on ``call.node``; a finish on no node (``node`` None) is
        answered ``accepted=False`` and not recorded (:meth:`LiveDriver.request_finished`)."""
        return self._gateway_call(api.RequestFinished, call, LiveDriver.request_finished)

    def hint(self, call: api.HintCall | dict[str, Any]) -> api.Ack:
        """A typed hint; a ``session_closed`` hint closes the session as
        :meth:`session_closed` does."""
        self._gateway_call(api.HintCall, call, LiveDriver.hint)
        return api.ACCEPTED

    def session_closed(self, call: api.SessionClosed | dict[str, Any]) -> api.Ack:
        self._gateway_call(api.SessionClosed, call, LiveDriver.session_closed)
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
        check_node(node, self.config.fleet.nodes)
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
        check_node(report.node, self.config.fleet.nodes)
        with self._lock:
            self.driver.engine_report(report)

    # ------------------------------------------------------------------ agent calls
    def agent_hello(self, hello: AgentHello) -> None:
        """An agent (re)started: orders sent to its previous incarnation are lost (re-plan
        them); reconcile the node's books with what its tier really holds. The agent of a
        node out of the fleet (``initial_nodes``) joins it: the node is warmed with idle
        sessions whose KV is local nowhere, and routed to from now on."""
        check_node(hello.node, self.config.fleet.nodes)
        with self._step() as box:
            self.driver.members.agent_hello(hello, box)

    def node_status(self, status: AgentStatus) -> None:
        """An agent's periodic report of its tier: this shard's quota of the node follows
        the capacity it reports (:meth:`FleetMembership.node_status`)."""
        check_node(status.node, self.config.fleet.nodes)
        with self._step() as box:
            self.driver.members.node_status(status, box)

    def tier_evicted(self, evictions: TierEvictions) -> None:
        """The node's tier evicted these sessions' chunks by its own order: their books
        entries go (:meth:`FleetMembership.tier_evicted`)."""
        check_node(evictions.node, self.config.fleet.nodes)
        with self._step() as box:
            self.driver.members.tier_evicted(evictions, box)

    def hbm_changed(self, report: HbmReport) -> None:
        """The node's engine's HBM prefix cache changed: the node's HBM mirror follows
        (:meth:`FleetMembership.hbm_changed`)."""
        check_node(report.node, self.config.fleet.nodes)
        with self._step() as box:
            self.driver.members.hbm_changed(report, box)

    def nodes(self) -> NodeListing:
        """The node registry: each slot, whether it is routed to, its engine's URL."""
        with self._lock:
            return self.driver.members.listing()

    def node_left(self, node: int) -> None:
        """The deployment lost ``node`` (its Ray node died): out of the fleet until an
        agent of its slot says hello again (:meth:`FleetMembership.node_lost`)."""
        check_node(node, self.config.fleet.nodes)
        with self._step() as box:
            self.driver.members.node_lost(node, box)

    def report_transfer(self, report: TransferReport) -> None:
        """An agent finished (or gave up) an order. Idempotent per order id."""
        with self._step() as box:
            self.driver.transfers.report(report, box)

    def _unsent(self, order: TransferOrder, why: str) -> None:
        """An order could not be handed to its agent (called by the fan-out)."""
        with self._step() as box:
            self.driver.transfers.unsent(order, why, box)

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
            self.driver.transfers.expire(wall, now, box)
            self.stats.plan_step_s.append(self._wall() - wall)
            self.stats.plan_steps += 1
        self.journal.tick(wall)

    def compact_journal(self) -> bool:
        """Compact the journal now, while serving (:meth:`ServiceJournal.compact`): whether
        it did."""
        return self.journal.compact()

    # ------------------------------------------------------------------ introspection
    def sessions(self) -> int:
        with self._lock:
            return len(self.registry)

    def has_session(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            return self.registry.get(SessionKey(tenant, session_id)) is not None

    def claim_request_id(self, tenant: str, request_id: str, session_id: str,
                         replacing: str | None = None) -> ClaimHolder | None:
        """Claim a route's request id that hashes to this shard for ``session_id``
        (:mod:`~kvprefetch.controlplane.live.routes.claims`): None when claimed, else the
        other session that holds it."""
        with self._lock:
            return self._claims.claim(tenant, request_id, session_id, time.monotonic(),
                                      replacing)

    def remembers_route(self, tenant: str, request_id: str, session_id: str) -> bool:
        """Whether this shard remembers route ``request_id`` of that session (its request
        has not ended). Read-only."""
        with self._lock:
            memo = self.driver.routes.get(tenant, request_id)
            return memo is not None and memo.session_id == SessionKey(tenant, session_id).wire

    def summary(self) -> dict[str, Any]:
        with self._lock:
            out = driver_summary(self.driver)
            out["routes_remembered"] = len(self.driver.routes)
            out["routes_forgotten"] = self.driver.routes.forgotten
        if self.config.shards > 1:
            out["shard"], out["shards"] = self.config.shard, self.config.shards
        return out


if TYPE_CHECKING:  # mypy checks the service against the Protocols its callers rely on
    _SCHEDULER: type[SchedulerAPI] = SchedulerService
    _NODES: type[NodeAPI] = SchedulerService
