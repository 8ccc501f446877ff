"""The scheduling core: one object that decides, and nothing that moves bytes.

``SchedulerCore`` tracks sessions, asks the predictor, routes requests, keeps the books of
every node's local (DRAM) tier, decides demand loads and deadline-driven prefetches, and
evicts by predicted next use. It is pure and deterministic: no clock (every call takes
``now_s``), no I/O, no Ray. The simulator drives it on a virtual clock and supplies the
physics through :class:`FleetView`; the live service drives it on the wall clock with
views built from the agents' reports.

Who calls what
--------------
* per request: :meth:`request_started` -> :meth:`route` -> :meth:`assign` -> (policy)
  :meth:`demand_load` -> :meth:`use_local` when the GPU starts it -> :meth:`request_finished`;
* per transfer: :meth:`transfer_done` or :meth:`transfer_cancelled`;
* per armed prefetch order, at its ``start_at_s``: :meth:`start_prefetch`;
* after each of the above the caller collects new orders with :meth:`drain_orders` and
  arms a timer for each (an order superseded by a newer one is ignored when it fires).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controlplane.base.config import FleetConfig
from controlplane.base.types import ArrivalForecast, SessionEvent
from controlplane.core.planner import (
    PrefetchOrder,
    TransferEstimate,
    plan_prefetch,
    predicted_use_s,
)
from controlplane.core.policies import EvictionKind, PolicySpec
from controlplane.core.router import NodeView, RouteDecision, RouteRequest, route
from controlplane.core.tiers import LruEviction, PredictedUseEviction, Tier, TierEntry
from predictors.base import Predictor

INF = float("inf")
#: Prefetches of one session per idle period, so that eviction ping-pong cannot loop.
MAX_PREFETCHES_PER_IDLE = 2
#: A prefetch whose forecast moved later by more than this is re-armed, not started.
REPLAN_SLACK_S = 1.0
MAX_REPLANS = 4


class FleetView(Protocol):
    """What the core needs to know about the physical fleet (the simulator's state, or the
    live agents' reports). Called on every routing decision and plan: keep it cheap."""

    def queue_wait_s(self, node: int, now_s: float) -> float: ...

    def link_backlog_s(self, node: int, now_s: float) -> float: ...

    def hbm_tokens(self, node: int, session_id: str) -> int: ...

    def remote_source(self, session_id: str) -> tuple[float, float]:
        """(seconds per byte, first-byte latency) of the session's remote copy."""
        ...


@dataclass(frozen=True, slots=True)
class LoadTicket:
    """Move ``nbytes`` of ``session_id``'s KV into ``node``'s local tier, where the core has
    reserved room for ``tokens`` tokens. ``prefetch`` is False for demand loads."""

    session_id: str
    node: int
    tokens: int
    nbytes: int
    prefetch: bool
    deadline_s: float


@dataclass(frozen=True, slots=True)
class Assignment:
    """The consequences of routing a request: transfers of its session to other nodes to
    cancel, and whether one already heading to the chosen node is now a demand load."""

    cancel_nodes: tuple[int, ...]
    promote: bool
    prefetch_ready_s: float | None


@dataclass(slots=True)
class CoreStats:
    prefetches: int = 0
    prefetches_dropped: int = 0
    #: Prefetched bytes evicted or overwritten before any request read them.
    wasted_bytes: int = 0


@dataclass(slots=True)
class _Session:
    home: int | None = None
    remote_tokens: int = 0
    in_flight: int = 0
    last_finish_s: float = 0.0
    pending: PrefetchOrder | None = None
    planned_use_s: float | None = None
    replans: int = 0
    prefetches: int = 0
    inflight_nodes: dict[int, LoadTicket] = field(default_factory=dict)


class SchedulerCore:
    """See the module docstring. One instance per fleet (per policy in the simulator)."""

    def __init__(
        self, fleet: FleetConfig, policy: PolicySpec, predictor: Predictor, view: FleetView
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.predictor = predictor
        self.view = view
        self.bpt = fleet.model.kv_bytes_per_token
        self.stats = CoreStats()
        self._sessions: dict[str, _Session] = {}
        self._outbox: list[PrefetchOrder] = []
        #: Idle sessions whose KV is not on their home node: what :meth:`sweep` re-plans.
        self._evicted: set[str] = set()
        self._predicted_use = PredictedUseEviction(self._next_uses)
        strategy: LruEviction | PredictedUseEviction = (
            self._predicted_use
            if policy.eviction is EvictionKind.PREDICTED_USE
            else LruEviction()
        )
        capacity = fleet.node.dram_tier_bytes if policy.dram_tier else 0
        #: The books of every node's local DRAM tier (authoritative for what agents hold).
        self.dram = [Tier(f"dram{i}", capacity, strategy) for i in range(fleet.nodes)]

    # ------------------------------------------------------------------ small helpers
    def _session(self, sid: str) -> _Session:
        s = self._sessions.get(sid)
        if s is None:
            s = self._sessions[sid] = _Session()
        return s

    def session_home(self, sid: str) -> int | None:
        s = self._sessions.get(sid)
        return s.home if s is not None else None

    def remote_tokens(self, sid: str) -> int:
        s = self._sessions.get(sid)
        return s.remote_tokens if s is not None and self.policy.remote else 0

    def drain_orders(self) -> list[PrefetchOrder]:
        """Orders armed since the last call; the caller fires each at ``start_at_s``."""
        out, self._outbox = self._outbox, []
        return out

    def _next_use(self, sid: str, now_s: float) -> float:
        return self._next_uses([sid], now_s)[0]

    def _next_uses(self, sids: Sequence[str], now_s: float) -> list[float]:
        """Predicted next use of each session: now if it is running, its planned use if a
        prefetch brought it in, else from the predictor (one batched call)."""
        out: list[float] = [0.0] * len(sids)
        ask: list[int] = []
        for i, sid in enumerate(sids):
            s = self._sessions.get(sid)
            if s is not None and s.in_flight:
                out[i] = now_s
            elif s is not None and s.planned_use_s is not None and now_s <= s.planned_use_s:
                out[i] = s.planned_use_s  # brought in on purpose: keep until its predicted use
            else:
                ask.append(i)
        if ask:
            forecasts = self._forecasts([sids[i] for i in ask], now_s)
            for i, fc in zip(ask, forecasts, strict=True):
                out[i] = predicted_use_s(fc, self.fleet.planner, now_s)
        return out

    def _forecasts(self, sids: Sequence[str], now_s: float) -> list[ArrivalForecast | None]:
        many = getattr(self.predictor, "forecast_many", None)
        if many is not None and len(sids) > 1:
            return list(many(list(sids), now_s))
        return [self.predictor.forecast(sid, now_s) for sid in sids]

    def local_tokens(self, node: int, sid: str) -> int:
        """Tokens of the session on the node, in HBM or DRAM (ready or arriving)."""
        d = self.dram[node].get(sid)
        return max(self.view.hbm_tokens(node, sid), d.tokens if d is not None else 0)

    def _evict(self, node: int, victims: Sequence[TierEntry], now_s: float) -> None:
        for v in victims:
            self.dram[node].remove(v.session_id)
            if v.prefetched_unused:
                self.stats.wasted_bytes += v.nbytes
            s = self._sessions.get(v.session_id)
            if self.policy.prefetch and s is not None and not s.in_flight:
                self._plan(v.session_id, now_s)

    def _observe(self, event: SessionEvent) -> None:
        self.predictor.observe(event)

    # ------------------------------------------------------------------ requests
    def request_started(self, event: SessionEvent) -> None:
        """A request of the session arrived (before routing)."""
        s = self._session(event.session_id)
        s.in_flight += 1
        s.pending = None
        s.prefetches = 0
        s.planned_use_s = None
        self._evicted.discard(event.session_id)
        self._observe(event)

    def route(self, sid: str, input_tokens: int, reused_tokens: int, now_s: float
              ) -> RouteDecision:
        """Pick the node for a request (locality + load, with affinity to its home)."""
        s = self._session(sid)
        s_per_byte, latency = self.view.remote_source(sid)
        req = RouteRequest(sid, input_tokens, reused_tokens, s.home, self.remote_tokens(sid),
                           s_per_byte, latency)
        views = []
        for n in range(self.fleet.nodes):
            d = self.dram[n].get(sid)
            backlog = self.view.link_backlog_s(n, now_s)
            dram_wait = backlog if d is not None and d.ready_at_s > now_s else 0.0
            views.append(NodeView(n, self.view.queue_wait_s(n, now_s),
                                  self.view.hbm_tokens(n, sid), d.tokens if d else 0,
                                  dram_wait, backlog))
        return route(req, views, self.fleet)

    def assign(self, sid: str, node: int, now_s: float) -> Assignment:
        """The request runs on ``node``: prefetches heading elsewhere are useless now; one
        heading here becomes a demand load."""
        s = self._session(sid)
        cancel = tuple(sorted(n for n in s.inflight_nodes if n != node))
        promote = node in s.inflight_nodes and s.inflight_nodes[node].prefetch
        ready: float | None = INF if promote else None
        d = self.dram[node].get(sid)
        if d is not None and d.prefetched_unused and d.ready_at_s <= now_s:
            ready = d.ready_at_s
        return Assignment(cancel, promote, ready)

    def demand_load(self, sid: str, node: int, reused_tokens: int, now_s: float
                    ) -> LoadTicket | None:
        """A remote read of the reusable KV the node lacks, or None (nothing to load, no
        remote copy, a transfer already under way, or no room)."""
        s = self._session(sid)
        if node in s.inflight_nodes:
            return None
        want = min(reused_tokens, self.remote_tokens(sid))
        if want <= self.local_tokens(node, sid):
            return None
        return self._reserve(sid, node, want, prefetch=False, deadline_s=now_s, now_s=now_s)

    def use_local(self, sid: str, node: int, reused_tokens: int, now_s: float) -> int:
        """The GPU starts the request: returns the usable DRAM-tier tokens and marks them
        read (a prefetch that is read is useful, not wasted)."""
        d = self.dram[node].get(sid)
        if d is None:
            return 0
        d.pinned = 0
        usable = min(reused_tokens, d.tokens) if d.ready_at_s <= now_s else 0
        if usable > 0:
            d.last_use_s = now_s
            d.prefetched_unused = False
        return usable

    def request_finished(self, event: SessionEvent, context_tokens: int) -> None:
        """The response ended on ``event.node``: the session's KV is written through to the
        node's DRAM tier and the remote store; plan its next visit."""
        sid, now = event.session_id, event.time_s
        node = event.node if event.node is not None else 0
        s = self._session(sid)
        s.in_flight = max(0, s.in_flight - 1)
        s.home = node
        s.last_finish_s = now
        if self.policy.remote:
            s.remote_tokens = context_tokens
        self._observe(event)
        if self.policy.dram_tier and node not in s.inflight_nodes:
            self._write_through(sid, node, context_tokens, now)
        if self.policy.prefetch and not s.in_flight:
            self._plan(sid, now)

    def _write_through(self, sid: str, node: int, ctx: int, now_s: float) -> None:
        tier = self.dram[node]
        nbytes = ctx * self.bpt
        old = tier.get(sid)
        old_bytes = old.nbytes if old is not None else 0
        min_key = -INF
        if self.policy.eviction is EvictionKind.PREDICTED_USE:
            min_key = self._next_use(sid, now_s)
        victims = tier.victims_for(nbytes - old_bytes, now_s, exclude=sid, min_key=min_key)
        if old is not None and old.prefetched_unused:
            self.stats.wasted_bytes += old.nbytes
        if victims is None:
            if old is not None:
                tier.remove(sid)
            return
        self._evict(node, victims, now_s)
        tier.put(TierEntry(sid, ctx, nbytes, now_s, ready_at_s=now_s))

    # ------------------------------------------------------------------ transfers
    def _reserve(self, sid: str, node: int, tokens: int, *, prefetch: bool, deadline_s: float,
                 now_s: float, min_key: float = -INF, free_only: bool = False
                 ) -> LoadTicket | None:
        tier = self.dram[node]
        have = tier.get(sid)
        have_tokens = have.tokens if have is not None and have.ready_at_s <= now_s else 0
        delta = tokens - have_tokens
        if delta <= 0:
            return None
        nbytes = tokens * self.bpt
        old_bytes = have.nbytes if have is not None else 0
        if free_only and nbytes - old_bytes > tier.capacity_bytes - tier.used_bytes:
            return None
        victims = tier.victims_for(nbytes - old_bytes, now_s, exclude=sid, min_key=min_key,
                                   strategy=self._predicted_use if prefetch else None)
        if victims is None:
            return None
        self._evict(node, victims, now_s)
        if have is not None and have.prefetched_unused:
            self.stats.wasted_bytes += have.nbytes
        tier.put(TierEntry(sid, tokens, nbytes, now_s, ready_at_s=INF, pinned=1,
                           prefetched_unused=prefetch))
        ticket = LoadTicket(sid, node, tokens, delta * self.bpt, prefetch, deadline_s)
        self._session(sid).inflight_nodes[node] = ticket
        return ticket

    def transfer_done(self, sid: str, node: int, now_s: float, *, demand: bool) -> None:
        """The bytes landed. A demand load stays pinned until its request reads it."""
        self._session(sid).inflight_nodes.pop(node, None)
        entry = self.dram[node].get(sid)
        if entry is not None:
            entry.ready_at_s = now_s
            entry.last_use_s = now_s
            if not demand:
                entry.pinned = 0

    def transfer_cancelled(self, sid: str, node: int) -> None:
        self._session(sid).inflight_nodes.pop(node, None)
        self.dram[node].remove(sid)

    # ------------------------------------------------------------------ prefetch planning
    def sweep(self, now_s: float) -> None:
        """Re-plan idle sessions whose KV has left their home node and that have no armed
        order: their forecasts change as their silence grows (a session that was unlikely
        to return a minute ago may be likely now). Called every
        ``planner.sweep_interval_s``; one batched forecast for all candidates."""
        if not self.policy.prefetch or not self._evicted:
            return
        horizon = self.fleet.planner.max_lead_s
        due: list[str] = []
        for sid in sorted(self._evicted):
            s = self._sessions[sid]
            if s.in_flight or s.home is None or now_s - s.last_finish_s > horizon:
                self._evicted.discard(sid)
            elif s.pending is None and s.prefetches < MAX_PREFETCHES_PER_IDLE:
                due.append(sid)
        if not due:
            return
        for sid, forecast in zip(due, self._forecasts(due, now_s), strict=True):
            self._plan(sid, now_s, forecast)

    def _plan(self, sid: str, now_s: float, forecast: ArrivalForecast | None = None) -> None:
        """Plan (or re-plan) a prefetch of an idle session to its home node."""
        s = self._session(sid)
        tokens = s.remote_tokens
        if s.home is None or tokens <= 0 or s.in_flight:
            return
        if s.prefetches >= MAX_PREFETCHES_PER_IDLE:
            return
        if self.local_tokens(s.home, sid) >= tokens:
            s.pending = None
            self._evicted.discard(sid)
            return
        self._evicted.add(sid)
        if forecast is None:
            forecast = self.predictor.forecast(sid, now_s)
        s_per_byte, latency = self.view.remote_source(sid)
        order = plan_prefetch(
            forecast, session_id=sid, node=s.home, tokens=tokens, nbytes=tokens * self.bpt,
            now_s=now_s,
            transfer=TransferEstimate(latency, s_per_byte, self.view.link_backlog_s(s.home,
                                                                                   now_s)),
            cfg=self.fleet.planner, safety_margin_s=self.policy.safety_margin_s,
        )
        s.pending = order
        if order is not None:
            self._outbox.append(order)

    def start_prefetch(self, order: PrefetchOrder, now_s: float) -> LoadTicket | None:
        """An armed order's start time came: re-check it and reserve room, or drop it."""
        sid = order.session_id
        s = self._sessions.get(sid)
        if s is None or s.pending is not order or s.in_flight:
            return None
        forecast = self.predictor.forecast(sid, now_s)
        if forecast is not None and s.replans < MAX_REPLANS:
            later = forecast.arrival_at(self.fleet.planner.arrival_quantile)
            if later - order.deadline_s > REPLAN_SLACK_S:
                s.replans += 1
                self._plan(sid, now_s)
                return None
        s.replans = 0
        s.pending = None
        if self.local_tokens(order.node, sid) >= order.tokens:
            return None
        use = max(now_s, forecast.arrival_at(0.5) if forecast else order.predicted_use_s)
        # An uncertain prefetch only fills free room: under pressure, whatever it would
        # evict is likelier to be used first (every such admission measured wasted bytes).
        ticket = self._reserve(sid, order.node, order.tokens, prefetch=True,
                               deadline_s=order.deadline_s, now_s=now_s, min_key=use,
                               free_only=forecast is None or forecast.confidence < 1.0)
        if ticket is None:
            self.stats.prefetches_dropped += 1
            return None
        self.stats.prefetches += 1
        s.planned_use_s = use
        s.prefetches += 1
        return ticket

    def replan(self, sid: str, now_s: float) -> None:
        """Plan the session again now (an order was lost, e.g. its agent died)."""
        s = self._sessions.get(sid)
        if s is not None and self.policy.prefetch:
            s.pending = None
            self._plan(sid, now_s)

    def forget(self, sid: str) -> None:
        """Drop a closed session's state and its predictor state (idempotent). Its KV may
        stay in local tiers: with no forecast it is predicted never to be used again, so
        it is the first to go when room is needed."""
        self._sessions.pop(sid, None)
        self._evicted.discard(sid)
        self.predictor.forget(sid)

    def hint(self, event: SessionEvent) -> None:
        """A hint changes the forecast: re-plan the session now."""
        self._observe(event)
        if self.policy.prefetch:
            self._plan(event.session_id, event.time_s)

    def clear_local(self, now_s: float) -> None:
        """Every node restarted cold: forget their DRAM tiers and re-plan idle sessions."""
        for tier in self.dram:
            for e in tier.clear():
                if e.prefetched_unused:
                    self.stats.wasted_bytes += e.nbytes
        if self.policy.prefetch:
            for sid in sorted(self._sessions):
                s = self._sessions[sid]
                if s.home is not None and not s.in_flight:
                    self._plan(sid, now_s)

