"""The live service's view of the fleet: what the core's :class:`FleetView` needs, built
from the engines' and agents' reports and the service's own queue estimates."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.live.orders import OrderBook


@dataclass(slots=True)
class NodeState:
    #: Estimated service seconds of the requests routed here and not yet started.
    queued_est_s: float = 0.0
    running_end_s: float = 0.0
    #: Tokens of each session in the node's HBM (the engine's reports).
    hbm: dict[str, int] = field(default_factory=dict)
    #: The engine's block size when its HBM reports count whole blocks (0: exact counts).
    hbm_block_tokens: int = 0
    #: The current incarnation of the node's agent (orders to an earlier one are lost).
    incarnation: str = ""


class LiveFleet:
    """Implements :class:`~kvprefetch.controlplane.core.scheduler.FleetView` for the live service.
    Remote reads are costed at Valkey's rate (the hot tier in front of S3)."""

    def __init__(self, fleet: FleetConfig, orders: OrderBook) -> None:
        self.nodes = [NodeState() for _ in range(fleet.nodes)]
        self._orders = orders
        remote = fleet.remote
        self._latency_s = remote.valkey_latency_s
        self._s_per_byte = 1.0 / min(fleet.node.nic_bytes_per_s,
                                     remote.valkey_gbyte_s_per_node * 1e9)

    def queue_wait_s(self, node: int, now_s: float) -> float:
        n = self.nodes[node]
        return n.queued_est_s + max(0.0, n.running_end_s - now_s)

    def link_backlog_s(self, node: int, now_s: float) -> float:
        return self._orders.pending_bytes(node) * self._s_per_byte

    def hbm_tokens(self, node: int, session_id: str) -> int:
        """The session's tokens in the node's HBM; where the engine reports whole blocks,
        up to the end of the block after them (the engine never caches a trailing partial
        block, so holding every whole block is holding what it keeps of the context)."""
        n = self.nodes[node]
        tokens = n.hbm.get(session_id, 0)
        return tokens + n.hbm_block_tokens - 1 if tokens and n.hbm_block_tokens else tokens

    def remote_source(self, session_id: str) -> tuple[float, float]:
        return self._s_per_byte, self._latency_s

    def enqueue(self, node: int, est_s: float, moved_from: int | None, moved_est_s: float
                ) -> None:
        """A request routed to ``node`` (moved from ``moved_from`` if routed before)."""
        if moved_from is not None:
            self.dequeue(moved_from, moved_est_s)
        self.nodes[node].queued_est_s += est_s

    def dequeue(self, node: int, est_s: float) -> None:
        n = self.nodes[node]
        n.queued_est_s = max(0.0, n.queued_est_s - est_s)
