"""The live scheduler: :class:`SchedulerCore` on a wall clock, fed by the gateway, the
engines and the prefetch agents.

``SchedulerService`` is a plain class (the Ray actor in :mod:`controlplane.live.ray_app` wraps
it; tests drive it directly). It

* validates and journals every session event (:class:`~controlplane.traces.JournalWriter`,
  the format ``kvprefetch sim --trace`` and ``kvprefetch train`` read) and feeds it to the
  core;
* is the core's :class:`~controlplane.core.scheduler.FleetView`, built from what the engines and
  agents report (HBM contents, transfers in flight) and its own queue estimates;
* turns the core's decisions into :class:`~controlplane.base.wire.TransferOrder` messages for the
  node's agent (demand loads at once, prefetches at their ``start_at_s``), and its book
  evictions into evict advice;
* runs a control loop thread that fires armed prefetch orders, expires lost orders and
  flushes the journal; the loop logs and counts every failure and never dies.

Threading: every public method may be called from any thread; one lock guards the core.
Messages to agents are sent after the lock is released.

Resuming: on ``start`` an existing journal is replayed into a fresh core (sessions, the
predictor's history, hints), the clock continues after its last event, and the books of
each node's local tier are reconciled with the agent's inventory when it reports.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from controlplane.base import api
from controlplane.base.config import FleetConfig, default_fleet
from controlplane.base.errors import (
    ConfigError,
    InvalidRequestError,
    UnknownSessionError,
    WrongTenantError,
)
from controlplane.base.keys import (
    DEFAULT_CHUNK_TOKENS,
    chunk_count,
    chunk_hashes,
    session_keys,
    session_prefix,
)
from controlplane.base.types import EventKind, HintKind, SessionEvent
from controlplane.base.wire import (
    AgentHello,
    EngineReport,
    GpuStartPlan,
    TransferOrder,
    TransferReport,
)
from controlplane.core.planner import PrefetchOrder
from controlplane.core.policies import POLICIES, LoadStart, PolicySpec
from controlplane.core.scheduler import LoadTicket, SchedulerCore
from controlplane.traces.journal import JournalWriter, read_journal_events

log = logging.getLogger(__name__)
INF = float("inf")
DEMAND_PRIORITY = 100


class ServiceConfig(BaseModel):
    """The live scheduler's configuration (validated at start-up)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fleet: FleetConfig = Field(default_factory=lambda: default_fleet("8b", 2))
    policy: str = "predictive"
    predictor: str = "last-gap"
    #: Service seconds per wall second: 1 in production; >1 replays a trace faster (the
    #: demo). Every time the core sees is on this clock.
    time_compression: float = Field(1.0, gt=0, le=100_000)
    chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, gt=0, le=1 << 20)
    journal_path: str | None = None
    #: Fsync the journal every this many wall seconds (it is flushed to the OS each loop).
    journal_sync_interval_s: float = Field(5.0, gt=0)
    #: Allowed tenants; None = any.
    tenants: tuple[str, ...] | None = None
    #: Names of the nodes (index = node number), for answers and metrics.
    node_names: tuple[str, ...] | None = None
    #: Control-loop period when idle (wall seconds).
    loop_interval_s: float = Field(0.05, gt=0, le=5)
    #: An order not reported after this long (wall seconds) is given up and re-planned.
    order_timeout_s: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if POLICIES[self.policy].predictor == "oracle":
            raise ValueError("policy 'oracle' reads the future: simulator only")
        if self.node_names is not None and len(self.node_names) != self.fleet.nodes:
            raise ValueError(f"node_names has {len(self.node_names)} names for "
                             f"{self.fleet.nodes} nodes")
        return self

    @property
    def policy_spec(self) -> PolicySpec:
        return POLICIES[self.policy]


