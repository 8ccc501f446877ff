"""The scheduling core: one object that decides, and nothing that moves bytes.

:class:`SchedulerCore` is the face of the step contract: the simulator (virtual clock) and
the live service (wall clock) call its event methods, and each returns one
:class:`~kvprefetch.controlplane.core.step.StepOutput` that the driver carries out (start
loads, stop transfers, arm orders, advise evictions and trims); drivers hold no policy of
their own. It is pure and deterministic: no clock (every call takes ``now_s``), no I/O, no
Ray; the physics comes through a :class:`~kvprefetch.controlplane.core.view.FleetView`.

The decisions are made by collaborators, one per concern, sharing the per-session state
(:mod:`~kvprefetch.controlplane.core.sessions`) and the draft of the call under way
(:mod:`~kvprefetch.controlplane.core.draft`):

* :mod:`~kvprefetch.controlplane.core.forecasts`: the predictor, its forecasts and the
  predicted-use eviction keys;
* :mod:`~kvprefetch.controlplane.core.books`: every node's DRAM-tier books, write-through,
  room for loads, (suffix) eviction;
* :mod:`~kvprefetch.controlplane.core.budgets`: the waste budget and tenant shares;
* :mod:`~kvprefetch.controlplane.core.loads`: demand loads and the timed loads of queued
  requests;
* :mod:`~kvprefetch.controlplane.core.prefetcher`: deadline-driven prefetches of idle
  sessions and the sweep;
* :mod:`~kvprefetch.controlplane.core.fleet_changes`: restarts, departures, joins, tier
  reports.

Who calls what
--------------
* per request: :meth:`request_started` (arrival) -> :meth:`route_request` (the node, and at
  arrival the demand load for policies that load then, or a timed load behind a long
  queue) -> :meth:`gpu_start` when the node's GPU picks it up -> :meth:`use_local` when it
  reads its local tier (or :meth:`mark_read` after the fact) -> :meth:`request_finished`;
* per transfer: :meth:`transfer_done` or :meth:`transfer_failed`;
* per armed order (a prefetch, or a queued request's timed load), at its ``start_at_s``:
  :meth:`start_prefetch`;
* every ``planner.sweep_interval_s``: :meth:`sweep`;
* per hint and session close: :meth:`hint`, :meth:`close`;
* node restarts: :meth:`clear_local` (every node cold), :meth:`reconcile` and
  :meth:`forget_local` (one node's agent reported what its tier really holds);
* fleet changes: :meth:`node_left`, :meth:`node_joined` (warmed at once),
  :meth:`set_tier_capacity`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.keys import DEFAULT_CHUNK_TOKENS
from kvprefetch.controlplane.base.types import SessionEvent
from kvprefetch.controlplane.core.books import TierBooks
from kvprefetch.controlplane.core.budgets import Budgets
from kvprefetch.controlplane.core.draft import StepDraft
from kvprefetch.controlplane.core.fleet_changes import FleetChanges
from kvprefetch.controlplane.core.forecasts import ForecastCache
from kvprefetch.controlplane.core.loads import DemandLoads
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.policies import PolicySpec
from kvprefetch.controlplane.core.prefetcher import (
    MAX_PREFETCHES_PER_IDLE,
    MAX_REPLANS,
    Prefetcher,
)
from kvprefetch.controlplane.core.quotas import TenantQuota, TenantShares
from kvprefetch.controlplane.core.router import NodeNumbers, RouteDecision, Router, RouteRequest
from kvprefetch.controlplane.core.sessions import Sessions
from kvprefetch.controlplane.core.stats import CoreStats, summed
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.core.tiers import IndexedTier, IndexStats
from kvprefetch.controlplane.core.view import FleetView, IdleFleet
from kvprefetch.predictors.base import Predictor

__all__ = ["MAX_PREFETCHES_PER_IDLE", "MAX_REPLANS", "CoreStats", "FleetView", "IdleFleet",
           "SchedulerCore", "summed"]

INF = float("inf")


class SchedulerCore:
    """See the module docstring. One instance per fleet (per policy in the simulator, per
    shard in a sharded deployment)."""

    def __init__(
        self, fleet: FleetConfig, policy: PolicySpec, predictor: Predictor, view: FleetView,
        *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, indexed_sweep: bool = True,
        tenant_quotas: Mapping[str, TenantQuota] | None = None,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
        self.fleet = fleet
        self.policy = policy
        self.predictor = predictor
        self.view = view
        #: The engine writes a context to DRAM when HBM evicts it
        #: (``PolicySpec.demote_on_evict``) and reports what its HBM evicts
        #: (:meth:`hbm_evicted`).
        self.demote_on_evict = policy.demote_on_evict and policy.dram_tier
        self.bpt = fleet.model.kv_bytes_per_token
        #: Granularity of suffix eviction: the agents' chunk (LMCache's, 256 tokens).
        self.chunk_tokens = chunk_tokens
        self.stats = CoreStats()
        self._router = Router(fleet)
        self._sessions = Sessions(remote=policy.remote)
        self._draft = StepDraft()
        #: Which node tiers hold each session (kept by the tiers): an event of a session
        #: invalidates its eviction key in those only.
        holders: dict[str, set[IndexedTier]] = {}
        self._forecasts = ForecastCache(predictor, fleet.planner, self._sessions, holders)
        #: Per-tenant shares of each node's tier and prefetch bandwidth
        #: (:mod:`kvprefetch.controlplane.core.quotas`); None without quotas.
        self.shares: TenantShares | None = TenantShares(
            tenant_quotas, nic_bytes_per_s=fleet.node.nic_bytes_per_s,
            known=lambda sid: sid in self._sessions or sid in holders,
        ) if tenant_quotas else None
        self._budgets = Budgets(policy, fleet.planner, self.stats, self.shares)
        self._books = TierBooks(fleet, policy, view, self._forecasts, self._budgets,
                                self._sessions, self.stats, self._draft, holders,
                                chunk_tokens=chunk_tokens,
                                demote_on_evict=self.demote_on_evict)
        #: The books of every node's local DRAM tier (authoritative for what agents hold).
        self.dram = self._books.tiers
        self._loads = DemandLoads(fleet, policy, view, self._books, self._sessions,
                                  self._draft)
        self._prefetcher = Prefetcher(fleet, policy, view, self._forecasts, self._books,
                                      self._sessions, self.stats, self._draft,
                                      indexed_sweep=indexed_sweep)
        self._books.plan_evicted = self._prefetcher.plan
        self._books.prefetch_wasted = self._prefetcher.bets.wasted
        self._books.prefetch_read = self._prefetcher.bets.read
        self._changes = FleetChanges(policy, self._forecasts, self._books, self._prefetcher,
                                     self._sessions, self.stats, self._draft)

    # ------------------------------------------------------------------ the step contract
    def _output(self, route_decision: RouteDecision | None = None, *, promote: bool = False,
                prefetch_ready_s: float | None = None) -> StepOutput:
        """Close the call under way: what it decided, as one record for the driver."""
        if self._prefetcher.due_dirty:
            self._prefetcher.sync_due()
        return self._draft.close(self.dram, route_decision, promote=promote,
                                 prefetch_ready_s=prefetch_ready_s)

    def _observe(self, event: SessionEvent, context_tokens: int = 0) -> None:
        if self.shares is not None:
            self.shares.observe(event.session_id, event.tenant)
        self.predictor.observe(event)
        if self._books.retention is not None:
            self._books.retention.observe(event, context_tokens * self.bpt)
        self._forecasts.observed()
        self._forecasts.touch(event.session_id)
        self._prefetcher.due_dirty.add(event.session_id)

    # ------------------------------------------------------------------ what it holds
    def local_tokens(self, node: int, sid: str) -> int:
        """Tokens of the session on the node, in HBM or DRAM (ready or arriving)."""
        return self._books.local_tokens(node, sid)

    def dram_tokens(self, node: int, sid: str) -> int:
        """Tokens of the session in the node's DRAM books (ready or arriving)."""
        e = self.dram[node].get(sid)
        return e.tokens if e is not None else 0

    def remote_tokens(self, sid: str) -> int:
        """Tokens of the session's context in the remote store (0 under policies without
        one, and for sessions the core does not hold)."""
        return self._sessions.remote_tokens(sid)

    def sessions(self) -> int:
        """Sessions the core holds state for (closed ones are forgotten)."""
        return len(self._sessions)

    def eviction_index_stats(self) -> IndexStats:
        """The eviction indexes' work, summed over the nodes."""
        return summed(IndexStats, (tier.index_stats for tier in self.dram))

    # ------------------------------------------------------------------ requests
    def request_started(self, event: SessionEvent) -> StepOutput:
        """A request of the session arrived (before routing)."""
        sid = event.session_id
        s = self._sessions.of(sid)
        s.in_flight += 1
        s.pending = None
        s.prefetches = 0
        s.planned_use_s = None
        s.awaiting_node = None
        self._loads.disarm(sid, s)
        self._prefetcher.evicted.discard(sid)
        self._prefetcher.bets.arrived(sid, event.time_s)
        self._observe(event)
        return self._output()

    def route_request(self, sid: str, input_tokens: int, reused_tokens: int, now_s: float
                      ) -> StepOutput:
        """Pick the node for a request and act on it: transfers of the session heading to
        other nodes are cancelled, one heading to the chosen node becomes a demand load
        (``promote``), and the demand load starts now, is armed for later or is left to
        the GPU start, as the policy says (:mod:`kvprefetch.controlplane.core.loads`)."""
        decision = self._route(sid, input_tokens, reused_tokens, now_s)
        node = decision.node
        s = self._sessions.of(sid)
        if s.inflight_nodes:
            for other in sorted(n for n in s.inflight_nodes if n != node):
                self._books.cancel(sid, other)
        heading = s.inflight_nodes.get(node)
        promote = heading is not None and heading.prefetch
        ready: float | None = INF if promote else None
        d = self.dram[node].get(sid)
        if d is not None and d.prefetched_unused and d.ready_at_s <= now_s:
            ready = d.ready_at_s
        self._loads.routed(sid, s, node, reused_tokens, heading is not None, now_s)
        return self._output(decision, promote=promote, prefetch_ready_s=ready)

    def _route(self, sid: str, input_tokens: int, reused_tokens: int, now_s: float
               ) -> RouteDecision:
        """Locality + load, with affinity to the session's home node."""
        s = self._sessions.of(sid)
        s_per_byte, latency = self.view.remote_source(sid)
        req = RouteRequest(sid, input_tokens, reused_tokens, s.home, self.remote_tokens(sid),
                           s_per_byte, latency)
        view = self.view
        down = self._changes.down
        nodes: list[NodeNumbers] = []
        for n in range(self.fleet.nodes):
            if n in down:
                continue
            d = self.dram[n].get(sid)
            backlog = view.link_backlog_s(n, now_s)
            dram_wait = backlog if d is not None and d.ready_at_s > now_s else 0.0
            nodes.append((n, view.queue_wait_s(n, now_s), view.hbm_tokens(n, sid),
                          d.tokens if d else 0, dram_wait, backlog))
        return self._router.decide(req, nodes)

    def gpu_start(self, sid: str, node: int, reused_tokens: int, now_s: float) -> StepOutput:
        """The node's GPU picks the request up: policies that load then start the demand
        load of what the node lacks, unless the request already waits for a transfer."""
        self._loads.gpu_started(sid, node, reused_tokens, now_s)
        return self._output()

    def use_local(self, sid: str, node: int, reused_tokens: int, now_s: float) -> int:
        """The GPU starts the request: returns the usable DRAM-tier tokens and marks them
        read (a prefetch that is read is useful, not wasted)."""
        return self._books.use_local(sid, node, reused_tokens, now_s)

    def mark_read(self, sid: str, node: int, tokens: int, arrived_s: float) -> None:
        """A request that arrived at ``arrived_s`` and ran on ``node`` took ``tokens`` of
        its prompt from a cache, as its engine says after the fact (an engine that does
        not call :meth:`use_local`): the session's DRAM entry there, if it had landed by
        then, was read. Changes nothing but the prefetch accounting."""
        self._books.mark_read(sid, node, tokens, arrived_s)

    def request_finished(self, event: SessionEvent, context_tokens: int) -> StepOutput:
        """The response ended on ``event.node``: the session's KV is written through to the
        node's DRAM tier (under demote-on-evict only if HBM did not keep it: DRAM gets it
        when HBM evicts it) and the remote store; plan its next visit."""
        sid, now = event.session_id, event.time_s
        node = event.node if event.node is not None else 0
        s = self._sessions.of(sid)
        s.in_flight = max(0, s.in_flight - 1)
        s.home = node
        s.last_finish_s = now
        if self.policy.remote:
            s.remote_tokens = context_tokens
        self._observe(event, context_tokens)
        if self.demote_on_evict and self.view.hbm_tokens(node, sid) >= context_tokens:
            pass  # HBM holds it; DRAM keeps whatever older prefix it has until it evicts it
        elif self.policy.dram_tier and node not in s.inflight_nodes:
            self._books.write_through(sid, node, context_tokens, now)
        if self.policy.prefetch and not s.in_flight:
            self._prefetcher.plan(sid, now)
        return self._output()

    def hbm_evicted(self, sid: str, node: int, tokens: int, now_s: float) -> StepOutput:
        """The node's HBM dropped the session's ``tokens`` (or did not take them): under
        demote-on-evict they are written to its DRAM tier, which keeps them if its
        ranking makes room (the write-through's rule). An idle session of a prefetching
        policy is planned again: its KV may have left its home node with them."""
        s = self._sessions.get(sid)
        if (self.demote_on_evict and s is not None and node not in s.inflight_nodes
                and self.dram_tokens(node, sid) < tokens):
            self._books.write_through(sid, node, tokens, now_s)
        if self.policy.prefetch and s is not None and not s.in_flight and s.home == node:
            self._prefetcher.plan(sid, now_s)
        return self._output()

    # ------------------------------------------------------------------ transfers
    def transfer_done(self, sid: str, node: int, now_s: float, *, demand: bool) -> StepOutput:
        """The bytes landed. A demand load stays pinned until its request reads it."""
        self._books.landed(sid, node, now_s, demand=demand)
        return self._output()

    def transfer_failed(self, sid: str, node: int, now_s: float) -> StepOutput:
        """A transfer was lost or gave up (agent restart, timeout, error): drop what it
        reserved and plan the session again if it is idle."""
        self._books.lost(sid, node)
        self._prefetcher.plan_again(sid, now_s)
        return self._output()

    # ------------------------------------------------------------------ prefetches
    def start_prefetch(self, order: PrefetchOrder, now_s: float) -> StepOutput:
        """An armed order's start time came: re-check it and start the load, re-arm it
        (its forecast moved later), or drop it (superseded, the session is back, or no
        room). A ``queued`` order starts the demand load of its request if the GPU has
        not picked it up yet (the engine then waits for that transfer)."""
        if order.queued:
            self._loads.start_queued(order, now_s)
        else:
            self._prefetcher.start(order, now_s)
        return self._output()

    def sweep(self, now_s: float) -> StepOutput:
        """Re-plan idle sessions whose KV has left their home node and that have no armed
        order (their forecasts change as their silence grows). Called every
        ``planner.sweep_interval_s``; one batched forecast for all candidates."""
        self._prefetcher.sweep(now_s)
        return self._output()

    def hint(self, event: SessionEvent) -> StepOutput:
        """A hint changes the forecast: re-plan the session now."""
        self._observe(event)
        if self.policy.prefetch:
            self._prefetcher.plan(event.session_id, event.time_s)
        return self._output()

    def close(self, event: SessionEvent) -> StepOutput:
        """The session will not return: the predictor sees the close, its transfers stop and
        its state is dropped (idempotent). Its KV may stay in local tiers: with no forecast
        it is predicted never to be used again, so it is the first to go when room is
        needed."""
        self._observe(event)
        sid = event.session_id
        s = self._sessions.pop(sid, None)
        if s is not None:
            self._loads.disarm(sid, s)
            for node in sorted(s.inflight_nodes):
                self._books.cancel(sid, node)
        self._prefetcher.evicted.discard(sid)
        self._prefetcher.recheck.discard(sid)
        self._prefetcher.bets.forget(sid)
        self.predictor.forget(sid)
        self._forecasts.observed()
        return self._output()

    # ------------------------------------------------------------------ the fleet
    def clear_local(self, now_s: float) -> StepOutput:
        """Every node restarted cold: forget their DRAM tiers, re-plan idle sessions and
        warm the nodes (:mod:`kvprefetch.controlplane.core.fleet_changes`)."""
        self._changes.clear_local(now_s)
        return self._output()

    def node_left(self, node: int, now_s: float) -> StepOutput:
        """A node left the fleet (or is not in it yet): no request is routed there, its
        books are dropped, transfers to it stop, its sessions have no home."""
        self._changes.node_left(node)
        return self._output()

    def node_joined(self, node: int, now_s: float) -> StepOutput:
        """A node joined (empty): routed to from now on, and warmed with the idle sessions
        whose KV is local nowhere (they move home there)."""
        self._changes.node_joined(node, now_s)
        return self._output()

    def reconcile(self, node: int, holds: Callable[[str, int], bool], now_s: float
                  ) -> StepOutput:
        """A node's agent reported what its tier holds: drop the book entries of sessions it
        does not hold (``holds(session_id, tokens)``), except those still arriving, and
        plan the idle ones again. Unknown sessions' entries are dropped too."""
        self._changes.reconcile(node, holds, now_s)
        return self._output()

    def forget_local(self, node: int, sids: set[str], now_s: float) -> StepOutput:
        """The node's tier lost these sessions (it evicted them by its own order): their
        book entries go and idle ones are planned again, as in :meth:`reconcile`."""
        return self.reconcile(node, lambda sid, _tokens: sid not in sids, now_s)

    def set_tier_capacity(self, node: int, capacity_bytes: int, now_s: float) -> StepOutput:
        """The node's DRAM-tier books may hold ``capacity_bytes`` from now on (its agent
        reported a smaller tier than configured, or this shard's quota of it moved): over
        it, the sessions the policy evicts first go and are planned again. More capacity is
        free room for the next plans."""
        self._changes.set_tier_capacity(node, capacity_bytes, now_s)
        return self._output()
