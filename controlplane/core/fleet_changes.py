"""Changes of the fleet under the core: :class:`FleetChanges`.

Nodes restart cold (:meth:`FleetChanges.clear_local`), leave (:meth:`FleetChanges.node_left`)
and join empty (:meth:`FleetChanges.node_joined`); an agent reports what its tier really
holds (:meth:`FleetChanges.reconcile`) or a smaller tier than configured
(:meth:`FleetChanges.set_tier_capacity`). Called by the core's methods of the same names,
rarely (per restart, join, agent report or quota change), each in one core call whose step
carries the evictions, cancels and warm-up loads it decided.

Invariants: no request is routed to a node in ``down``; a node that comes back or joins
empty is *warmed* at once: its free DRAM is filled with the idle sessions routing will send
there, soonest predicted use first. Warm-ups fill free room only (they displace nothing, so
no forecast has to be confident), yield the link to demand loads and are outside the waste
budget (see :mod:`kvprefetch.controlplane.core.budgets`). Bytes are KV bytes, times
seconds on the driver's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvprefetch.controlplane.core.books import TierBooks
from kvprefetch.controlplane.core.draft import StepDraft
from kvprefetch.controlplane.core.forecasts import ForecastCache
from kvprefetch.controlplane.core.policies import PolicySpec
from kvprefetch.controlplane.core.prefetcher import Prefetcher
from kvprefetch.controlplane.core.sessions import Sessions
from kvprefetch.controlplane.core.stats import CoreStats
from kvprefetch.controlplane.core.step import Placement

__all__ = ["FleetChanges"]


class FleetChanges:
    """Node restarts, departures, joins and tier reports of one core (module docstring)."""

    def __init__(self, policy: PolicySpec, forecasts: ForecastCache, books: TierBooks,
                 prefetcher: Prefetcher, sessions: Sessions, stats: CoreStats,
                 draft: StepDraft) -> None:
        self._policy = policy
        self._forecasts = forecasts
        self._books = books
        self._prefetcher = prefetcher
        self._sessions = sessions
        self._stats = stats
        self._draft = draft
        #: Nodes not in the fleet now (left, or not joined yet): never routed to.
        self.down: set[int] = set()

    def clear_local(self, now_s: float) -> None:
        """Every node restarted cold: forget their DRAM tiers, re-plan idle sessions and
        warm every node with the sessions at home there."""
        for node, tier in enumerate(self._books.tiers):
            for e in tier.clear():
                self._draft.dropped.append(Placement(e.session_id, node))
                self._stats.wasted_bytes += e.prefetch_unused_bytes
        if self._policy.prefetch:
            # Warm first (free room, outside the waste budget), then plan what did not fit.
            sessions = self._sessions
            for node in range(len(self._books.tiers)):
                self._warm(node, [sid for sid, s in sorted(sessions.items())
                                  if s.home == node], now_s)
            for sid in sorted(sessions):
                s = sessions[sid]
                if s.home is not None and not s.in_flight:
                    self._prefetcher.plan(sid, now_s)

    def node_left(self, node: int) -> None:
        """A node left the fleet (or is not in it yet): no request is routed there, its
        books are dropped, transfers to it stop, and its sessions have no home until they
        are served again."""
        self.down.add(node)
        for entry in self._books.tiers[node].clear():
            self._draft.dropped.append(Placement(entry.session_id, node))
        for sid, s in sorted(self._sessions.items()):
            if node in s.inflight_nodes:
                self._books.cancel(sid, node)
            if s.home == node:
                s.home = None
                s.pending = None
                self._prefetcher.due_dirty.add(sid)

    def node_joined(self, node: int, now_s: float) -> None:
        """A node joined (empty): requests may be routed there from now on. Idle sessions
        whose KV is local nowhere have no locality to keep them where they were, so the
        router sends them by load: to this node first. It is warmed with them (they move
        home here), soonest predicted use first, within its free DRAM."""
        self.down.discard(node)
        if self._policy.prefetch:
            local_tokens = self._books.local_tokens
            adrift = [sid for sid, s in sorted(self._sessions.items())
                      if s.home is not None and s.home != node
                      and local_tokens(s.home, sid) == 0]
            self._warm(node, adrift, now_s, rehome=True)

    def reconcile(self, node: int, holds: Callable[[str, int], bool], now_s: float) -> None:
        """A node's agent reported what its tier holds: drop the book entries of sessions it
        does not hold (``holds(session_id, tokens)``), except those still arriving, whose
        transfers decide, and plan the idle ones again (a prefetch may bring them back, as
        after an eviction). Unknown sessions' entries are dropped too. What a prefetch
        brought into a dropped entry and no request read counts as wasted."""
        for entry in list(self._books.tiers[node]):
            if entry.ready_at_s > now_s:
                continue
            sid = entry.session_id
            if sid not in self._sessions or not holds(sid, entry.tokens):
                self._stats.wasted_bytes += entry.prefetch_unused_bytes
                self._books.drop(node, sid)
                self._prefetcher.plan_again(sid, now_s)

    def set_tier_capacity(self, node: int, capacity_bytes: int, now_s: float) -> None:
        """The node's DRAM-tier books may hold ``capacity_bytes`` from now on. Over the new
        capacity, the sessions the policy evicts first go (the last one cut back to a
        prefix under suffix eviction) and are planned again. KV still arriving (or loaded
        for a waiting request) is pinned: if that alone is over, every other session goes
        and the books stay over until it lands (admissions find no free room)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        tier = self._books.tiers[node]
        tier.capacity_bytes = capacity_bytes
        over = tier.used_bytes - capacity_bytes
        if over > 0:
            victims = tier.victims_for(0, now_s)
            if victims is None:  # the pinned entries alone are over: all others go
                victims = [e for e in tier if not e.pinned]
            self._books.evict(node, victims, now_s, need_bytes=over)

    def _warm(self, node: int, sids: Sequence[str], now_s: float, *,
              rehome: bool = False) -> None:
        """Warm a node that is empty (restarted or joined): fill its free DRAM with the
        idle sessions of ``sids``, soonest predicted use first, at once (``rehome``: make
        the node their home)."""
        sessions = self._sessions
        homed = [sid for sid in sids
                 if not sessions[sid].in_flight and sessions[sid].remote_tokens > 0
                 and node not in sessions[sid].inflight_nodes]
        if not homed:
            return
        uses = self._forecasts.next_uses(homed, now_s)
        # Soonest predicted use first; sessions with no forecast of a return (their
        # predicted use is never) by recency, as an LRU tier would have kept them.
        order = sorted(zip(uses, homed, strict=True),
                       key=lambda u: (u[0], -sessions[u[1]].last_finish_s, u[1]))
        for use, sid in order:
            s = sessions[sid]
            ticket = self._books.reserve(sid, node, s.remote_tokens, prefetch=True,
                                         deadline_s=use, now_s=now_s, free_only=True,
                                         priority=0.0, warm_up=True)
            if ticket is not None:
                self._prefetcher.start_load(s, ticket, use)
                if rehome:
                    s.home = node
                    s.pending = None
                    self._prefetcher.due_dirty.add(sid)