class ServiceClock:
    """Service seconds: ``offset_s + (wall - start) * compression``. ``wall_at`` maps a
    service time back to the wall clock (for timers)."""

    def __init__(self, compression: float = 1.0, *, offset_s: float = 0.0,
                 wall: Callable[[], float] = time.monotonic) -> None:
        self.compression = compression
        self._wall = wall
        self._start = wall()
        self.offset_s = offset_s

    def now_s(self) -> float:
        return self.offset_s + (self._wall() - self._start) * self.compression

    def continue_after(self, t_s: float) -> None:
        """Resume a clock so that now is just after ``t_s``."""
        self._start = self._wall()
        self.offset_s = t_s

    def wall_delay_s(self, at_s: float) -> float:
        return max(0.0, (at_s - self.now_s()) / self.compression)


class AgentPort(Protocol):
    """How the service reaches one node's agent. Calls must not block for long (they are
    fire-and-forget in Ray); ``inventory`` may block up to ``timeout_s``."""

    def execute(self, order: TransferOrder) -> None: ...

    def cancel(self, session_id: str, order_id: int) -> None: ...

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None: ...


class ServiceMetricsSink(Protocol):
    """Where the service reports measurements (Prometheus in :mod:`controlplane.live.metrics`)."""

    def event(self, kind: str) -> None: ...

    def ttlb(self, seconds: float, prefetch: bool) -> None: ...

    def lateness(self, seconds: float) -> None: ...

    def local_lookup(self, local_tokens: int, reused_tokens: int) -> None: ...

    def bytes_moved(self, nbytes: int, prefetch: bool) -> None: ...

    def orders_in_flight(self, node: str, count: int) -> None: ...

    def core_stats(self, wasted_bytes: int, useful_bytes: int) -> None: ...


class NullMetrics:
    def event(self, kind: str) -> None: ...
    def ttlb(self, seconds: float, prefetch: bool) -> None: ...
    def lateness(self, seconds: float) -> None: ...
    def local_lookup(self, local_tokens: int, reused_tokens: int) -> None: ...
    def bytes_moved(self, nbytes: int, prefetch: bool) -> None: ...
    def orders_in_flight(self, node: str, count: int) -> None: ...
    def core_stats(self, wasted_bytes: int, useful_bytes: int) -> None: ...


@dataclass(slots=True)
class _SessionInfo:
    tenant: str
    session_id: str
    turns: int = 0
    in_flight: bool = False
    context_tokens: int = 0
    hashes: tuple[str, ...] | None = None
    arrival_s: float = 0.0
    #: A prefetch still arriving at the chosen node when the request was routed.
    await_prefetch_node: int | None = None
    #: Where the request in flight was routed and its estimated service time there.
    node: int | None = None
    est_service_s: float = 0.0


@dataclass(slots=True)
class _Inflight:
    order: TransferOrder
    sent_wall_s: float
    incarnation: str


@dataclass(slots=True)
class _NodeState:
    queued_est_s: float = 0.0
    running_end_s: float = 0.0
    hbm: dict[str, int] = field(default_factory=dict)
    incarnation: str = ""
    orders: dict[int, _Inflight] = field(default_factory=dict)


