"""How the live service reaches the outside: the agents (orders, cancels, evict advice) and
the metrics sink; and its own counters, every per-event collection bounded."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from kvprefetch.controlplane.base.wire import TransferOrder
from kvprefetch.controlplane.core.quotas import TenantQuotaStats

log = logging.getLogger(__name__)

#: Reads the tenants' share books: ((tenant, node name) -> bytes, tenant -> what its
#: shares did).
ShareBooks = Callable[[], tuple[Mapping[tuple[str, str], int], Mapping[str, TenantQuotaStats]]]


@dataclass(frozen=True, slots=True)
class SchedulerGauges:
    """The scheduler's gauges, read at scrape time: orders in flight by node name and the
    core's prefetch accounting so far (bytes wasted, bytes read, prefetches its waste
    budget refused, bytes of warm-ups of empty nodes), its quota of each node's DRAM
    tier by node name (booked bytes; it follows the agents' reports) and the service's
    health counts so far (orders failed and lost, control-loop errors)."""

    orders_in_flight: Mapping[str, int]
    wasted_bytes: int
    useful_bytes: int
    over_budget: int
    warmup_bytes: int = 0
    tier_quota_bytes: Mapping[str, int] = field(default_factory=dict)
    orders_failed: int = 0
    orders_lost: int = 0
    loop_errors: int = 0
    bets_won: int = 0
    bets_lost: int = 0
    #: Per node name, the node's agent's prefetches held while its engine was busy and
    #: those dropped past their deadline, as its latest status says (since its start).
    agent_orders_deferred: Mapping[str, int] = field(default_factory=dict)
    agent_orders_dropped_late: Mapping[str, int] = field(default_factory=dict)


#: TTLB and lateness samples kept for the summary (a rolling window; Prometheus histograms
#: see every sample).
SAMPLE_WINDOW = 10_000


class AgentPort(Protocol):
    """How the service reaches one node's agent. Calls must not block for long (they are
    fire-and-forget in Ray)."""

    def execute(self, order: TransferOrder) -> None: ...

    def cancel(self, session_id: str, order_id: int) -> None: ...

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None: ...


class ServiceMetricsSink(Protocol):
    """Where the service reports measurements (Prometheus in
    :mod:`kvprefetch.controlplane.live.metrics`)."""

    def event(self, kind: str) -> None: ...

    def ttlb(self, seconds: float, prefetch: bool) -> None: ...

    def lateness(self, seconds: float) -> None: ...

    def local_lookup(self, local_tokens: int, reused_tokens: int) -> None: ...

    def bytes_moved(self, nbytes: int, prefetch: bool) -> None: ...

    def scheduler_gauges_from(self, read: Callable[[], SchedulerGauges]) -> None:
        """Where to read, when the metrics are read, the scheduler's gauges."""
        ...

    def tenant_sessions(self, tenant: str, live: int) -> None:
        """The tenant now holds ``live`` live sessions."""
        ...

    def quota_refused(self, tenant: str) -> None:
        """A call of the tenant was refused: it holds its quota of live sessions."""
        ...

    def tenant_shares_from(self, books: ShareBooks) -> None:
        """Where to read, when the metrics are read, each quota'd tenant's bytes in each
        node's local-tier books ((tenant, node name) -> bytes) and what its shares did so
        far (cumulative)."""
        ...


class NullMetrics:
    def event(self, kind: str) -> None: ...
    def ttlb(self, seconds: float, prefetch: bool) -> None: ...
    def lateness(self, seconds: float) -> None: ...
    def local_lookup(self, local_tokens: int, reused_tokens: int) -> None: ...
    def bytes_moved(self, nbytes: int, prefetch: bool) -> None: ...
    def scheduler_gauges_from(self, read: Callable[[], SchedulerGauges]) -> None: ...
    def tenant_sessions(self, tenant: str, live: int) -> None: ...
    def quota_refused(self, tenant: str) -> None: ...
    def tenant_shares_from(self, books: ShareBooks) -> None: ...


def _window() -> deque[float]:
    return deque(maxlen=SAMPLE_WINDOW)


