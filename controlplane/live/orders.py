"""The live service's order book: every transfer order sent to an agent and not yet
reported, by id and by (session, node), with bounded de-duplication of reports; and the
check of a report against its order (:func:`report_mismatch`).

Order ids carry the scheduler's epoch (:func:`~kvprefetch.controlplane.base.wire.make_order_id`):
the book issues ids of one epoch, set by :meth:`OrderBook.begin_epoch` when the service starts.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from kvprefetch.controlplane.base.wire import (
    TransferOrder,
    TransferReport,
    keys_digest,
    make_order_id,
    order_epoch,
)
from kvprefetch.controlplane.core.step import LoadTicket

#: Reports of this many most recent orders are remembered to drop duplicates (an agent
#: may report an order twice: once to the engine waiting for it, once on its own).
APPLIED_MEMORY = 65_536


@dataclass(slots=True)
class InflightOrder:
    order: TransferOrder
    sent_wall_s: float
    #: The agent incarnation it was sent to: a restarted agent has lost it.
    incarnation: str


class OrderBook:
    """Orders in flight on ``nodes`` nodes. Not thread-safe: the service's lock guards it."""

    def __init__(self, nodes: int, *, applied_memory: int = APPLIED_MEMORY,
                 epoch: int = 0) -> None:
        self._nodes: list[dict[int, InflightOrder]] = [{} for _ in range(nodes)]
        self._by_id: dict[int, InflightOrder] = {}
        self._by_session: dict[tuple[str, int], int] = {}
        self._applied: OrderedDict[int, None] = OrderedDict()
        self._applied_memory = applied_memory
        self.begin_epoch(epoch)

    def begin_epoch(self, epoch: int) -> None:
        """Issue the next ids in ``epoch`` (the service calls it once, when it starts)."""
        self.epoch = epoch
        self._seq = itertools.count(1)

    def open(self, ticket: LoadTicket, keys: tuple[str, ...], *, wall_s: float,
             incarnation: str, due_in_wall_s: float | None = None) -> TransferOrder:
        """Book a new order carrying out ``ticket`` (its priority included);
        ``due_in_wall_s``: wall seconds from now to its deadline."""
        oid = make_order_id(self.epoch, next(self._seq))
        order = TransferOrder(oid, ticket.session_id, ticket.node, keys, ticket.tokens,
                              ticket.nbytes, ticket.prefetch, ticket.deadline_s,
                              ticket.priority, due_in_wall_s)
        inflight = InflightOrder(order, wall_s, incarnation)
        self._nodes[ticket.node][oid] = self._by_id[oid] = inflight
        self._by_session[(ticket.session_id, ticket.node)] = oid
        return order

    def get(self, node: int, order_id: int) -> InflightOrder | None:
        return self._nodes[node].get(order_id)

    def by_id(self, order_id: int) -> InflightOrder | None:
        """The order in flight with this id, whatever its node."""
        return self._by_id.get(order_id)

    def of_session(self, session_id: str, node: int) -> TransferOrder | None:
        oid = self._by_session.get((session_id, node))
        inflight = self._nodes[node].get(oid) if oid is not None else None
        return inflight.order if inflight is not None else None

    def close(self, order: TransferOrder) -> None:
        """The order is over (done, failed or given up); later reports of it are dropped."""
        self._nodes[order.node].pop(order.order_id, None)
        self._by_id.pop(order.order_id, None)
        if self._by_session.get((order.session_id, order.node)) == order.order_id:
            del self._by_session[(order.session_id, order.node)]
        self._applied[order.order_id] = None
        while len(self._applied) > self._applied_memory:
            self._applied.popitem(last=False)

    def was_closed(self, order_id: int) -> bool:
        return order_id in self._applied

    def in_flight(self, node: int) -> list[InflightOrder]:
        return list(self._nodes[node].values())

    def count(self, node: int) -> int:
        return len(self._nodes[node])

    def pending_bytes(self, node: int) -> int:
        return sum(i.order.nbytes for i in self._nodes[node].values())

    def sizes(self) -> dict[str, int]:
        """Sizes of the bounded collections (for metrics and the summary)."""
        return {"orders_in_flight": sum(len(n) for n in self._nodes),
                "applied_memory": len(self._applied)}


def report_mismatch(report: TransferReport, order: TransferOrder) -> str | None:
    """Why ``report`` cannot be the outcome of ``order`` (a short reason, the label of the
    ``reports_rejected`` counter), or None when it matches: same epoch, session, node and
    kind; key counts within the order's keys; the same keys when the agent sent their
    digest."""
    if order_epoch(report.order_id) != order.epoch:
        return "stale_epoch"
    if report.session_id != order.session_id:
        return "session"
    if report.node != order.node:
        return "node"
    if report.prefetch != order.prefetch:
        return "kind"
    counts = (report.keys_moved, report.keys_present, report.keys_missed, report.keys_failed)
    if min(counts) < 0 or sum(counts) > len(order.keys):
        return "keys"
    if report.complete and report.keys_moved + report.keys_present != len(order.keys):
        return "keys"
    if report.keys_digest and report.keys_digest != keys_digest(order.keys):
        return "keys"
    return None
