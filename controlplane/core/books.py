"""The books of every node's local (DRAM) tier: :class:`TierBooks`.

The core's authoritative record of what each node's tier holds or is receiving (in the
simulator it *is* the tier; live, the agents' reports reconcile it), and every decision
that changes it: write-through at a finish, room reserved for a load, evictions (cut back
to a prefix under suffix eviction), landings and losses of transfers, reads. Called by the
core and its collaborators on every event that touches a node's tier; each admission asks
the budgets (:mod:`kvprefetch.controlplane.core.budgets`) first.

Invariants: an entry's ``ready_at_s`` is ``inf`` while its transfer is under way; an entry
pinned by a load stays until its request reads it (:meth:`TierBooks.use_local`); every
entry dropped or cut is recorded in the step draft (reported unless re-admitted within the
call) and its unread prefetched bytes counted wasted; an idle session evicted under a
prefetching policy is planned again (``plan_evicted``, wired by the core). Sizes are tokens
and KV bytes (``bpt`` bytes per token); times seconds on the driver's clock.

Suffix eviction
---------------
Under policies with ``suffix_eviction`` room is made by cutting the last victim back to the
whole chunks (``chunk_tokens``) of its prefix that the room does not need, instead of
dropping it: a returning request reuses its context from the start, so the prefix left
local shortens its load by that much, and a tier of a few large contexts no longer frees a
whole session's bytes to fit a little more. The step reports the cut as a
:class:`~kvprefetch.controlplane.core.step.Trim` (the agent deletes the chunks past it); the
trimmed session is planned again like an evicted one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.core.budgets import Budgets
from kvprefetch.controlplane.core.draft import StepDraft
from kvprefetch.controlplane.core.forecasts import ForecastCache
from kvprefetch.controlplane.core.policies import EvictionKind, PolicySpec
from kvprefetch.controlplane.core.retention_window import LognormalRetention
from kvprefetch.controlplane.core.sessions import Sessions
from kvprefetch.controlplane.core.stats import CoreStats
from kvprefetch.controlplane.core.step import DEMAND_PRIORITY, LoadTicket, Placement
from kvprefetch.controlplane.core.tiers import (
    INF,
    IndexedLruEviction,
    IndexedTier,
    PredictedUseEviction,
    TierEntry,
)
from kvprefetch.controlplane.core.view import FleetView

__all__ = ["TierBooks"]


def _not_wired(sid: str, now_s: float) -> None:
    raise AssertionError("TierBooks.plan_evicted is wired by the core")


class TierBooks:
    """Every node's DRAM-tier books (module docstring); ``tiers[node]`` is one node's."""

    def __init__(self, fleet: FleetConfig, policy: PolicySpec, view: FleetView,
                 forecasts: ForecastCache, budgets: Budgets, sessions: Sessions,
                 stats: CoreStats, draft: StepDraft, holders: dict[str, set[IndexedTier]],
                 *, chunk_tokens: int, demote_on_evict: bool = False) -> None:
        self._policy = policy
        #: DRAM is written when HBM evicts (``SchedulerCore.demote_on_evict``).
        self.demote_on_evict = demote_on_evict
        self._view = view
        self._forecasts = forecasts
        self._budgets = budgets
        self._sessions = sessions
        self._stats = stats
        self._draft = draft
        self.bpt = fleet.model.kv_bytes_per_token
        #: Granularity of suffix eviction: the agents' chunk (LMCache's, 256 tokens).
        self.chunk_tokens = chunk_tokens
        #: The strategy prefetches evict by (the tiers' own, except under LRU); indexed, so
        #: that no decision scans every resident.
        self.predicted_use = PredictedUseEviction(forecasts.next_uses,
                                                  next_use_one=forecasts.next_use)
        #: The retention windows of ``ttl-lognormal`` (None under every other policy).
        self.retention: LognormalRetention | None = None
        strategy: IndexedLruEviction | PredictedUseEviction | LognormalRetention
        if policy.eviction is EvictionKind.LRU:
            strategy = IndexedLruEviction()
        elif policy.eviction is EvictionKind.RETENTION_WINDOW:
            strategy = self.retention = LognormalRetention(
                tier_bytes=fleet.node.dram_tier_bytes if policy.dram_tier else 0)
        else:
            strategy = self.predicted_use
        capacity = fleet.node.dram_tier_bytes if policy.dram_tier else 0
        self.tiers = [IndexedTier(f"dram{i}", capacity, strategy, holders=holders)
                      for i in range(fleet.nodes)]
        #: Sessions whose local copy grew by a load since the sweep last looked at them.
        self.grown: set[str] = set()
        #: Plans an idle session again after an eviction (the prefetcher's ``plan``).
        self.plan_evicted: Callable[[str, float], None] = _not_wired
        #: A prefetch of the session was evicted unread (its bets are lost) ...
        self.prefetch_wasted: Callable[[str], None] = lambda sid: None
        #: ... or a request read it.
        self.prefetch_read: Callable[[str], None] = lambda sid: None

    def local_tokens(self, node: int, sid: str) -> int:
        """Tokens of the session on the node, in HBM or DRAM (ready or arriving)."""
        d = self.tiers[node].get(sid)
        return max(self._view.hbm_tokens(node, sid), d.tokens if d is not None else 0)

    def drop(self, node: int, sid: str) -> TierEntry | None:
        """Remove the session from a node's books (reported as an eviction)."""
        entry = self.tiers[node].remove(sid)
        if entry is not None:
            self._draft.dropped.append(Placement(sid, node))
            self._forecasts.left_tier(sid)
        return entry

    def cancel(self, sid: str, node: int) -> None:
        """Stop the session's transfer to the node and drop what it reserved."""
        self.lost(sid, node)
        self._draft.cancels.append(Placement(sid, node))

    def lost(self, sid: str, node: int) -> None:
        """The session's transfer to the node is gone: drop what it reserved."""
        s = self._sessions.get(sid)
        if s is not None:
            s.inflight_nodes.pop(node, None)
        self.drop(node, sid)

    def landed(self, sid: str, node: int, now_s: float, *, demand: bool) -> None:
        """The transfer's bytes landed; a demand load stays pinned until it is read."""
        s = self._sessions.get(sid)
        if s is not None:
            s.inflight_nodes.pop(node, None)
        entry = self.tiers[node].get(sid)
        if entry is not None:
            entry.ready_at_s = now_s
            entry.last_use_s = now_s
            if not demand:
                entry.pinned = 0

    def evict(self, node: int, victims: Sequence[TierEntry], now_s: float, *,
              need_bytes: int = 0) -> None:
        """Make ``need_bytes`` more room on the node by evicting ``victims`` (in order).
        Under suffix eviction the last victim keeps the whole chunks of its prefix that
        the room does not need; every other victim goes whole. Evicted sessions are
        planned again (their KV may be wanted back before they return)."""
        tier = self.tiers[node]
        keep = 0
        if self._policy.suffix_eviction and victims:
            surplus = (tier.capacity_bytes - tier.used_bytes
                       + sum(v.nbytes for v in victims) - need_bytes)
            keep = surplus // self.bpt // self.chunk_tokens * self.chunk_tokens
            if keep >= victims[-1].tokens:
                keep = 0
        for i, v in enumerate(victims):
            sid = v.session_id
            if keep > 0 and i == len(victims) - 1:
                cut = min(tier.trim(sid, keep, keep * self.bpt), v.prefetch_unused_bytes)
                self._draft.trims[(sid, node)] = keep
                v.prefetch_unused_bytes -= cut
                self._stats.wasted_bytes += cut
            else:
                self.drop(node, sid)
                self._stats.wasted_bytes += v.prefetch_unused_bytes
            if v.prefetch_unused_bytes > 0:
                self.prefetch_wasted(sid)
            s = self._sessions.get(sid)
            if self._policy.prefetch and s is not None and not s.in_flight:
                self.plan_evicted(sid, now_s)

    def _share_room(self, sid: str, node: int, grow_bytes: int, now_s: float, *,
                    min_key: float, prefetch: bool, free_only: bool = False) -> bool:
        """Whether the session's tenant may grow the node's books by ``grow_bytes`` within
        its shares; evicts the tenant's own sessions first where they make the room."""
        tier = self.tiers[node]
        own = self._budgets.share_room(
            tier, sid, node, grow_bytes, now_s, min_key=min_key, prefetch=prefetch,
            free_only=free_only, strategy=self.predicted_use if prefetch else tier.strategy)
        if own is None:
            return False
        if own:
            # Whole sessions: a share counts whole entries (need = the whole tier keeps
            # suffix eviction from cutting the last one back instead).
            self.evict(node, own, now_s, need_bytes=tier.capacity_bytes)
        return True

    def write_through(self, sid: str, node: int, ctx: int, now_s: float) -> None:
        """The response ended on ``node``: keep its ``ctx`` tokens in the node's books,
        evicting what the policy ranks after the session itself, or drop the session's
        entry there if no room can be made."""
        tier = self.tiers[node]
        nbytes = ctx * self.bpt
        old = tier.get(sid)
        old_bytes = old.nbytes if old is not None else 0
        min_key = -INF
        # What it may displace must rank below its own key.
        if self._policy.eviction is EvictionKind.PREDICTED_USE:
            min_key = self._forecasts.next_use(sid, now_s)
        elif self.retention is not None:
            min_key = self.retention.admit_key(sid, now_s)
        need = nbytes - old_bytes
        if self._budgets.shares is not None and not self._share_room(
                sid, node, need, now_s, min_key=min_key, prefetch=False):
            if old is not None:
                self._stats.wasted_bytes += old.prefetch_unused_bytes
                self.drop(node, sid)
            return
        victims = tier.victims_for(need, now_s, exclude=sid, min_key=min_key)
        if old is not None:
            self._stats.wasted_bytes += old.prefetch_unused_bytes
        if victims is None:
            if old is not None:
                self.drop(node, sid)
            return
        self.evict(node, victims, now_s, need_bytes=need)
        tier.put(TierEntry(sid, ctx, nbytes, now_s, ready_at_s=now_s))

    def reserve(self, sid: str, node: int, tokens: int, *, prefetch: bool, deadline_s: float,
                now_s: float, min_key: float = -INF, free_only: bool = False,
                priority: float = DEMAND_PRIORITY, warm_up: bool = False) -> LoadTicket | None:
        """Room on the node for ``tokens`` of the session's KV and the ticket of the load
        that brings what it lacks, or None: nothing to load, no room (``free_only``: only
        free room; otherwise by evicting entries whose key is above ``min_key``), over the
        waste budget (a prefetch; a ``warm_up`` is outside it) or over a tenant share."""
        tier = self.tiers[node]
        have = tier.get(sid)
        have_tokens = have.tokens if have is not None and have.ready_at_s <= now_s else 0
        # Under demote-on-evict a prefix in HBM may have no DRAM copy: the load brings
        # only what lies beyond it (HBM's part comes down over the host link, uncharged as
        # a demotion is).
        delta = tokens - (max(have_tokens, self._view.hbm_tokens(node, sid))
                          if self.demote_on_evict else have_tokens)
        if delta <= 0:
            return None
        nbytes = tokens * self.bpt
        old_bytes = have.nbytes if have is not None else 0
        if free_only and nbytes - old_bytes > tier.capacity_bytes - tier.used_bytes:
            return None
        if warm_up:
            assert prefetch and free_only
            self._stats.warmup_bytes += delta * self.bpt
        elif prefetch and not self._budgets.within_waste_budget(delta * self.bpt, now_s):
            return None
        if self._budgets.shares is not None and not self._share_room(
                sid, node, nbytes - old_bytes, now_s, min_key=min_key, prefetch=prefetch,
                free_only=free_only):
            return None
        victims = tier.victims_for(nbytes - old_bytes, now_s, exclude=sid, min_key=min_key,
                                   strategy=(self.predicted_use
                                             if prefetch and self._policy.evict_advice
                                             else None))
        if victims is None:
            return None
        self.evict(node, victims, now_s, need_bytes=nbytes - old_bytes)
        carried = 0
        if have is not None and have_tokens == 0:
            # A prefetch still in flight is superseded: its bytes are lost.
            self._stats.wasted_bytes += have.prefetch_unused_bytes
        elif have is not None:
            # A landed one's stay as the new entry's prefix: unused still if this is a
            # prefetch too, read by the request this demand load is for otherwise.
            carried = have.prefetch_unused_bytes
            if not prefetch:
                self._stats.prefetch_used_bytes += carried
        tier.put(TierEntry(sid, tokens, nbytes, now_s, ready_at_s=INF, pinned=1,
                           prefetch_unused_bytes=(min(nbytes, carried + delta * self.bpt)
                                                  if prefetch else 0)))
        self.grown.add(sid)
        ticket = LoadTicket(sid, node, tokens, delta * self.bpt, prefetch, deadline_s, priority)
        if prefetch:
            self._stats.prefetch_exposed_bytes += ticket.nbytes
            if self._budgets.shares is not None:
                self._budgets.shares.charge(sid, node, ticket.nbytes, now_s)
        self._sessions.of(sid).inflight_nodes[node] = ticket
        return ticket

    def displaced_by(self, sid: str, node: int, tokens: int, now_s: float, *,
                     min_key: float, as_if_full: bool = False) -> list[TierEntry] | None:
        """The residents a prefetch of ``tokens`` of the session to ``node`` would evict
        now (as :meth:`reserve` would choose them; empty when free room suffices; None
        when it cannot make room); ``as_if_full``: those it would evict if the tier had
        no free room (the residents its room would otherwise have kept). Evicts
        nothing."""
        tier = self.tiers[node]
        have = tier.get(sid)
        need = tokens * self.bpt - (have.nbytes if have is not None else 0)
        if as_if_full:
            need += tier.capacity_bytes - tier.used_bytes
        return tier.victims_for(need, now_s, exclude=sid, min_key=min_key,
                                strategy=self.predicted_use if self._policy.evict_advice
                                else None)

    def use_local(self, sid: str, node: int, reused_tokens: int, now_s: float) -> int:
        """The GPU starts the request: the usable DRAM-tier tokens, marked read."""
        d = self.tiers[node].get(sid)
        if d is None:
            return 0
        d.pinned = 0
        usable = min(reused_tokens, d.tokens) if d.ready_at_s <= now_s else 0
        if usable > 0:
            d.last_use_s = now_s
            self._count_read(d)
        return usable

    def mark_read(self, sid: str, node: int, tokens: int, arrived_s: float) -> None:
        """A request that arrived at ``arrived_s`` took ``tokens`` from a cache on ``node``:
        the session's entry there, if it had landed by then, was read."""
        d = self.tiers[node].get(sid)
        if d is not None and tokens > 0 and d.ready_at_s <= arrived_s:
            self._count_read(d)

    def _count_read(self, d: TierEntry) -> None:
        """A request read the entry: what a prefetch brought into it was used."""
        if d.prefetch_unused_bytes > 0:
            self.prefetch_read(d.session_id)
        self._stats.prefetch_used_bytes += d.prefetch_unused_bytes
        d.prefetch_unused_bytes = 0