@dataclass(slots=True)
class ServiceStats:
    events: int = 0
    routes: int = 0
    orders_sent: int = 0
    orders_done: int = 0
    orders_failed: int = 0
    orders_lost: int = 0
    #: Orders called off by the core (the session went elsewhere or closed): with done,
    #: failed and those in flight, they add up to the orders sent.
    orders_cancelled: int = 0
    #: Real bytes the agents moved (scaled by the engines' kv_scale).
    prefetch_bytes: int = 0
    demand_bytes: int = 0
    #: The same transfers at modelled size (the books: tokens x KV bytes per token).
    prefetch_model_bytes: int = 0
    demand_model_bytes: int = 0
    loop_errors: int = 0
    #: Re-plans of the idle sessions whose KV left their node (every sweep interval).
    sweeps: int = 0
    #: Reports not booked because they do not match their order, by reason:
    #: ``stale_epoch`` (from an older scheduler incarnation), ``unknown_node``,
    #: ``unknown_order``, ``incarnation``, and ``session``, ``node``, ``kind``, ``keys``
    #: (see :func:`~kvprefetch.controlplane.live.orders.report_mismatch`).
    reports_rejected: dict[str, int] = field(default_factory=dict)
    #: Second reports of an order already over (the engine and the agent both report).
    reports_duplicate: int = 0
    #: Journal records quarantined when the service started (damaged or out of range).
    journal_quarantined: int = 0
    #: Journal compactions done, and the closed sessions' records they dropped.
    journal_compactions: int = 0
    journal_records_dropped: int = 0
    #: Calls refused because their tenant held its quota of live sessions.
    quota_refusals: int = 0
    #: ``request_finished`` calls on no node (their route gave no advice): acknowledged,
    #: not recorded.
    finishes_without_node: int = 0
    #: Times an agent's status moved this shard's quota of a node's tier.
    quota_changes: int = 0
    #: Books entries dropped because the node's tier evicted them by its own order.
    tier_evictions: int = 0
    #: Sessions the nodes' engines dropped from HBM (their KV events), and the HBM
    #: listings that replaced a node's mirror (an agent's first, or after a gap).
    hbm_evictions: int = 0
    hbm_resyncs: int = 0
    #: Per node, its agent's (orders deferred, orders dropped late) as of its latest
    #: status (``AgentStatus``; since the agent started).
    agent_warming: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: The latest :data:`SAMPLE_WINDOW` samples.
    ttlb_s: deque[float] = field(default_factory=_window)
    lateness_s: deque[float] = field(default_factory=_window)
    #: Wall seconds of each control-loop planning step (firing due orders and sweeps,
    #: expiring lost orders, under the lock), and how many there were in all.
    plan_step_s: deque[float] = field(default_factory=_window)
    plan_steps: int = 0


@dataclass(slots=True)
class Outbox:
    """Messages decided under the service's lock, sent after it is released."""

    execute: list[TransferOrder] = field(default_factory=list)
    cancel: list[tuple[int, str, int]] = field(default_factory=list)
    evict: list[tuple[int, tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.execute or self.cancel or self.evict)


class AgentFanout:
    """Sends an outbox to the nodes' agents. An agent that cannot be reached never stops
    the service: the failure is logged, and an order that could not be sent is handed to
    ``unsent`` (the service re-plans it)."""

    def __init__(self, agents: Mapping[int, AgentPort],
                 unsent: Callable[[TransferOrder, str], None]) -> None:
        self.agents: dict[int, AgentPort] = dict(agents)
        self._unsent = unsent

    def send(self, box: Outbox) -> None:
        for node, sid, oid in box.cancel:
            port = self.agents.get(node)
            if port is not None:
                self._call(node, "cancel", partial(port.cancel, sid, oid))
        for node, prefixes, keys in box.evict:
            port = self.agents.get(node)
            if port is not None:
                self._call(node, "evict", partial(port.evict, prefixes, keys))
        for order in box.execute:
            port = self.agents.get(order.node)
            why = ("no agent on the node" if port is None
                   else self._call(order.node, "execute", partial(port.execute, order)))
            if why is not None:
                self._unsent(order, why)

    @staticmethod
    def _call(node: int, what: str, call: Callable[[], None]) -> str | None:
        try:
            call()
        except Exception as exc:  # an unreachable agent must not stop the service
            log.warning("node %d: agent %s failed: %s", node, what, exc)
            return f"{type(exc).__name__}: {exc}"
        return None