@dataclass(slots=True)
class ServiceStats:
    events: int = 0
    routes: int = 0
    orders_sent: int = 0
    orders_done: int = 0
    orders_failed: int = 0
    orders_lost: int = 0
    #: Real bytes the agents moved (scaled by the engines' kv_scale).
    prefetch_bytes: int = 0
    demand_bytes: int = 0
    #: The same transfers at modelled size (the books: tokens x KV bytes per token).
    prefetch_model_bytes: int = 0
    demand_model_bytes: int = 0
    loop_errors: int = 0
    ttlb_s: list[float] = field(default_factory=list)
    lateness_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Outbox:
    """Messages decided under the lock, sent after it is released."""

    execute: list[TransferOrder] = field(default_factory=list)
    cancel: list[tuple[int, str, int]] = field(default_factory=list)
    evict: list[tuple[int, tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)


class SchedulerService:
    """See the module docstring."""

    def __init__(self, config: ServiceConfig, *, agents: Mapping[int, AgentPort] | None = None,
                 metrics: ServiceMetricsSink | None = None,
                 wall: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = config.policy_spec
        self.clock = ServiceClock(config.time_compression, wall=wall)
        self._wall = wall
        self._agents: dict[int, AgentPort] = dict(agents or {})
        self.metrics: ServiceMetricsSink = metrics or NullMetrics()
        self.stats = ServiceStats()
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._core: SchedulerCore | None = None
        self._sessions: dict[str, _SessionInfo] = {}
        self._owner: dict[str, str] = {}
        self._nodes = [_NodeState() for _ in range(config.fleet.nodes)]
        self._timers: list[tuple[float, int, PrefetchOrder]] = []
        self._seq = itertools.count()
        self._order_ids = itertools.count(1)
        self._by_session: dict[tuple[str, int], int] = {}
        self._booked: list[set[str]] = [set() for _ in range(config.fleet.nodes)]
        self._applied: set[int] = set()
        self._journal: JournalWriter | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_sync = 0.0
        bpt = config.fleet.model.kv_bytes_per_token
        remote = config.fleet.remote
        self._bpt = bpt
        self._valkey_s_per_byte = 1.0 / min(config.fleet.node.nic_bytes_per_s,
                                            remote.valkey_gbyte_s_per_node * 1e9)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SchedulerService:
        """Load the predictor, replay the journal if there is one, open it for appending
        and start the control loop. Raises ConfigError / PluginError on a bad config."""
        if self._core is not None:
            return self
        from predictors.registry import load as load_predictor

        spec = self.policy.predictor or self.config.predictor
        predictor = load_predictor(spec)
        self._core = SchedulerCore(self.config.fleet, self.policy, predictor, self)
        path = self.config.journal_path
        if path is not None and Path(path).exists() and Path(path).stat().st_size > 0:
            self._resume(Path(path))
        if path is not None:
            self._journal = JournalWriter(path, metadata={
                "source": "kvprefetch-service", "policy": self.policy.name,
                "time_compression": self.config.time_compression,
            }).open()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvprefetch-scheduler",
                                        daemon=True)
        self._thread.start()
        log.info("scheduler service started: policy %s, %d nodes, compression %g",
                 self.policy.name, self.config.fleet.nodes, self.config.time_compression)
        return self

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._journal is not None:
            self._journal.flush(sync=True)
            self._journal.close()
            self._journal = None

    def __enter__(self) -> SchedulerService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def core(self) -> SchedulerCore:
        if self._core is None:
            raise ConfigError("the scheduler service is not started; call start()")
        return self._core

    # ------------------------------------------------------------------ FleetView
    def queue_wait_s(self, node: int, now_s: float) -> float:
        n = self._nodes[node]
        return n.queued_est_s + max(0.0, n.running_end_s - now_s)

    def link_backlog_s(self, node: int, now_s: float) -> float:
        pending = sum(i.order.nbytes for i in self._nodes[node].orders.values())
        return pending * self._valkey_s_per_byte

    def hbm_tokens(self, node: int, session_id: str) -> int:
        return self._nodes[node].hbm.get(session_id, 0)

    def remote_source(self, session_id: str) -> tuple[float, float]:
        return self._valkey_s_per_byte, self.config.fleet.remote.valkey_latency_s

    # ------------------------------------------------------------------ helpers
    def node_name(self, node: int) -> str:
        names = self.config.node_names
        return names[node] if names is not None else f"node-{node}"

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.config.fleet.nodes:
            raise InvalidRequestError(
                f"node {node} out of range (the fleet has {self.config.fleet.nodes} nodes)")

    def _check_tenant(self, tenant: str, session_id: str) -> None:
        allowed = self.config.tenants
        if allowed is not None and tenant not in allowed:
            raise WrongTenantError(f"tenant {tenant!r} is not allowed")
        owner = self._owner.get(session_id)
        if owner is not None and owner != tenant:
            raise WrongTenantError(f"session {session_id!r} belongs to another tenant")

    def _known(self, tenant: str, session_id: str) -> _SessionInfo:
        self._check_tenant(tenant, session_id)
        info = self._sessions.get(f"{tenant}/{session_id}")
        if info is None:
            raise UnknownSessionError(f"unknown session {session_id!r} of tenant {tenant!r}")
        return info

    def keys_of(self, info: _SessionInfo, tokens: int) -> list[str]:
        return session_keys(info.tenant, info.session_id, tokens, self.config.chunk_tokens,
                            info.hashes)

    def load_keys(self, info: _SessionInfo, tokens: int) -> list[str]:
        """The stored chunks that hold the first ``tokens`` tokens of the session's context:
        the leading chunks of its stored context (``context_tokens``), the last one possibly
        longer than needed. (Naming the first ``tokens`` tokens on their own would name a
        partial chunk that was never stored whenever ``tokens`` falls inside a chunk.)"""
        keys = self.keys_of(info, max(tokens, info.context_tokens))
        return keys[:chunk_count(tokens, self.config.chunk_tokens)]

    def _record(self, event: SessionEvent) -> None:
        self.stats.events += 1
        self.metrics.event(event.kind.value)
        if self._journal is not None:
            # Handed to the OS at once: a killed service loses no acknowledged event (a
            # crashed machine may lose the last ones; fsync runs on the loop's interval).
            self._journal.write(event)
            self._journal.flush()

    # ------------------------------------------------------------------ gateway calls
    def request_started(self, call: api.RequestStarted | api.RouteQuery | dict[str, Any]
                        ) -> api.Ack:
        call = api.parse(api.RequestStarted, call) if isinstance(call, dict) else call
        with self._lock:
            self._start_request(call)
        return api.Ack()

    def _start_request(self, call: api.RequestStarted | api.RouteQuery) -> _SessionInfo:
        self._check_tenant(call.tenant, call.session_id)
        sid = f"{call.tenant}/{call.session_id}"
        info = self._sessions.get(sid)
        if info is None:
            info = self._sessions[sid] = _SessionInfo(call.tenant, call.session_id)
            self._owner[call.session_id] = call.tenant
        if call.token_ids is not None:
            info.hashes = tuple(chunk_hashes(call.token_ids, self.config.chunk_tokens))
        elif call.chunk_hashes is not None:
            info.hashes = tuple(call.chunk_hashes)
        now = self.clock.now_s()
        tokens = call.tokens
        reused = call.reused_tokens if call.reused_tokens is not None else min(
            tokens, info.context_tokens)
        event = SessionEvent(EventKind.REQUEST_STARTED, sid, now, info.turns, tokens, 0,
                             min(reused, tokens), node=None, tenant=call.tenant,
                             parent_id=call.parent_id)
        info.turns += 1
        info.in_flight = True
        info.arrival_s = now
        info.await_prefetch_node = None
        self._record(event)
        self.core.request_started(event)
        return info

    def route(self, call: api.RouteQuery | dict[str, Any]) -> api.RouteAnswer:
        """Pick the node for a request; records ``request_started`` when the gateway has
        not sent it for this request."""
        call = api.parse(api.RouteQuery, call) if isinstance(call, dict) else call
        box = _Outbox()
        with self._lock:
            sid = f"{call.tenant}/{call.session_id}"
            info = self._sessions.get(sid)
            if info is None or not info.in_flight:
                info = self._start_request(call)
            else:
                self._check_tenant(call.tenant, call.session_id)
            now = self.clock.now_s()
            tokens = call.tokens
            reused = call.reused_tokens if call.reused_tokens is not None else min(
                tokens, info.context_tokens)
            core = self.core
            decision = core.route(sid, tokens, reused, now)
            node = decision.node
            assignment = core.assign(sid, node, now)
            for other in assignment.cancel_nodes:
                oid = self._by_session.get((sid, other))
                if oid is not None:
                    box.cancel.append((other, sid, oid))
            if assignment.prefetch_ready_s is not None:
                if math.isinf(assignment.prefetch_ready_s):
                    info.await_prefetch_node = node
                else:
                    self._lateness(assignment.prefetch_ready_s - now)
            n = self._nodes[node]
            est = max(0.0, decision.estimated_ttft_s - self.queue_wait_s(node, now))
            if info.node is not None:  # routed again before it started: move the estimate
                prev = self._nodes[info.node]
                prev.queued_est_s = max(0.0, prev.queued_est_s - info.est_service_s)
            n.queued_est_s += est
            info.node, info.est_service_s = node, est
            if self.policy.load_start is LoadStart.ON_ARRIVAL:
                self._demand(info, node, reused, now, box)
            self.stats.routes += 1
            local_ready = core.local_tokens(node, sid) > 0
            self._collect(box)
        self._send(box)
        return api.RouteAnswer(node=node, node_name=self.node_name(node),
                               estimated_ttft_s=round(decision.estimated_ttft_s, 6),
                               local_ready=local_ready)

    def request_finished(self, call: api.RequestFinished | dict[str, Any]) -> api.Ack:
        call = api.parse(api.RequestFinished, call) if isinstance(call, dict) else call
        self._check_node(call.node)
        box = _Outbox()
        with self._lock:
            info = self._known(call.tenant, call.session_id)
            sid = f"{call.tenant}/{call.session_id}"
            now = self.clock.now_s()
            ctx = call.context_tokens if call.context_tokens is not None else (
                call.input_tokens + call.output_tokens)
            if call.chunk_hashes is not None:
                info.hashes = tuple(call.chunk_hashes)
            event = SessionEvent(EventKind.REQUEST_FINISHED, sid, now, max(0, info.turns - 1),
                                 call.input_tokens, call.output_tokens, 0, call.stop_reason,
                                 node=call.node, tenant=call.tenant)
            info.in_flight = False
            info.context_tokens = ctx
            self._record(event)
            self.core.request_finished(event, ctx)
            self._collect(box)
        self._send(box)
        return api.Ack()

    def hint(self, call: api.HintCall | dict[str, Any]) -> api.Ack:
        call = api.parse(api.HintCall, call) if isinstance(call, dict) else call
        box = _Outbox()
        with self._lock:
            info = self._known(call.tenant, call.session_id)
            sid = f"{info.tenant}/{info.session_id}"
            event = SessionEvent(EventKind.HINT, sid, self.clock.now_s(),
                                 max(0, info.turns - 1), hint=HintKind(call.hint.kind),
                                 eta_s=call.hint.eta_s, tenant=call.tenant)
            self._record(event)
            self.core.hint(event)
            self._collect(box)
        self._send(box)
        return api.Ack()

    def session_closed(self, call: api.SessionClosed | dict[str, Any]) -> api.Ack:
        call = api.parse(api.SessionClosed, call) if isinstance(call, dict) else call
        box = _Outbox()
        with self._lock:
            info = self._known(call.tenant, call.session_id)
            sid = f"{info.tenant}/{info.session_id}"
            event = SessionEvent(EventKind.SESSION_CLOSED, sid, self.clock.now_s(),
                                 max(0, info.turns - 1), tenant=call.tenant)
            self._record(event)
            self.core.hint(event)  # observes it; the predictor stops forecasting returns
            for node in range(self.config.fleet.nodes):
                oid = self._by_session.get((sid, node))
                if oid is not None:
                    box.cancel.append((node, sid, oid))
            self.core.forget(sid)
            self._sessions.pop(sid, None)
            self._owner.pop(info.session_id, None)
            self._collect(box)
        self._send(box)
        return api.Ack()

    # ------------------------------------------------------------------ engine calls
    def gpu_start(self, node: int, tenant: str, session_id: str, reused_tokens: int
                  ) -> GpuStartPlan:
        """The node's GPU picks the request up: dispatch its demand load (policies that
        load at schedule) or point at the prefetch still arriving; the engine waits for
        that order, then reads its local tier."""
        self._check_node(node)
        box = _Outbox()
        with self._lock:
            info = self._known(tenant, session_id)
            sid = f"{tenant}/{session_id}"
            now = self.clock.now_s()
            n = self._nodes[node]
            if info.node is not None:
                q = self._nodes[info.node]
                q.queued_est_s = max(0.0, q.queued_est_s - info.est_service_s)
            n.running_end_s = now + info.est_service_s
            info.node, info.est_service_s = None, 0.0
            oid = self._by_session.get((sid, node))
            dispatched = False
            if oid is None and self.policy.load_start is LoadStart.ON_SCHEDULE:
                oid = self._demand(info, node, reused_tokens, now, box)
                dispatched = oid is not None
            plan = GpuStartPlan()
            if oid is not None and oid in n.orders:
                plan = GpuStartPlan(oid, n.orders[oid].order.nbytes, dispatched)
            self._collect(box)
        self._send(box)
        return plan

    def use_local(self, node: int, tenant: str, session_id: str, reused_tokens: int,
                  done: TransferReport | None = None) -> int:
        """The engine is about to read its local tier: apply the report of the order it
        waited for (it may arrive here before the agent's own report), mark the DRAM entry
        read, and return the booked usable tokens."""
        if done is not None:
            self.report_transfer(done)
        with self._lock:
            self._known(tenant, session_id)
            sid = f"{tenant}/{session_id}"
            return self.core.use_local(sid, node, reused_tokens, self.clock.now_s())

    def engine_report(self, report: EngineReport) -> None:
        self._check_node(report.node)
        with self._lock:
            n = self._nodes[report.node]
            n.hbm[report.session_id] = report.context_tokens
            for sid in report.hbm_evicted:
                n.hbm.pop(sid, None)
            self.metrics.local_lookup(report.local_tokens, report.reused_tokens)

    # ------------------------------------------------------------------ agent calls
    def agent_hello(self, hello: AgentHello) -> None:
        """An agent (re)started: orders sent to its previous incarnation are lost (re-plan
        them); reconcile the node's books with what its tier really holds."""
        self._check_node(hello.node)
        box = _Outbox()
        with self._lock:
            n = self._nodes[hello.node]
            now = self.clock.now_s()
            lost = [i for i in n.orders.values() if i.incarnation != hello.incarnation]
            n.incarnation = hello.incarnation
            for inflight in lost:
                self._order_failed(inflight.order, now, "agent restarted")
                self.stats.orders_lost += 1
            if self._core is not None and hello.inventory is not None:
                self._reconcile(hello.node, set(hello.inventory), now)
            self._collect(box)
        self._send(box)
        log.info("agent on node %d (%s) is up: incarnation %s, %d keys in its tier",
                 hello.node, hello.node_name, hello.incarnation[:8], len(hello.inventory))

    def report_transfer(self, report: TransferReport) -> None:
        """An agent finished (or gave up) an order. Idempotent per order id."""
        box = _Outbox()
        with self._lock:
            if report.order_id in self._applied:
                return
            n = self._nodes[report.node]
            inflight = n.orders.get(report.order_id)
            if inflight is None:
                return  # already expired or from a previous service incarnation
            self._applied.add(report.order_id)
            now = self.clock.now_s()
            order = inflight.order
            if report.complete:
                self._finish_order(order)
                self.core.transfer_done(order.session_id, order.node, now,
                                        demand=not order.prefetch)
                self.stats.orders_done += 1
                ttlb = report.ttlb_wall_s * self.config.time_compression
                self.stats.ttlb_s.append(ttlb)
                self.metrics.ttlb(ttlb, order.prefetch)
                self.metrics.bytes_moved(report.bytes_moved, order.prefetch)
                if order.prefetch:
                    self.stats.prefetch_bytes += report.bytes_moved
                    self.stats.prefetch_model_bytes += order.nbytes
                else:
                    self.stats.demand_bytes += report.bytes_moved
                    self.stats.demand_model_bytes += order.nbytes
                info = self._sessions.get(order.session_id)
                if info is not None and info.await_prefetch_node == order.node:
                    info.await_prefetch_node = None
                    self._lateness(now - info.arrival_s)
            else:
                self._order_failed(order, now, report.error or "incomplete")
            self._collect(box)
        self._send(box)

    # ------------------------------------------------------------------ orders
    def _demand(self, info: _SessionInfo, node: int, reused: int, now: float,
                box: _Outbox) -> int | None:
        sid = f"{info.tenant}/{info.session_id}"
        ticket = self.core.demand_load(sid, node, reused, now)
        if ticket is None:
            return None
        return self._dispatch(ticket, info, box)

    def _dispatch(self, ticket: LoadTicket, info: _SessionInfo, box: _Outbox) -> int:
        oid = next(self._order_ids)
        keys = tuple(self.load_keys(info, ticket.tokens))
        order = TransferOrder(oid, ticket.session_id, ticket.node, keys, ticket.tokens,
                              ticket.nbytes, ticket.prefetch, ticket.deadline_s,
                              0 if ticket.prefetch else DEMAND_PRIORITY)
        n = self._nodes[ticket.node]
        n.orders[oid] = _Inflight(order, self._wall(), n.incarnation)
        self._by_session[(ticket.session_id, ticket.node)] = oid
        self.stats.orders_sent += 1
        box.execute.append(order)
        return oid

    def _finish_order(self, order: TransferOrder) -> None:
        self._nodes[order.node].orders.pop(order.order_id, None)
        if self._by_session.get((order.session_id, order.node)) == order.order_id:
            del self._by_session[(order.session_id, order.node)]

    def _order_failed(self, order: TransferOrder, now: float, why: str) -> None:
        self._finish_order(order)
        self._applied.add(order.order_id)
        self.core.transfer_cancelled(order.session_id, order.node)
        self.stats.orders_failed += 1
        log.info("order %d (%s -> node %d) failed: %s; re-planning", order.order_id,
                 order.session_id, order.node, why)
        info = self._sessions.get(order.session_id)
        if info is not None and not info.in_flight:
            self.core.replan(order.session_id, now)

    def _lateness(self, seconds: float) -> None:
        self.stats.lateness_s.append(seconds)
        self.metrics.lateness(seconds)

    def _collect(self, box: _Outbox) -> None:
        """Arm the core's new orders and turn its book evictions into advice."""
        core = self.core
        for order in core.drain_orders():
            heapq.heappush(self._timers, (order.start_at_s, next(self._seq), order))
            self._wake.notify_all()
        for node, tier in enumerate(core.dram):
            now_booked = {e.session_id for e in tier}
            gone = self._booked[node] - now_booked
            self._booked[node] = now_booked
            if gone:
                prefixes = []
                keys: list[str] = []
                for sid in sorted(gone):
                    info = self._sessions.get(sid)
                    if info is None:
                        tenant, _, session_id = sid.partition("/")
                        prefixes.append(session_prefix(tenant, session_id))
                    elif info.hashes is None:
                        prefixes.append(session_prefix(info.tenant, info.session_id))
                    else:
                        keys += self.keys_of(info, info.context_tokens)
                box.evict.append((node, tuple(prefixes), tuple(keys)))
        stats = core.stats
        self.metrics.core_stats(stats.wasted_bytes,
                                max(0, self.stats.prefetch_model_bytes - stats.wasted_bytes))

    def _send(self, box: _Outbox) -> None:
        for node, sid, oid in box.cancel:
            self._port_call(node, "cancel", sid, oid)
        for node, prefixes, keys in box.evict:
            self._port_call(node, "evict", prefixes, keys)
        for order in box.execute:
            self._port_call(order.node, "execute", order)
        for i, n in enumerate(self._nodes):
            self.metrics.orders_in_flight(self.node_name(i), len(n.orders))

    def _port_call(self, node: int, method: str, *args: Any) -> None:
        port = self._agents.get(node)
        if port is None:
            if method == "execute":
                self._fail_unsent(args[0], "no agent on the node")
            return
        try:
            getattr(port, method)(*args)
        except Exception as exc:  # an agent that cannot be reached must not stop the service
            log.warning("node %d: agent %s failed: %s", node, method, exc)
            if method == "execute":
                self._fail_unsent(args[0], f"{type(exc).__name__}: {exc}")

    def _fail_unsent(self, order: TransferOrder, why: str) -> None:
        box = _Outbox()
        with self._lock:
            if order.order_id in self._nodes[order.node].orders:
                self._order_failed(order, self.clock.now_s(), why)
                self._collect(box)
        if box.execute or box.cancel or box.evict:
            self._send(box)

    # ------------------------------------------------------------------ control loop
    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                delay = self.config.loop_interval_s
                if self._timers:
                    delay = min(delay, self.clock.wall_delay_s(self._timers[0][0]))
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
        box = _Outbox()
        with self._lock:
            now = self.clock.now_s()
            while self._timers and self._timers[0][0] <= now:
                _, _, order = heapq.heappop(self._timers)
                ticket = self.core.start_prefetch(order, now)
                if ticket is None:
                    continue
                info = self._sessions.get(ticket.session_id)
                if info is None:
                    self.core.transfer_cancelled(ticket.session_id, ticket.node)
                    continue
                self._dispatch(ticket, info, box)
            wall = self._wall()
            for n in self._nodes:
                for inflight in list(n.orders.values()):
                    if wall - inflight.sent_wall_s > self.config.order_timeout_s:
                        self.stats.orders_lost += 1
                        box.cancel.append((inflight.order.node, inflight.order.session_id,
                                           inflight.order.order_id))
                        self._order_failed(inflight.order, now, "timed out")
            self._collect(box)
        self._send(box)
        if self._journal is not None:
            sync = wall - self._last_sync > self.config.journal_sync_interval_s
            if sync:
                self._last_sync = wall
            self._journal.flush(sync=sync)

    # ------------------------------------------------------------------ resume
    def _resume(self, path: Path) -> None:
        core = self.core
        last_t = 0.0
        count = 0
        for event in read_journal_events(path):
            count += 1
            last_t = max(last_t, event.time_s)
            tenant, _, session_id = event.session_id.partition("/")
            if not session_id:
                continue
            info = self._sessions.get(event.session_id)
            if info is None:
                info = self._sessions[event.session_id] = _SessionInfo(tenant, session_id)
                self._owner[session_id] = tenant
            if event.kind is EventKind.REQUEST_STARTED:
                info.turns = event.turn + 1
                info.in_flight = True
                info.arrival_s = event.time_s
                core.request_started(event)
            elif event.kind is EventKind.REQUEST_FINISHED:
                ctx = event.input_tokens + event.output_tokens
                info.in_flight = False
                info.context_tokens = ctx
                core.request_finished(event, ctx)
            elif event.kind is EventKind.HINT:
                core.hint(event)
            elif event.kind is EventKind.SESSION_CLOSED:
                core.hint(event)
                core.predictor.forget(event.session_id)
                self._sessions.pop(event.session_id, None)
                self._owner.pop(session_id, None)
        self.clock.continue_after(last_t)
        for order in core.drain_orders():
            heapq.heappush(self._timers, (order.start_at_s, next(self._seq), order))
        for node, tier in enumerate(core.dram):
            self._booked[node] = {e.session_id for e in tier}
        log.info("resumed from %s: %d events, %d live sessions, clock at %.1f s", path, count,
                 len(self._sessions), last_t)

    def _reconcile(self, node: int, inventory: set[str], now: float) -> None:
        """Drop book entries of sessions whose chunks the node's tier does not hold."""
        tier = self.core.dram[node]
        for entry in list(tier):
            if entry.ready_at_s > now:
                continue  # arriving: its order decides
            info = self._sessions.get(entry.session_id)
            if info is None:
                tier.remove(entry.session_id)
                continue
            keys = self.keys_of(info, entry.tokens)
            if keys and keys[0] not in inventory:
                tier.remove(entry.session_id)
        self._booked[node] = {e.session_id for e in tier}

    # ------------------------------------------------------------------ introspection
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def has_session(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            return f"{tenant}/{session_id}" in self._sessions

    def summary(self) -> dict[str, Any]:
        with self._lock:
            core = self.core
            s = self.stats
            return {
                "policy": self.policy.name,
                "events": s.events,
                "routes": s.routes,
                "sessions": len(self._sessions),
                "orders_sent": s.orders_sent,
                "orders_done": s.orders_done,
                "orders_failed": s.orders_failed,
                "orders_lost": s.orders_lost,
                "orders_in_flight": {self.node_name(i): len(n.orders)
                                     for i, n in enumerate(self._nodes)},
                "prefetch_bytes": s.prefetch_bytes,
                "demand_bytes": s.demand_bytes,
                "prefetch_model_bytes": s.prefetch_model_bytes,
                "demand_model_bytes": s.demand_model_bytes,
                "prefetches": core.stats.prefetches,
                "prefetches_dropped": core.stats.prefetches_dropped,
                "wasted_bytes_modelled": core.stats.wasted_bytes,
                "ttlb_s": list(s.ttlb_s),
                "lateness_s": list(s.lateness_s),
                "loop_errors": s.loop_errors,
                "clock_s": self.clock.now_s(),
            }
