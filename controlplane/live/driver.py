"""The live service's decisions, under its lock: applies session events to the registry
and the core, and turns the core's outputs into messages for the agents.

:class:`LiveDriver` holds the service's rooms (sessions, orders, the fleet view, the
armed-order timers) around one :class:`~kvprefetch.controlplane.core.scheduler.SchedulerCore`. It is
not thread-safe and never sends anything itself: every method that decides takes the
:class:`~kvprefetch.controlplane.live.ports.Outbox` that the service sends once its lock is
released.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.keys import chunk_hashes, session_prefix
from kvprefetch.controlplane.base.types import EventKind, HintKind, SessionEvent, SessionKey
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    TierEvictions,
    TransferOrder,
    TransferReport,
    format_order_id,
    order_epoch,
)
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.quotas import TenantQuotaStats
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.live.config import ServiceClock, ServiceConfig
from kvprefetch.controlplane.live.fleet import LiveFleet
from kvprefetch.controlplane.live.journal import KeysChange, LiveJournalScanner, LiveJournalWriter
from kvprefetch.controlplane.live.orders import OrderBook, report_mismatch
from kvprefetch.controlplane.live.ports import Outbox, ServiceMetricsSink, ServiceStats
from kvprefetch.controlplane.live.sessions import (
    SessionInfo,
    SessionQuery,
    SessionRegistry,
    SessionState,
)
from kvprefetch.controlplane.live.tenants import TenantQuotaError
from kvprefetch.controlplane.traces.journal import DamagedRecord, TimeLimits

log = logging.getLogger(__name__)


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
        self.metrics = metrics
        self._wall = wall
        self.stats = ServiceStats()
        self.registry = SessionRegistry(config.chunk_tokens, config.tenants,
                                        config.max_live_sessions)
        #: Armed prefetch orders by start time (the service's loop fires them).
        self.timers: list[tuple[float, int, PrefetchOrder]] = []
        self._seq = itertools.count()
        self.journal: LiveJournalWriter | None = None
        #: Node slots out of the fleet (no agent yet): never routed to, warmed on joining.
        self.out_nodes: set[int] = set()
        self.nodes_joined = 0
        #: Records journalled since the journal was opened or last compacted.
        self.journal_records = 0
        #: Service time of the next sweep (the first one on the first tick).
        self._next_sweep_s = 0.0
        names = config.node_names
        self._names = list(names) if names is not None else [
            f"node-{i}" for i in range(config.fleet.nodes)]

    def node_name(self, node: int) -> str:
        return self._names[node]

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

    def expire(self, wall: float, now: float, box: Outbox) -> None:
        """Give up orders not reported within ``order_timeout_s`` and re-plan them."""
        for node in range(self.config.fleet.nodes):
            for inflight in self.orders.in_flight(node):
                if wall - inflight.sent_wall_s > self.config.order_timeout_s:
                    self.stats.orders_lost += 1
                    o = inflight.order
                    box.cancel.append((o.node, o.session_id, o.order_id))
                    self._order_failed(o, now, "timed out", box)

    # ------------------------------------------------------------------ events
    def apply(self, event: SessionEvent, keys: KeysChange | None = None) -> StepOutput:
        """Apply one session event (and the change of its chunk names it brought) to the
        registry and the core: the same for a live call and for a journal replayed on
        restart."""
        key = SessionKey.parse(event.session_id)
        if event.kind is EventKind.SESSION_CLOSED:
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
            box.execute.append(self.orders.open(ticket, keys, wall_s=self._wall(),
                                                incarnation=n.incarnation))
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
                self._lateness(out.prefetch_ready_s - now)
        est = max(0.0, decision.estimated_ttft_s - self.fleet.queue_wait_s(node, now))
        self.fleet.enqueue(node, est, info.node, info.est_service_s)
        info.node, info.est_service_s = node, est
        self.carry(out, box)
        self.stats.routes += 1
        local_ready = self.core.local_tokens(node, key.wire) > 0
        return api.RouteAnswer(node=node, node_name=self.node_name(node),
                               estimated_ttft_s=round(decision.estimated_ttft_s, 6),
                               local_ready=local_ready)

    def request_finished(self, call: api.RequestFinished, box: Outbox) -> None:
        info = self.registry.known(SessionKey(call.tenant, call.session_id))
        hashes = tuple(call.chunk_hashes) if call.chunk_hashes is not None else None
        event = SessionEvent(
            EventKind.REQUEST_FINISHED, info.sid, self.clock.now_s(), max(0, info.turns - 1),
            call.input_tokens, call.output_tokens, 0, call.stop_reason, node=call.node,
            tenant=call.tenant, context_tokens=call.context_tokens)
        keys = self.record(event, hashes)  # first: a failed write changes nothing
        if call.local_tokens_read:
            self.core.mark_read(info.sid, call.node, call.local_tokens_read, info.arrival_s)
        self.applied(event, keys, box)

    def hint(self, call: api.HintCall, box: Outbox) -> None:
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

    # ------------------------------------------------------------------ fleet changes
    def mark_out(self, nodes: Iterable[int], box: Outbox) -> None:
        """Take node slots out of the fleet (at start: the nodes that have no agent yet).
        The core never routes to them and drops their books."""
        now = self.clock.now_s()
        for node in nodes:
            if node not in self.out_nodes:
                self.out_nodes.add(node)
                self.carry(self.core.node_left(node, now), box)
        if self.out_nodes:
            log.info("nodes %s are out of the fleet until their agents say hello",
                     ", ".join(str(n) for n in sorted(self.out_nodes)))

    def node_joined(self, node: int, now: float, box: Outbox, *, replayed: bool = False
                    ) -> None:
        """An out node joined (its agent said hello, or a replayed event names it): the
        core routes to it from now on and warms it with idle sessions whose KV is local
        nowhere; the warm-up loads go to its agent like any others. Counted in
        ``nodes_joined`` and the ``node_joined`` event metric unless ``replayed``."""
        self.out_nodes.discard(node)
        before = len(box.execute)
        self.carry(self.core.node_joined(node, now), box)
        if replayed:
            return
        self.nodes_joined += 1
        self.metrics.event("node_joined")
        warm = box.execute[before:]
        log.info("node %d (%s) joined the fleet: warming it with %d sessions (%.1f MiB "
                 "modelled)", node, self.node_name(node), len(warm),
                 sum(o.nbytes for o in warm) / (1 << 20))

    # ------------------------------------------------------------------ agent calls
    def agent_hello(self, hello: AgentHello, box: Outbox) -> None:
        """An agent (re)started: orders sent to its previous incarnation are lost (re-plan
        them); reconcile the node's books with what its tier really holds. The agent of a
        node out of the fleet joins it (after the reconcile: it is warmed against books
        that match its tier)."""
        now = self.clock.now_s()
        joining = hello.node in self.out_nodes
        if joining and hello.node_name:
            self._names[hello.node] = hello.node_name
        self.fleet.nodes[hello.node].incarnation = hello.incarnation
        for inflight in self.orders.in_flight(hello.node):
            if inflight.incarnation != hello.incarnation:
                self.stats.orders_lost += 1
                self._order_failed(inflight.order, now, "agent restarted", box)
        if hello.inventory is not None:
            inventory = set(hello.inventory)

            def holds(sid: str, tokens: int) -> bool:
                info = self.registry.by_sid(sid)
                keys = self.registry.keys_of(info, tokens) if info is not None else []
                return info is not None and (not keys or keys[0] in inventory)

            self.carry(self.core.reconcile(hello.node, holds, now), box)
        log.info("agent on node %d (%s) is up: incarnation %s, %d keys in its tier",
                 hello.node, hello.node_name, hello.incarnation[:8], len(hello.inventory))
        if joining:
            self.node_joined(hello.node, now, box)

    def node_status(self, status: AgentStatus, box: Outbox) -> None:
        """An agent's periodic report of its tier (``AgentConfig.status_interval_s``). This
        shard's quota of the node's DRAM tier follows the capacity the tier really has: its
        share (1/``shards``) of the reported capacity in booked bytes, never more than the
        configured quota. Every shard receives the same report and takes the same share, so
        the quotas never add up to more than the tier; a quota that shrinks evicts what
        no longer fits (:meth:`SchedulerCore.set_tier_capacity`). A report of another
        incarnation than the node's current one, or of no capacity, changes nothing."""
        node = self.fleet.nodes[status.node]
        if status.capacity_bytes <= 0 or (node.incarnation
                                          and status.incarnation != node.incarnation):
            return
        share = 1 if self.config.shard_tier == "shared" else self.config.shards
        quota = min(self.config.fleet.node.dram_tier_bytes,
                    status.booked_capacity_bytes // share)
        tier = self.core.dram[status.node]
        if quota == tier.capacity_bytes:
            return
        log.info("node %d (%s): this shard's tier quota %d -> %d bytes (the agent reports "
                 "%d bytes, kv_scale %g, %d shards)", status.node, status.node_name,
                 tier.capacity_bytes, quota, status.capacity_bytes, status.kv_scale,
                 self.config.shards)
        self.stats.quota_changes += 1
        self.carry(self.core.set_tier_capacity(status.node, quota, self.clock.now_s()), box)

    def tier_evicted(self, evictions: TierEvictions, box: Outbox) -> None:
        """The node's tier evicted chunks of these sessions by its own order (the shards'
        books together wanted more than it holds): their entries in this shard's books of
        the node go, and idle ones are planned again (as after a reconcile). Entries still
        arriving are kept (their transfer decides). A report of another incarnation than
        the node's current one changes nothing."""
        node = self.fleet.nodes[evictions.node]
        if node.incarnation and evictions.incarnation != node.incarnation:
            return
        before = len(self.core.dram[evictions.node])
        self.carry(self.core.forget_local(evictions.node, set(evictions.sessions),
                                          self.clock.now_s()), box)
        self.stats.tier_evictions += before - len(self.core.dram[evictions.node])

    def report_transfer(self, report: TransferReport, box: Outbox) -> None:
        """An agent finished (or gave up) an order. Idempotent per order id; a report that
        does not match its order (another epoch, session, node, kind or keys) is counted
        and logged, never booked."""
        order = self._order_of(report)
        if order is None:
            return
        now = self.clock.now_s()
        if not report.complete:
            self._order_failed(order, now, report.error or "incomplete", box)
            return
        self.orders.close(order)
        self.carry(self.core.transfer_done(order.session_id, order.node, now,
                                            demand=not order.prefetch), box)
        self._count_done(order, report)
        info = self.registry.by_sid(order.session_id)
        if info is not None and info.await_prefetch_node == order.node:
            info.await_prefetch_node = None
            self._lateness(now - info.arrival_s)

    def _order_of(self, report: TransferReport) -> TransferOrder | None:
        """The order in flight that ``report`` is the outcome of, or None (counted)."""
        if order_epoch(report.order_id) != self.orders.epoch:
            self._reject(report, "stale_epoch")
            return None
        if not 0 <= report.node < self.config.fleet.nodes:
            self._reject(report, "unknown_node")
            return None
        inflight = self.orders.by_id(report.order_id)
        if inflight is None:
            if self.orders.was_closed(report.order_id):
                # A duplicate (the engine and the agent both report), or an order given up
                # (timed out, its agent restarted): not an error.
                self.stats.reports_duplicate += 1
            else:
                self._reject(report, "unknown_order")
            return None
        why = report_mismatch(report, inflight.order)
        if why is None and report.incarnation and inflight.incarnation \
                and report.incarnation != inflight.incarnation:
            why = "incarnation"
        if why is not None:
            self._reject(report, why, inflight.order)
            return None
        return inflight.order

    def _reject(self, report: TransferReport, why: str,
                order: TransferOrder | None = None) -> None:
        rejected = self.stats.reports_rejected
        rejected[why] = rejected.get(why, 0) + 1
        log.warning("report of order %s (%s, node %d) rejected: %s%s; not booked",
                    format_order_id(report.order_id), report.session_id, report.node, why,
                    "" if order is None else
                    f" (the order is {order.session_id} on node {order.node})")

    def _count_done(self, order: TransferOrder, report: TransferReport) -> None:
        s = self.stats
        s.orders_done += 1
        ttlb = report.ttlb_wall_s * self.config.time_compression
        s.ttlb_s.append(ttlb)
        self.metrics.ttlb(ttlb, order.prefetch)
        self.metrics.bytes_moved(report.bytes_moved, order.prefetch)
        if order.prefetch:
            s.prefetch_bytes += report.bytes_moved
            s.prefetch_model_bytes += order.nbytes
        else:
            s.demand_bytes += report.bytes_moved
            s.demand_model_bytes += order.nbytes

    def _order_failed(self, order: TransferOrder, now: float, why: str, box: Outbox) -> None:
        self.orders.close(order)
        self.stats.orders_failed += 1
        log.info("order %s (%s -> node %d) failed: %s; re-planning",
                 format_order_id(order.order_id), order.session_id, order.node, why)
        self.carry(self.core.transfer_failed(order.session_id, order.node, now), box)

    def unsent(self, order: TransferOrder, why: str, box: Outbox) -> None:
        """An order could not be handed to its agent."""
        if self.orders.get(order.node, order.order_id) is not None:
            self._order_failed(order, self.clock.now_s(), why, box)

    def _lateness(self, seconds: float) -> None:
        self.stats.lateness_s.append(seconds)
        self.metrics.lateness(seconds)

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
        box = Outbox()
        for line, event in scan:
            try:
                if event.node is not None and event.node in self.out_nodes:
                    self.node_joined(event.node, event.time_s, box, replayed=True)
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

    # ------------------------------------------------------------------ introspection
    def summary(self) -> dict[str, Any]:
        core, s = self.core, self.stats
        return {
            "policy": self.policy.name, "events": s.events, "routes": s.routes,
            "sessions": len(self.registry), "orders_sent": s.orders_sent,
            "orders_done": s.orders_done, "orders_failed": s.orders_failed,
            "orders_lost": s.orders_lost, "orders_cancelled": s.orders_cancelled,
            "orders_in_flight": {self.node_name(i): self.orders.count(i)
                                 for i in range(self.config.fleet.nodes)},
            "prefetch_bytes": s.prefetch_bytes, "demand_bytes": s.demand_bytes,
            "prefetch_model_bytes": s.prefetch_model_bytes,
            "demand_model_bytes": s.demand_model_bytes,
            "prefetches": core.stats.prefetches,
            "prefetches_dropped": core.stats.prefetches_dropped,
            "wasted_bytes_modelled": core.stats.wasted_bytes,
            "prefetch_used_bytes_modelled": core.stats.prefetch_used_bytes,
            "prefetches_over_budget": core.stats.prefetches_over_budget,
            "warmup_bytes": core.stats.warmup_bytes,
            "ttlb_s": list(s.ttlb_s), "lateness_s": list(s.lateness_s),
            "plan_step_s": list(s.plan_step_s),
            "plan_steps": s.plan_steps,
            "eviction_index": asdict(core.eviction_index_stats()),
            "loop_errors": s.loop_errors, "sweeps": s.sweeps, "clock_s": self.clock.now_s(),
            "epoch": self.orders.epoch, "reports_rejected": dict(s.reports_rejected),
            "reports_duplicate": s.reports_duplicate,
            "journal_quarantined": s.journal_quarantined,
            "journal_compactions": s.journal_compactions,
            "journal_records_dropped": s.journal_records_dropped,
            "quota_refusals": s.quota_refusals,
            "quota_changes": s.quota_changes,
            "tier_evictions": s.tier_evictions,
            "tier_quota_bytes": {self.node_name(i): t.capacity_bytes
                                 for i, t in enumerate(core.dram)},
            "live_sessions_per_tenant": dict(self.registry.per_tenant),
            "tenant_shares": self._tenant_shares(),
            "nodes_joined": self.nodes_joined,
            "nodes_out": [self.node_name(n) for n in sorted(self.out_nodes)],
            "sizes": {"sessions": len(self.registry), "core_sessions": core.sessions(),
                      "timers": len(self.timers), **self.orders.sizes()},
        }

    def _tenant_shares(self) -> dict[str, Any]:
        """Each tenant with a share: its quota, its bytes in each node's books and what its
        shares did (empty without quotas)."""
        shares = self.core.shares
        if shares is None:
            return {}
        held = shares.tier_bytes(self.core.dram)
        return {t: {**asdict(q), **asdict(shares.stats.get(t) or TenantQuotaStats()),
                    "local_tier_bytes": {self.node_name(n): held[(t, n)]
                                         for n in range(self.config.fleet.nodes)}}
                for t, q in sorted(shares.quotas.items())}
