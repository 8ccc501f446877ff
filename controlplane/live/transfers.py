"""What became of the transfers the live driver ordered: reports booked or rejected, failed
and lost orders re-planned.

:class:`TransferOutcomes` is one of :class:`~kvprefetch.controlplane.live.driver.LiveDriver`'s
rooms. Like the driver it is not thread-safe (the service's lock guards it) and sends
nothing itself: a re-plan goes through the driver's ``carry`` into the
:class:`~kvprefetch.controlplane.live.ports.Outbox` the service sends once its lock is
released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvprefetch.controlplane.base.wire import (
    TransferOrder,
    TransferReport,
    format_order_id,
    order_epoch,
)
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.live.config import ServiceClock, ServiceConfig
from kvprefetch.controlplane.live.orders import OrderBook, report_mismatch
from kvprefetch.controlplane.live.ports import Outbox, ServiceMetricsSink, ServiceStats
from kvprefetch.controlplane.live.sessions import SessionRegistry

log = logging.getLogger(__name__)

#: Carries the core's decisions out into an outbox (:meth:`LiveDriver.carry`).
Carry = Callable[[StepOutput, Outbox], None]


class TransferOutcomes:
    """Books the outcome of every order sent: a report that completes it (the core books
    the KV as local), one that fails it, an order lost with its agent or given up after
    ``order_timeout_s`` (the core re-plans the session's load). Counts every outcome in
    the shared :class:`ServiceStats` and the metrics sink."""

    def __init__(self, config: ServiceConfig, core: SchedulerCore, orders: OrderBook,
                 registry: SessionRegistry, clock: ServiceClock, stats: ServiceStats,
                 metrics: ServiceMetricsSink, carry: Carry) -> None:
        self.config = config
        self.core = core
        self.orders = orders
        self.registry = registry
        self.clock = clock
        self.stats = stats
        self.metrics = metrics
        self._carry = carry

    def report(self, report: TransferReport, box: Outbox) -> None:
        """An agent finished (or gave up) an order. Idempotent per order id; a report that
        does not match its order (another epoch, session, node, kind or keys) is counted
        and logged, never booked."""
        order = self._order_of(report)
        if order is None:
            return
        now = self.clock.now_s()
        if not report.complete:
            self.failed(order, now, report.error or "incomplete", box)
            return
        self.orders.close(order)
        self._carry(self.core.transfer_done(order.session_id, order.node, now,
                                            demand=not order.prefetch), box)
        self._count_done(order, report)
        info = self.registry.by_sid(order.session_id)
        if info is not None and info.await_prefetch_node == order.node:
            info.await_prefetch_node = None
            self.lateness(now - info.arrival_s)

    def expire(self, wall: float, now: float, box: Outbox) -> None:
        """Give up orders not reported within ``order_timeout_s`` wall seconds of being
        sent: cancel them at their agents and re-plan them."""
        for node in range(self.config.fleet.nodes):
            for inflight in self.orders.in_flight(node):
                if wall - inflight.sent_wall_s > self.config.order_timeout_s:
                    self.stats.orders_lost += 1
                    o = inflight.order
                    box.cancel.append((o.node, o.session_id, o.order_id))
                    self.failed(o, now, "timed out", box)

    def lost_with_agent(self, node: int, incarnation: str, now: float, box: Outbox) -> None:
        """The agent of ``node`` is now ``incarnation``: the orders sent to an earlier one
        are lost with it (re-planned)."""
        for inflight in self.orders.in_flight(node):
            if inflight.incarnation != incarnation:
                self.stats.orders_lost += 1
                self.failed(inflight.order, now, "agent restarted", box)

    def unsent(self, order: TransferOrder, why: str, box: Outbox) -> None:
        """An order could not be handed to its agent (a no-op once it is closed)."""
        if self.orders.get(order.node, order.order_id) is not None:
            self.failed(order, self.clock.now_s(), why, box)

    def failed(self, order: TransferOrder, now: float, why: str, box: Outbox) -> None:
        """Close ``order`` as failed and let the core re-plan the session's load."""
        self.orders.close(order)
        self.stats.orders_failed += 1
        log.info("order %s (%s -> node %d) failed: %s; re-planning",
                 format_order_id(order.order_id), order.session_id, order.node, why)
        self._carry(self.core.transfer_failed(order.session_id, order.node, now), box)

    def lateness(self, seconds: float) -> None:
        """How long a routed request waits for the prefetch of its KV: from its arrival
        until the prefetch is ready (service seconds)."""
        self.stats.lateness_s.append(seconds)
        self.metrics.lateness(seconds)

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
        """Count a completed order: its TTLB (service seconds: the agent's wall seconds
        times the time compression) and its bytes, real and modelled."""
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
