"""The live fleet's members: which node slots are in the fleet, their names, and what their
agents tell the scheduler about their tiers.

:class:`FleetMembership` is one of :class:`~kvprefetch.controlplane.live.driver.LiveDriver`'s
rooms. ``fleet.nodes`` is the fleet's capacity; a slot is *out* until its agent says hello
(at start: the slots from ``initial_nodes`` on), then joins (routed to, warmed with idle
sessions whose KV is local nowhere). Not thread-safe (the service's lock guards it); it
sends nothing itself: its decisions go through the driver's ``carry`` into the
:class:`~kvprefetch.controlplane.live.ports.Outbox` the service sends after its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvprefetch.controlplane.base.wire import AgentHello, AgentStatus, HbmReport, TierEvictions
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.live.config import ServiceClock, ServiceConfig
from kvprefetch.controlplane.live.fleet import LiveFleet
from kvprefetch.controlplane.live.node_registry import NodeListing, node_listing
from kvprefetch.controlplane.live.ports import Outbox, ServiceMetricsSink, ServiceStats
from kvprefetch.controlplane.live.sessions import SessionRegistry
from kvprefetch.controlplane.live.transfers import Carry, TransferOutcomes

log = logging.getLogger(__name__)


class FleetMembership:
    """Node slots in and out of the fleet, and the agents' calls about their nodes: hello
    (a (re)started agent; a joining node), status (the tier's capacity) and the tier's
    own evictions, and what the node's engine holds in HBM."""

    def __init__(self, config: ServiceConfig, core: SchedulerCore, fleet: LiveFleet,
                 registry: SessionRegistry, transfers: TransferOutcomes, clock: ServiceClock,
                 stats: ServiceStats, metrics: ServiceMetricsSink, carry: Carry) -> None:
        self.config = config
        self.core = core
        self.fleet = fleet
        self.registry = registry
        self.transfers = transfers
        self.clock = clock
        self.stats = stats
        self.metrics = metrics
        self._carry = carry
        #: Node slots out of the fleet (no agent yet): never routed to, warmed on joining.
        self.out_nodes: set[int] = set()
        self.nodes_joined = 0
        names = config.node_names
        self._names = list(names) if names is not None else [
            f"node-{i}" for i in range(config.fleet.nodes)]
        #: Each node's engine URL as its agent's latest hello named it ("" = none).
        self._engine_urls = [""] * config.fleet.nodes
        self.nodes_lost = 0

    def node_name(self, node: int) -> str:
        """The node's name: configured, else the one its agent gave when it joined, else
        ``node-<i>``."""
        return self._names[node]

    def mark_out(self, nodes: Iterable[int], box: Outbox) -> None:
        """Take node slots out of the fleet (at start: the nodes that have no agent yet).
        The core never routes to them and drops their books."""
        now = self.clock.now_s()
        for node in nodes:
            if node not in self.out_nodes:
                self.out_nodes.add(node)
                self._carry(self.core.node_left(node, now), box)
        if self.out_nodes:
            log.info("nodes %s are out of the fleet until their agents say hello",
                     ", ".join(str(n) for n in sorted(self.out_nodes)))

    def node_lost(self, node: int, box: Outbox) -> None:
        """The deployment lost the node (its Ray node died, its pod went away): it is out
        of the fleet (never routed to, its books dropped) until an agent of its slot says
        hello again. Counted in ``nodes_lost``; a node already out changes nothing."""
        if node in self.out_nodes:
            return
        self.nodes_lost += 1
        self.metrics.event("node_lost")
        log.warning("node %d (%s) was lost: out of the fleet until its agent says hello "
                    "again", node, self.node_name(node))
        self.mark_out([node], box)

    def listing(self) -> NodeListing:
        """The node registry (:mod:`~kvprefetch.controlplane.live.node_registry`)."""
        return node_listing(self._names, self.out_nodes, self._engine_urls)

    def node_joined(self, node: int, now: float, box: Outbox, *, replayed: bool = False
                    ) -> None:
        """An out node joined (its agent said hello, or a replayed event names it): the
        core routes to it from now on and warms it with idle sessions whose KV is local
        nowhere; the warm-up loads go to its agent like any others. Counted in
        ``nodes_joined`` and the ``node_joined`` event metric unless ``replayed``."""
        self.out_nodes.discard(node)
        before = len(box.execute)
        self._carry(self.core.node_joined(node, now), box)
        if replayed:
            return
        self.nodes_joined += 1
        self.metrics.event("node_joined")
        warm = box.execute[before:]
        log.info("node %d (%s) joined the fleet: warming it with %d sessions (%.1f MiB "
                 "modelled)", node, self.node_name(node), len(warm),
                 sum(o.nbytes for o in warm) / (1 << 20))

    def agent_hello(self, hello: AgentHello, box: Outbox) -> None:
        """An agent (re)started: orders sent to its previous incarnation are lost (re-plan
        them); reconcile the node's books with what its tier really holds. The agent of a
        node out of the fleet joins it (after the reconcile: it is warmed against books
        that match its tier)."""
        now = self.clock.now_s()
        joining = hello.node in self.out_nodes
        if joining and hello.node_name:
            self._names[hello.node] = hello.node_name
        if hello.engine_url:
            self._engine_urls[hello.node] = hello.engine_url
        self.fleet.nodes[hello.node].incarnation = hello.incarnation
        self.transfers.lost_with_agent(hello.node, hello.incarnation, now, box)
        if hello.inventory is not None:
            inventory = set(hello.inventory)

            def holds(sid: str, tokens: int) -> bool:
                info = self.registry.by_sid(sid)
                keys = self.registry.keys_of(info, tokens) if info is not None else []
                return info is not None and (not keys or keys[0] in inventory)

            self._carry(self.core.reconcile(hello.node, holds, now), box)
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
        incarnation than the node's current one changes nothing; one of no capacity
        changes only the agent's warming counters kept for the metrics."""
        node = self.fleet.nodes[status.node]
        if node.incarnation and status.incarnation != node.incarnation:
            return
        self.stats.agent_warming[status.node] = (status.orders_deferred,
                                                 status.orders_dropped_late)
        if status.capacity_bytes <= 0:
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
        self._carry(self.core.set_tier_capacity(status.node, quota, self.clock.now_s()), box)

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
        self._carry(self.core.forget_local(evictions.node, set(evictions.sessions),
                                           self.clock.now_s()), box)
        self.stats.tier_evictions += before - len(self.core.dram[evictions.node])

    def hbm_changed(self, report: HbmReport, box: Outbox) -> None:
        """The node's engine's HBM prefix cache changed (its KV events, through the
        node's agent): the node's HBM mirror (what routing and the books count as local
        in HBM) takes the reported tokens, a ``full`` listing replaces it. A session whose
        HBM prefix shrank is handed to the core as an HBM eviction
        (:meth:`SchedulerCore.hbm_evicted`: under demote-on-evict its context is booked
        into the node's DRAM tier, where the engine writes it on eviction). A report of
        another incarnation than the node's current one changes nothing."""
        node = self.fleet.nodes[report.node]
        if node.incarnation and report.incarnation != node.incarnation:
            return
        hbm = node.hbm
        if report.block_tokens:
            node.hbm_block_tokens = report.block_tokens
        named = dict(report.sessions)
        before = dict(hbm)
        if report.full:
            hbm.clear()
            self.stats.hbm_resyncs += 1
        for sid, tokens in named.items():
            if tokens > 0:
                hbm[sid] = tokens
            else:
                hbm.pop(sid, None)
        now = self.clock.now_s()
        for sid, old in sorted(before.items()):
            if hbm.get(sid, 0) < old:
                self.stats.hbm_evictions += 1
                self._carry(self.core.hbm_evicted(sid, report.node, old, now), box)
