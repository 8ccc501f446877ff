"""The live service's decisions, under its lock: applies session events to the registry
and the core, and turns the core's outputs into messages for the agents.

:class:`LiveDriver` holds the service's rooms around one
:class:`~kvprefetch.controlplane.core.scheduler.SchedulerCore`: sessions
(:class:`~kvprefetch.controlplane.live.sessions.SessionRegistry`), orders
(:class:`~kvprefetch.controlplane.live.orders.OrderBook`), the fleet view, the armed-order
timers, the outcomes of transfers
(:class:`~kvprefetch.controlplane.live.transfers.TransferOutcomes`) and the fleet's members
(:class:`~kvprefetch.controlplane.live.membership.FleetMembership`). It is not thread-safe
and never sends anything itself: every method that decides takes the
:class:`~kvprefetch.controlplane.live.ports.Outbox` that the service sends once its lock is
released.

Every session event takes one path, :meth:`LiveDriver.apply`, for a live call and for a
journal replayed on restart alike, so a resumed session has the context, turns and chunk
names it had. Routes with a request id are remembered
(:mod:`~kvprefetch.controlplane.live.routes.ledger`) and journalled beside the events, so a
retry after a restart answers as the first call did.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable
from pathlib import Path

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import InvalidRequestError
from kvprefetch.controlplane.base.keys import chunk_hashes, session_prefix
from kvprefetch.controlplane.base.types import EventKind, HintKind, SessionEvent, SessionKey
from kvprefetch.controlplane.base.wire import EngineReport, GpuStartPlan
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.journal.file import DamagedRecord, TimeLimits
from kvprefetch.controlplane.journal.live import KeysChange, LiveJournalScanner, LiveJournalWriter
from kvprefetch.controlplane.live.config import ServiceClock, ServiceConfig
from kvprefetch.controlplane.live.fleet import LiveFleet
from kvprefetch.controlplane.live.membership import FleetMembership
from kvprefetch.controlplane.live.orders import OrderBook
from kvprefetch.controlplane.live.ports import Outbox, ServiceMetricsSink, ServiceStats
from kvprefetch.controlplane.live.routes.ledger import RouteLedger
from kvprefetch.controlplane.live.sessions import (
    SessionInfo,
    SessionQuery,
    SessionRegistry,
    SessionState,
)
from kvprefetch.controlplane.live.tenants import TenantQuotaError
from kvprefetch.controlplane.live.transfers import TransferOutcomes

log = logging.getLogger(__name__)


def check_node(node: int, nodes: int) -> None:
    """Refuse a call that names a node outside a fleet of ``nodes`` slots
    (InvalidRequestError)."""
    if not 0 <= node < nodes:
        raise InvalidRequestError(f"node {node} out of range (the fleet has {nodes} nodes)")


class LiveDriver:
    """See the module docstring."""

    def __init__(self, config: ServiceConfig, core: SchedulerCore, fleet: LiveFleet,
                 orders: OrderBook, clock: ServiceClock, metrics: ServiceMetricsSink,
                 wall: Callable[[], float]) -> None:
        self.config = config
        self.policy = config.policy_spec
        self.core = core
        self.fleet = fleet
        self.orders = orders
        self.clock = clock
        self._metrics = metrics
        self._wall = wall
        self.stats = ServiceStats()
        self.registry = SessionRegistry(config.chunk_tokens, config.tenants,
                                        config.max_live_sessions)
        #: Routes remembered by request id (journalled; replayed on restart).
        self.routes = RouteLedger(config.route_memory_per_tenant)
        #: Armed prefetch orders by start time (the service's loop fires them).
        self.timers: list[tuple[float, int, PrefetchOrder]] = []
        self._seq = itertools.count()
        self.journal: LiveJournalWriter | None = None
        #: Records journalled since the journal was opened or last compacted.
        self.journal_records = 0
        #: Service time of the next sweep (the first one on the first tick).
        self._next_sweep_s = 0.0
        #: The rooms for transfer outcomes and fleet members (they carry out through
        #: this driver).
        self.transfers = TransferOutcomes(config, core, orders, self.registry, clock,
                                          self.stats, metrics, self._carry_through)
        self.members = FleetMembership(config, core, fleet, self.registry, self.transfers,
                                       clock, self.stats, metrics, self._carry_through)

    @property
    def metrics(self) -> ServiceMetricsSink:
        return self._metrics

    @metrics.setter
    def metrics(self, sink: ServiceMetricsSink) -> None:
        """Swap the sink in every room (a Prometheus registry created after start)."""
        self._metrics = self.transfers.metrics = self.members.metrics = sink

    def node_name(self, node: int) -> str:
        return self.members.node_name(node)

    def _carry_through(self, out: StepOutput, box: Outbox) -> None:
        """:meth:`carry` for the rooms, looked up per call (a carry replaced on this driver
        is the one they use too)."""
        self.carry(out, box)

    def fire_due(self, now: float, box: Outbox) -> None:
        """Start the armed orders whose time has come."""
        while self.timers and self.timers[0][0] <= now:
            _, _, order = heapq.heappop(self.timers)
            self.carry(self.core.start_prefetch(order, now), box)

    def sweep(self, now: float, box: Outbox) -> None:
        """Every ``planner.sweep_interval_s`` of service time, re-plan the idle sessions
        whose KV left their node (their forecasts move as their silence grows), as the
        simulator does."""
        if now < self._next_sweep_s:
            return
        self._next_sweep_s = now + self.config.fleet.planner.sweep_interval_s
        self.stats.sweeps += 1
        self.carry(self.core.sweep(now), box)

    # ------------------------------------------------------------------ events
    def apply(self, event: SessionEvent, keys: KeysChange | None = None) -> StepOutput:
        """Apply one session event (and the change of its chunk names it brought) to the
        registry and the core: the same for a live call and for a journal replayed on
        restart."""
        key = SessionKey.parse(event.session_id)
        if event.kind is EventKind.SESSION_CLOSED:
            self.routes.finish(key.tenant, event.session_id)
            self.registry.close(key)
            # Its armed orders go now: left to fire, they would wait in the heap until due.
            kept = [t for t in self.timers if t[2].session_id != event.session_id]
            if len(kept) != len(self.timers):
                heapq.heapify(kept)
                self.timers[:] = kept
            return self.core.close(event)
        info = self.registry.open(key)
        if keys is not None:
            info.hashes = keys.apply(info.hashes)
        if event.kind is EventKind.REQUEST_STARTED:
            info.turns, info.in_flight, info.arrival_s = event.turn + 1, True, event.time_s
            info.await_prefetch_node = None
            return self.core.request_started(event)
        if event.kind is EventKind.REQUEST_FINISHED:
            self.routes.finish(key.tenant, event.session_id)
            info.in_flight, info.context_tokens = False, event.context_after
            return self.core.request_finished(event, event.context_after)
        return self.core.hint(event)

    def record(self, event: SessionEvent, hashes: tuple[str, ...] | None = None
               ) -> KeysChange | None:
        """Journal ``event`` before anything changes: a failed write raises
        JournalUnavailableError with nothing recorded, so the call fails closed. Returns
        the change of chunk names journalled with it (``hashes``: the session's chunk
        hashes from now on, when the call named its chunks by content; journalled as the
        change from the old ones, so that a resume names them exactly as before)."""
        keys = None
        if hashes is not None:
            info = self.registry.by_sid(event.session_id)
            old = info.hashes if info is not None else None
            if hashes != old:
                keys = KeysChange.between(old, hashes)
        if self.journal is not None:
            # Handed to the OS at once: a killed service loses no acknowledged event (a
            # crashed machine may lose the last ones; fsync runs on the loop's interval).
            self.journal.write_event(event, keys)
            self.journal_records += 1
        return keys

    def record_and_apply(self, event: SessionEvent, box: Outbox,
                         hashes: tuple[str, ...] | None = None) -> None:
        """Journal ``event`` (:meth:`record`), then apply it."""
        self.applied(event, self.record(event, hashes), box)

    def applied(self, event: SessionEvent, keys: KeysChange | None, box: Outbox) -> None:
        """Apply a journalled event and carry its decisions out."""
        self.stats.events += 1
        self.metrics.event(event.kind.value)
        self.carry(self.apply(event, keys), box)

    def carry(self, out: StepOutput, box: Outbox) -> None:
        """Turn the core's decisions into messages: cancels, orders, evict advice (whole
        sessions, and the suffixes of trimmed ones), timers."""
        for c in out.cancels:
            sent = self.orders.of_session(c.session_id, c.node)
            if sent is not None:
                self.orders.close(sent)
                self.stats.orders_cancelled += 1
                box.cancel.append((c.node, c.session_id, sent.order_id))
        for ticket in out.loads:
            info = self.registry.by_sid(ticket.session_id)
            if info is None:  # closed meanwhile: nothing to name, give the room back
                self.carry(self.core.transfer_failed(ticket.session_id, ticket.node,
                                                     self.clock.now_s()), box)
                continue
            keys = tuple(self.registry.load_keys(info, ticket.tokens))
            n = self.fleet.nodes[ticket.node]
            due_in = (ticket.deadline_s - self.clock.now_s()) / self.clock.compression
            box.execute.append(self.orders.open(ticket, keys, wall_s=self._wall(),
                                                incarnation=n.incarnation,
                                                due_in_wall_s=due_in))
            self.stats.orders_sent += 1
        for order in out.orders:
            heapq.heappush(self.timers, (order.start_at_s, next(self._seq), order))
        loading = {(t.session_id, t.node) for t in out.loads}
        for e in out.evictions:
            if (e.session_id, e.node) in loading:
                continue  # dropped and ordered back at once: what the tier holds is wanted
            info = self.registry.by_sid(e.session_id)
            if info is not None and info.hashes is not None:
                # Content-named chunks do not say whose they are: the session's prefix
                # goes too, for a tier that finds a session's KV by the session (LMCache's
                # L1, through the session's token ids).
                chunks = self.registry.keys_of(info, info.context_tokens)
                prefix = session_prefix(info.key.tenant, info.key.session_id)
                box.evict.append((e.node, (prefix,), tuple(chunks)))
            else:
                key = info.key if info is not None else SessionKey.parse(e.session_id)
                box.evict.append((e.node, (session_prefix(key.tenant, key.session_id),), ()))
        for t in out.trims:  # suffix eviction: the chunks past the kept prefix go
            info = self.registry.by_sid(t.session_id)
            if info is None or (t.session_id, t.node) in loading:
                continue  # closed (its chunks are not known here) or ordered back at once
            chunks = self.registry.keys_of(info, info.context_tokens)
            drop = tuple(chunks[t.keep_tokens // self.config.chunk_tokens:])
            if drop:
                box.evict.append((t.node, (), drop))

    # ------------------------------------------------------------------ gateway calls
    def start_request(self, call: api.RequestStarted | api.RouteQuery, box: Outbox
                      ) -> SessionInfo:
        key = SessionKey(call.tenant, call.session_id)
        try:
            self.registry.admit(key)
        except TenantQuotaError:
            self.stats.quota_refusals += 1
            self.metrics.quota_refused(key.tenant)
            raise
        # Read, not opened: the session opens only once its event is journalled.
        info = self.registry.get(key) or SessionInfo(key)
        hashes = None
        if call.token_ids is not None:  # the service hashes before its lock (prehash)
            hashes = tuple(chunk_hashes(call.token_ids, self.config.chunk_tokens))
        elif call.chunk_hashes is not None:
            hashes = tuple(call.chunk_hashes)
        reused = call.reused_tokens if call.reused_tokens is not None else min(
            call.tokens, info.context_tokens)
        self.record_and_apply(SessionEvent(
            EventKind.REQUEST_STARTED, key.wire, self.clock.now_s(), info.turns, call.tokens, 0,
            min(reused, call.tokens), tenant=call.tenant, parent_id=call.parent_id), box,
            hashes)
        self.metrics.tenant_sessions(key.tenant, self.registry.per_tenant[key.tenant])
        return self.registry.known(key)

    def route(self, call: api.RouteQuery, box: Outbox) -> api.RouteAnswer:
        """Pick the node for a request; records ``request_started`` when the gateway has
        not sent it for this request."""
        key = SessionKey(call.tenant, call.session_id)
        info = self.registry.get(key)
        if info is None or not info.in_flight:
            info = self.start_request(call, box)  # checks the tenant
        else:
            self.registry.check_tenant(key)
        now = self.clock.now_s()
        reused = call.reused_tokens if call.reused_tokens is not None else min(
            call.tokens, info.context_tokens)
        out = self.core.route_request(key.wire, call.tokens, reused, now)
        decision, node = out.route, out.node
        assert decision is not None
        if out.prefetch_ready_s is not None:
            if math.isinf(out.prefetch_ready_s):
                info.await_prefetch_node = node
            else:
                self.transfers.lateness(out.prefetch_ready_s - now)
        est = max(0.0, decision.estimated_ttft_s - self.fleet.queue_wait_s(node, now))
        self.fleet.enqueue(node, est, info.node, info.est_service_s)
        info.node, info.est_service_s = node, est
        self.carry(out, box)
        self.stats.routes += 1
        local_ready = self.core.local_tokens(node, key.wire) > 0
        return api.RouteAnswer(node=node, node_name=self.node_name(node),
                               estimated_ttft_s=round(decision.estimated_ttft_s, 6),
                               local_ready=local_ready, request_id=call.request_id)

    def request_finished(self, call: api.RequestFinished, box: Outbox) -> api.Ack:
        """The response ended on ``call.node`` (InvalidRequestError when the fleet has no
        such node; nothing is recorded then).

        A finish on no node (``call.node`` None: its route gave no advice, and the caller
        ran the request where it chose) of a known session is acknowledged without being
        recorded (UnknownSessionError for an unknown one, as for every call): the core
        books a finished context on the node that served it, and booking it on a node
        that may not hold it would send evictions there and route the session to KV it
        does not have. The session's request stays in flight; its next finish on a node
        records the context then (a later route of the session routes that request
        again). Counted in ``finishes_without_node``."""
        if call.node is None:
            self.registry.known(SessionKey(call.tenant, call.session_id))
            self.stats.finishes_without_node += 1
            return api.Ack(accepted=False)
        check_node(call.node, self.config.fleet.nodes)
        info = self.registry.known(SessionKey(call.tenant, call.session_id))
        hashes = tuple(call.chunk_hashes) if call.chunk_hashes is not None else None
        event = SessionEvent(
            EventKind.REQUEST_FINISHED, info.sid, self.clock.now_s(), max(0, info.turns - 1),
            call.input_tokens, call.output_tokens, 0, call.stop_reason, node=call.node,
            tenant=call.tenant, context_tokens=call.context_tokens)
        keys = self.record(event, hashes)  # first: a failed write changes nothing
        if info.node is not None:
            # an engine that reports no GPU start (vLLM, SGLang) leaves its route's
            # estimate in the node's queue until the request ends
            self.fleet.dequeue(info.node, info.est_service_s)
            info.node, info.est_service_s = None, 0.0
        if call.local_tokens_read:
            self.core.mark_read(info.sid, call.node, call.local_tokens_read, info.arrival_s)
        self.applied(event, keys, box)
        return api.ACCEPTED

    def hint(self, call: api.HintCall, box: Outbox) -> None:
        """A hint re-plans the session; a ``session_closed`` hint closes it, exactly as
        :meth:`session_closed` does (one event, journalled as the close)."""
        if call.hint.kind == "session_closed":
            self.session_closed(api.SessionClosed(tenant=call.tenant,
                                                  session_id=call.session_id), box)
            return
        info = self.registry.known(SessionKey(call.tenant, call.session_id))
        self.record_and_apply(SessionEvent(
            EventKind.HINT, info.sid, self.clock.now_s(), max(0, info.turns - 1),
            hint=HintKind(call.hint.kind), eta_s=call.hint.eta_s, tenant=call.tenant), box)

    def session_closed(self, call: api.SessionClosed, box: Outbox) -> None:
        info = self.registry.known(SessionKey(call.tenant, call.session_id))
        self.record_and_apply(SessionEvent(
            EventKind.SESSION_CLOSED, info.sid, self.clock.now_s(), max(0, info.turns - 1),
            tenant=call.tenant), box)
        self.metrics.tenant_sessions(call.tenant, self.registry.per_tenant[call.tenant])

    def session_state(self, call: SessionQuery) -> SessionState:
        """The caller's live session (UnknownSessionError when its tenant has none by
        that id); read-only."""
        return self.registry.known(SessionKey(call.tenant, call.session_id)).state()

    # ------------------------------------------------------------------ engine calls
    def gpu_start(self, node: int, tenant: str, session_id: str, reused_tokens: int,
                  box: Outbox) -> GpuStartPlan:
        """The node's GPU picks the request up: the core may start its demand load; the
        engine waits for the order it is told of (that one or a transfer already under
        way), then reads its local tier."""
        info = self.registry.known(SessionKey(tenant, session_id))
        now = self.clock.now_s()
        if info.node is not None:
            self.fleet.dequeue(info.node, info.est_service_s)
        self.fleet.nodes[node].running_end_s = now + info.est_service_s
        info.node, info.est_service_s = None, 0.0
        out = self.core.gpu_start(info.sid, node, reused_tokens, now)
        self.carry(out, box)
        order = self.orders.of_session(info.sid, node)
        if order is None:
            return GpuStartPlan()
        return GpuStartPlan(order.order_id, order.nbytes, out.demand_load(info.sid) is not None)

    def use_local(self, node: int, tenant: str, session_id: str, reused_tokens: int) -> int:
        """The engine is about to read its local tier: mark the DRAM entry read and return
        the booked usable tokens."""
        info = self.registry.known(SessionKey(tenant, session_id))
        return self.core.use_local(info.sid, node, reused_tokens, self.clock.now_s())

    def engine_report(self, report: EngineReport) -> None:
        """The engine's HBM now holds the served session's context and no longer the ones
        it dropped. A drop notice (empty ``session_id``, from a sharded engine client:
        :func:`~kvprefetch.controlplane.base.shards.split_engine_report`) only drops."""
        hbm = self.fleet.nodes[report.node].hbm
        if report.session_id:
            hbm[report.session_id] = report.context_tokens
            self.metrics.local_lookup(report.local_tokens, report.reused_tokens)
        for sid in report.hbm_evicted:  # the served session too, when it did not fit
            hbm.pop(sid, None)

    # ------------------------------------------------------------------ resume
    def resume(self, path: Path, limits: TimeLimits) -> LiveJournalScanner:
        """Replay the journal through :meth:`apply` (as the live calls did); keep the
        armed orders; the books of each node are reconciled when its agent says hello.
        Damaged records (checksum, syntax, sequence, values or time out of range, and any
        record whose replay raised) are skipped and left in the returned scanner's
        ``damaged`` for the caller to quarantine; this never raises on a record's
        content.

        Fleet changes: the journal holds session events only, so a join is replayed where
        the journal proves it, just before the first event that names an out node (a
        request finished there, so it had joined). Nodes that joined but no event names
        stay out until their agents say hello again (the Ray scheduler asks every agent
        to on restart)."""
        scan = LiveJournalScanner(path, limits=limits, nodes=self.config.fleet.nodes)
        scan.on_route = self.routes.replay
        box = Outbox()
        for line, event in scan:
            try:
                if event.node is not None and event.node in self.members.out_nodes:
                    self.members.node_joined(event.node, event.time_s, box, replayed=True)
                self.carry(self.apply(event, scan.keys), box)
            except Exception as exc:  # a record the checks let through: never a restart loop
                log.exception("journal %s:%d: replaying the record failed; set aside", path,
                              line)
                scan.damaged.append(DamagedRecord(line, f"replay failed: {exc!r}",
                                                  scan.last_raw))
        self.clock.continue_after(scan.last_t)
        log.info("resumed from %s: %d events, %d live sessions, clock at %.1f s, "
                 "last epoch %d", path, scan.events, len(self.registry), scan.last_t,
                 scan.last_epoch)
        return scan
