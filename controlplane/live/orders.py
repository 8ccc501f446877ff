"""The live service's order book: every transfer order sent to an agent and not yet
reported, by node and by (session, node), with bounded de-duplication of reports."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from controlplane.base.wire import TransferOrder
from controlplane.core.step import LoadTicket

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

    def __init__(self, nodes: int, *, applied_memory: int = APPLIED_MEMORY) -> None:
        self._ids = itertools.count(1)
        self._nodes: list[dict[int, InflightOrder]] = [{} for _ in range(nodes)]
        self._by_session: dict[tuple[str, int], int] = {}
        self._applied: OrderedDict[int, None] = OrderedDict()
        self._applied_memory = applied_memory

    def open(self, ticket: LoadTicket, keys: tuple[str, ...], *, wall_s: float,
             incarnation: str) -> TransferOrder:
        """Book a new order carrying out ``ticket`` (its priority included)."""
        oid = next(self._ids)
        order = TransferOrder(oid, ticket.session_id, ticket.node, keys, ticket.tokens,
                              ticket.nbytes, ticket.prefetch, ticket.deadline_s,
                              ticket.priority)
        self._nodes[ticket.node][oid] = InflightOrder(order, wall_s, incarnation)
        self._by_session[(ticket.session_id, ticket.node)] = oid
        return order

    def get(self, node: int, order_id: int) -> InflightOrder | None:
        return self._nodes[node].get(order_id)

    def of_session(self, session_id: str, node: int) -> TransferOrder | None:
        oid = self._by_session.get((session_id, node))
        inflight = self._nodes[node].get(oid) if oid is not None else None
        return inflight.order if inflight is not None else None

    def close(self, order: TransferOrder) -> None:
        """The order is over (done, failed or given up); later reports of it are dropped."""
        self._nodes[order.node].pop(order.order_id, None)
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
