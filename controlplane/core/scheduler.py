"""The scheduling core: one object that decides, and nothing that moves bytes.

``SchedulerCore`` tracks sessions, asks the predictor, routes requests, keeps the books of
every node's local (DRAM) tier, decides demand loads (when to start them, too) and
deadline-driven prefetches, warms nodes that come back or join empty, and evicts by
predicted next use (or, experimentally, by whichever of predicted use and recency is
winning on the traffic at hand). It is pure and deterministic: no clock (every call takes
``now_s``), no I/O, no Ray. The simulator drives it on a virtual clock and supplies the
physics through :class:`FleetView`; the live service drives it on the wall clock with
views built from the agents' reports.

Who calls what
--------------
Every event method returns one :class:`~kvprefetch.controlplane.core.step.StepOutput` that the
driver
carries out (start loads, stop transfers, arm orders, advise evictions); drivers hold no
policy of their own.

* per request: :meth:`request_started` (arrival) -> :meth:`route_request` (the node, and at
  arrival the demand load for policies that load then, ``ADAPTIVE`` ones when the queue
  wait hides enough of it, or behind a long queue a timed load armed to start a few TTLBs
  before the estimated GPU start) -> :meth:`gpu_start` when the node's GPU picks it up
  (the demand load for policies that load then; the node's queue drift, which moves the
  timed loads armed behind it) -> :meth:`use_local` when it reads its local tier ->
  :meth:`request_finished`;
* per transfer: :meth:`transfer_done` or :meth:`transfer_failed`;
* per armed order (a prefetch, or a queued request's timed load), at its ``start_at_s``:
  :meth:`start_prefetch`;
* every ``planner.sweep_interval_s``: :meth:`sweep`;
* per hint and session close: :meth:`hint`, :meth:`close`;
* node restarts: :meth:`clear_local` (every node cold), :meth:`reconcile` (one node's agent
  reported what its tier really holds);
* fleet changes: :meth:`node_left`, :meth:`node_joined` (warmed at once).

Suffix eviction
---------------
Under policies with ``suffix_eviction`` (``predictive``, ``oracle``) room is made by cutting
the last victim back to the whole chunks (``chunk_tokens``) of its prefix that the room
does not need, instead of dropping it: a returning request reuses its context from the
start, so the prefix left local shortens its load by that much, and a tier of a few large
contexts no longer frees a whole session's bytes to fit a little more. The step reports
the cut as a :class:`~kvprefetch.controlplane.core.step.Trim` (the agent deletes the chunks past
it);
the trimmed session is planned again like an evicted one. Measured (README, "Suffix
eviction"): it lowers predictive's and the oracle's returning TTFT in every run of the
sweep; the LMCache-modelled baselines keep whole-session LRU (see
:attr:`~kvprefetch.controlplane.core.policies.PolicySpec.suffix_eviction`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol, TypeVar

from kvprefetch.controlplane.base.config import GIB, FleetConfig
from kvprefetch.controlplane.base.keys import DEFAULT_CHUNK_TOKENS
from kvprefetch.controlplane.base.types import ArrivalForecast, SessionEvent
from kvprefetch.controlplane.core.planner import (
    PrefetchOrder,
    TransferEstimate,
    plan_prefetch,
    predicted_use_s,
)
from kvprefetch.controlplane.core.policies import EvictionKind, LoadStart, PolicySpec
from kvprefetch.controlplane.core.quotas import TenantQuota, TenantShares
from kvprefetch.controlplane.core.router import NodeNumbers, RouteDecision, Router, RouteRequest
from kvprefetch.controlplane.core.step import (
    DEMAND_PRIORITY,
    QUEUED_PRIORITY,
    LoadTicket,
    Placement,
    StepOutput,
    Trim,
)
from kvprefetch.controlplane.core.sweep import GatedPredictor, IdleIndex
from kvprefetch.controlplane.core.tiers import (
    DuelingEviction,
    EvictionDuel,
    IndexedLruEviction,
    IndexedTier,
    IndexStats,
    KeyedEviction,
    PredictedUseEviction,
    TierEntry,
)
from kvprefetch.controlplane.core.value import SessionValues, ValueConfig
from kvprefetch.predictors.base import Predictor

INF = float("inf")
# Enum members as module names: ``EventKind.X`` costs a descriptor call per access on
# Python 3.11 (~130 ns), and the calls per event read several.
_LRU, _ADAPTIVE_EVICTION = EvictionKind.LRU, EvictionKind.ADAPTIVE
_ON_ARRIVAL, _ADAPTIVE_START = LoadStart.ON_ARRIVAL, LoadStart.ADAPTIVE
#: Prefetches of one session per idle period, so that eviction ping-pong cannot loop.
MAX_PREFETCHES_PER_IDLE = 2
#: A prefetch whose forecast moved later by more than this is re-armed, not started.
REPLAN_SLACK_S = 1.0
MAX_REPLANS = 4
#: A session's forecast that carries its whole law (``survival``, conditioned) is reused for
#: its eviction key for this long (seconds) after it was made, conditioned on the longer
#: silence by the law itself, instead of asking the predictor again; any event of the
#: session drops it at once. What reuse cannot see is a predictor adapting a law shared
#: with other sessions within the window (README, "The control plane at scale").
FORECAST_REUSE_S = 10.0


class FleetView(Protocol):
    """What the core needs to know about the physical fleet (the simulator's state, or the
    live agents' reports). Called on every routing decision and plan: keep it cheap."""

    def queue_wait_s(self, node: int, now_s: float) -> float: ...

    def link_backlog_s(self, node: int, now_s: float) -> float: ...

    def hbm_tokens(self, node: int, session_id: str) -> int: ...

    def remote_source(self, session_id: str) -> tuple[float, float]:
        """(seconds per byte, first-byte latency) of the session's remote copy."""
        ...


class IdleFleet:
    """A :class:`FleetView` of idle GPUs and links, empty HBM and a Valkey-speed remote
    store (5 GB/s, 0.5 ms): for measuring the control plane's own cost (``kvprefetch bench
    control-plane``) and for the core's tests."""

    def queue_wait_s(self, node: int, now_s: float) -> float:
        return 0.0

    def link_backlog_s(self, node: int, now_s: float) -> float:
        return 0.0

    def hbm_tokens(self, node: int, session_id: str) -> int:
        return 0

    def remote_source(self, session_id: str) -> tuple[float, float]:
        return 1 / 5e9, 0.0005


@dataclass(slots=True)
class CoreStats:
    prefetches: int = 0
    prefetches_dropped: int = 0
    #: Prefetched bytes evicted or overwritten before any request read them.
    wasted_bytes: int = 0
    #: Prefetched bytes a request read.
    prefetch_used_bytes: int = 0
    #: Bytes of every prefetch order started (what the waste budget bounds).
    prefetch_exposed_bytes: int = 0
    #: Prefetches not started because the waste budget was spent.
    prefetches_over_budget: int = 0
    #: Bytes of the warm-ups of empty nodes started (free room only: outside the budget,
    #: which they widen by as much).
    warmup_bytes: int = 0


_Counters = TypeVar("_Counters", CoreStats, IndexStats)


def summed(cls: type[_Counters], parts: Iterable[_Counters]) -> _Counters:
    """Counters of several cores (or tiers) added field by field."""
    total = cls()
    for part in parts:
        for f in fields(cls):
            setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
    return total


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
    #: The node whose transfer the request in flight waits for (set when it is routed).
    awaiting_node: int | None = None
    #: The timed load of the request waiting in a node's queue, not started yet, and the
    #: node's queue drift when it was armed (see :meth:`SchedulerCore._queue_moved`).
    queued: PrefetchOrder | None = None
    queued_drift_s: float = 0.0
    #: When the GPU was expected to pick the request in flight up, as estimated at its
    #: routing, and the node's queue drift then (``ADAPTIVE`` policies only).
    expected_start_s: float | None = None
    routed_drift_s: float = 0.0


@dataclass(slots=True)
class _Step:
    """What the call under way has decided so far (see :class:`StepOutput`)."""

    loads: list[LoadTicket] = field(default_factory=list)
    cancels: list[Placement] = field(default_factory=list)
    orders: list[PrefetchOrder] = field(default_factory=list)
    dropped: list[Placement] = field(default_factory=list)
    #: (session, node) -> the tokens its entry was cut back to (suffix eviction).
    trims: dict[tuple[str, int], int] = field(default_factory=dict)


class SchedulerCore:
    """See the module docstring. One instance per fleet (per policy in the simulator)."""

    def __init__(
        self, fleet: FleetConfig, policy: PolicySpec, predictor: Predictor, view: FleetView,
        *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, indexed_sweep: bool = True,
        tenant_quotas: Mapping[str, TenantQuota] | None = None,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
        self.fleet = fleet
        #: Granularity of suffix eviction: the agents' chunk (LMCache's, 256 tokens).
        self.chunk_tokens = chunk_tokens
        self.policy = policy
        self.predictor = predictor
        #: (session, time, forecast) of the last forecast asked (see ``_forecast``).
        self._last_forecast: tuple[str, float, ArrivalForecast | None] | None = None
        self.view = view
        self.bpt = fleet.model.kv_bytes_per_token
        self._router = Router(fleet)
        self.stats = CoreStats()
        self._sessions: dict[str, _Session] = {}
        #: (forecast, when it was made) of resident sessions whose eviction keys were
        #: asked, for forecasts that carry their whole law; dropped by any event of the
        #: session and when it is resident nowhere.
        self._laws: dict[str, tuple[ArrivalForecast, float]] = {}
        self._step = _Step()
        #: Idle sessions whose KV is not on their home node: what :meth:`sweep` re-plans.
        self._evicted: set[str] = set()
        #: The due ones (:mod:`kvprefetch.controlplane.core.sweep`), when the predictor says where
        #: its
        #: forecasts may pass the gate (``indexed_sweep=False``: every sweep forecasts all,
        #: for tests that compare the two); sessions whose due state may have changed in
        #: the call under way; due sessions whose local copy may have grown since a sweep
        #: last looked (a DRAM reservation while idle).
        self._idle: IdleIndex | None = (
            IdleIndex(fleet.planner.sweep_interval_s)
            if indexed_sweep and policy.prefetch and policy.eviction is not EvictionKind.VALUE
            and isinstance(predictor, GatedPredictor) else None)
        self._due_dirty: set[str] = set()
        self._recheck: set[str] = set()
        #: Nodes not in the fleet now (left, or not joined yet): never routed to.
        self._down: set[int] = set()
        #: Per node: how far ahead of the estimates made at routing its GPU queue runs
        #: (seconds, summed over its GPU starts), and the timed loads armed for requests
        #: waiting in it (session -> order).
        self._drift = [0.0] * fleet.nodes
        self._armed: list[dict[str, PrefetchOrder]] = [{} for _ in range(fleet.nodes)]
        planner = fleet.planner
        self._valued = policy.eviction is EvictionKind.VALUE
        self._values = SessionValues(ValueConfig(landing_level=planner.arrival_quantile,
                                                 safety_margin_s=planner.safety_margin_s,
                                                 max_lead_s=planner.max_lead_s),
                                     self.bpt, self._state, self._forecasts,
                                     view.remote_source)
        #: The strategy prefetches evict by (the tier's own, except under LRU). Predicted
        #: use is indexed (IndexedTier: no scan of the residents per decision); the value
        #: rule's densities are not monotone in time, so it keeps the scan.
        self._predicted_use: PredictedUseEviction | KeyedEviction = (
            KeyedEviction(self._values.keys) if self._valued
            else PredictedUseEviction(self._next_uses, next_use_one=self._next_use))
        #: Predicted use vs LRU, for EvictionKind.ADAPTIVE.
        self.duel = EvictionDuel()
        strategy: (IndexedLruEviction | PredictedUseEviction | KeyedEviction
                   | DuelingEviction) = self._predicted_use
        if policy.eviction is EvictionKind.LRU:
            strategy = IndexedLruEviction()
        elif policy.eviction is EvictionKind.ADAPTIVE:
            strategy = DuelingEviction(self._predicted_use, self.duel)
        capacity = fleet.node.dram_tier_bytes if policy.dram_tier else 0
        #: Which node tiers hold each session (kept by the tiers): an event of a session
        #: invalidates its eviction key in those only.
        self._holders: dict[str, set[IndexedTier]] = {}
        #: The books of every node's local DRAM tier (authoritative for what agents hold).
        self.dram = [IndexedTier(f"dram{i}", capacity, strategy, holders=self._holders)
                     for i in range(fleet.nodes)]
        #: Per-tenant shares of each node's tier and prefetch bandwidth
        #: (:mod:`kvprefetch.controlplane.core.quotas`); None without quotas: decisions as before.
        self.shares: TenantShares | None = TenantShares(
            tenant_quotas, nic_bytes_per_s=fleet.node.nic_bytes_per_s,
            known=lambda sid: sid in self._sessions or sid in self._holders,
        ) if tenant_quotas else None

    # ------------------------------------------------------------------ the step contract
    def _output(self, route_decision: RouteDecision | None = None, *, promote: bool = False,
                prefetch_ready_s: float | None = None) -> StepOutput:
        """Close the call under way: what it decided, as one record for the driver."""
        if self._due_dirty:
            self._sync_due()
        step = self._step
        if not (step.loads or step.cancels or step.orders or step.dropped or step.trims):
            # Nothing decided but the route (most calls): the step record is reused.
            if route_decision is None and prefetch_ready_s is None:
                return StepOutput.empty()
            return StepOutput(route_decision, promote, prefetch_ready_s, (), (), (), (), ())
        self._step = _Step()
        evictions: list[Placement] = []
        for p in step.dropped:  # dropped and re-admitted within the call: not an eviction
            if self.dram[p.node].get(p.session_id) is None and p not in evictions:
                evictions.append(p)
        trims: list[Trim] = []
        loading = {(t.session_id, t.node) for t in step.loads}
        for (sid, node), keep in step.trims.items():
            # Cut and then dropped, or refilled within the call: not a trim.
            e = self.dram[node].get(sid)
            if e is not None and e.tokens == keep and (sid, node) not in loading:
                trims.append(Trim(sid, node, keep))
        if not (route_decision or step.loads or step.cancels or step.orders or evictions
                or trims or prefetch_ready_s is not None):
            return StepOutput.empty()
        return StepOutput(route_decision, promote, prefetch_ready_s, tuple(step.cancels),
                          tuple(step.loads), tuple(step.orders), tuple(evictions),
                          tuple(trims))

    def _drop(self, node: int, sid: str) -> TierEntry | None:
        """Remove the session from a node's books (reported as an eviction)."""
        entry = self.dram[node].remove(sid)
        if entry is not None:
            self._step.dropped.append(Placement(sid, node))
            if sid not in self._holders:  # resident nowhere now: its key is not asked
                self._laws.pop(sid, None)
        return entry

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

    def sessions(self) -> int:
        """Sessions the core holds state for (closed ones are forgotten)."""
        return len(self._sessions)

    def eviction_index_stats(self) -> IndexStats:
        """The eviction indexes' work, summed over the nodes."""
        return summed(IndexStats, (tier.index_stats for tier in self.dram))

    def _touch(self, sid: str) -> None:
        """The session's state changed (an event, a prefetch): its eviction key may have
        moved, not only with time."""
        self._laws.pop(sid, None)
        for tier in self._holders.get(sid, ()):
            tier.invalidate(sid)

    def _own_key(self, sid: str, now_s: float) -> float:
        """The session's own eviction key: what it may displace must rank below it."""
        if self._valued:
            return self._values.keys([sid], now_s)[0]
        return self._next_use(sid, now_s)

    def _state(self, sid: str) -> tuple[bool, int] | None:
        """(running, context tokens) of a live session; None once closed."""
        s = self._sessions.get(sid)
        return None if s is None else (s.in_flight > 0, s.remote_tokens)

    def _next_uses(self, sids: Sequence[str], now_s: float | Sequence[float]) -> list[float]:
        """Predicted next use of each session at ``now_s`` (one time, or one per session):
        then if it is running, its planned use if a prefetch brought it in, else from the
        predictor (one batched call). Non-decreasing in time between the session's events
        (what the eviction index relies on, see :mod:`kvprefetch.controlplane.core.tiers`)."""
        times = ([float(now_s)] * len(sids) if isinstance(now_s, int | float)
                 else list(now_s))
        out: list[float] = [0.0] * len(sids)
        ask: list[int] = []
        for i, sid in enumerate(sids):
            s = self._sessions.get(sid)
            t = times[i]
            if s is not None and s.in_flight:
                out[i] = t
            elif s is not None and s.planned_use_s is not None and t <= s.planned_use_s:
                out[i] = s.planned_use_s  # brought in on purpose: keep until its predicted use
            else:
                use = self._reused_use(sid, t)
                if use is None:
                    ask.append(i)
                else:
                    out[i] = use
        if ask:
            at = [times[i] for i in ask]
            forecasts = self._forecasts([sids[i] for i in ask],
                                        at[0] if isinstance(now_s, int | float) else at)
            for i, fc in zip(ask, forecasts, strict=True):
                out[i] = self._use_from(sids[i], times[i], fc)
        return out

    def _use_from(self, sid: str, t: float, fc: ArrivalForecast | None) -> float:
        """The predicted use of a forecast made at ``t``; its law is kept for reuse (see
        :meth:`_reused_use`) while the session is resident somewhere."""
        if (fc is not None and fc.conditioned and fc.survival is not None
                and sid in self._holders):
            self._laws[sid] = (fc, t)
        return predicted_use_s(fc, self.fleet.planner, t)

    def _next_use(self, sid: str, now_s: float) -> float:
        """``_next_uses([sid], now_s)[0]``, without the batch's lists when the session is
        running, was brought in on purpose or has a law to reuse (the eviction index's
        exact keys, one at a time)."""
        t = float(now_s)
        s = self._sessions.get(sid)
        if s is not None:
            if s.in_flight:
                return t
            if s.planned_use_s is not None and t <= s.planned_use_s:
                return s.planned_use_s
        use = self._reused_use(sid, t)
        return self._use_from(sid, t, self._forecast(sid, t)) if use is None else use

    def _reused_use(self, sid: str, t: float) -> float | None:
        """The predicted use at ``t`` from the session's last whole-law forecast (see
        :data:`FORECAST_REUSE_S`): what :func:`predicted_use_s` of a new forecast from the
        same law gives, its median conditioned on the silence at ``t``. None when there is
        none, it is older than the reuse window, or no returning mass is left (the
        predictor says what "never" is)."""
        held = self._laws.get(sid)
        if held is None:
            return None
        fc, made_s = held
        if not made_s <= t <= made_s + FORECAST_REUSE_S or fc.survival is None:
            return None
        gap = fc.survival.quantile_after(max(0.0, t - fc.last_finish_s), 0.5)
        return None if math.isinf(gap) else max(fc.last_finish_s + gap, t)

    def _forecasts(self, sids: Sequence[str], now_s: float | Sequence[float]
                   ) -> list[ArrivalForecast | None]:
        """One forecast per session at ``now_s`` (one time, or one per session)."""
        many = getattr(self.predictor, "forecast_many", None)
        if many is not None and len(sids) > 1:
            return list(many(list(sids), now_s))
        if isinstance(now_s, int | float):
            return [self._forecast(sid, now_s) for sid in sids]
        return [self._forecast(sid, t) for sid, t in zip(sids, now_s, strict=True)]

    def _forecast(self, sid: str, now_s: float) -> ArrivalForecast | None:
        """The predictor's forecast of one session, the last one asked for again when
        nothing was observed since: a finish asks the same (session, time) twice, for the
        write-through's own eviction key and for the prefetch plan."""
        last = self._last_forecast
        if last is not None and last[0] == sid and last[1] == now_s:
            return last[2]
        fc = self.predictor.forecast(sid, now_s)
        self._last_forecast = (sid, now_s, fc)
        return fc

    def local_tokens(self, node: int, sid: str) -> int:
        """Tokens of the session on the node, in HBM or DRAM (ready or arriving)."""
        d = self.dram[node].get(sid)
        return max(self.view.hbm_tokens(node, sid), d.tokens if d is not None else 0)

    def _evict(self, node: int, victims: Sequence[TierEntry], now_s: float, *,
               need_bytes: int = 0) -> None:
        """Make ``need_bytes`` more room on the node by evicting ``victims`` (in order).
        Under suffix eviction the last victim keeps the whole chunks of its prefix that
        the room does not need; every other victim goes whole. Evicted sessions are
        planned again (their KV may be wanted back before they return)."""
        tier = self.dram[node]
        keep = 0
        if self.policy.suffix_eviction and victims:
            surplus = (tier.capacity_bytes - tier.used_bytes
                       + sum(v.nbytes for v in victims) - need_bytes)
            keep = surplus // self.bpt // self.chunk_tokens * self.chunk_tokens
            if keep >= victims[-1].tokens:
                keep = 0
        for i, v in enumerate(victims):
            sid = v.session_id
            if keep > 0 and i == len(victims) - 1:
                cut = min(tier.trim(sid, keep, keep * self.bpt), v.prefetch_unused_bytes)
                self._step.trims[(sid, node)] = keep
                v.prefetch_unused_bytes -= cut
                self.stats.wasted_bytes += cut
            else:
                self._drop(node, sid)
                self.stats.wasted_bytes += v.prefetch_unused_bytes
            s = self._sessions.get(sid)
            if self.policy.prefetch and s is not None and not s.in_flight:
                self._plan(sid, now_s)

    def _observe(self, event: SessionEvent) -> None:
        if self.shares is not None:
            self.shares.observe(event.session_id, event.tenant)
        self.predictor.observe(event)
        self._last_forecast = None
        self._touch(event.session_id)
        self._due_dirty.add(event.session_id)

    # ------------------------------------------------------------------ requests
    def request_started(self, event: SessionEvent) -> StepOutput:
        """A request of the session arrived (before routing)."""
        s = self._session(event.session_id)
        s.in_flight += 1
        s.pending = None
        s.prefetches = 0
        s.planned_use_s = None
        s.awaiting_node = None
        self._disarm(event.session_id, s)
        self._evicted.discard(event.session_id)
        self.duel.returned(event.session_id)
        self._observe(event)
        return self._output()

    def route_request(self, sid: str, input_tokens: int, reused_tokens: int, now_s: float
                      ) -> StepOutput:
        """Pick the node for a request and act on it: transfers of the session heading to
        other nodes are cancelled, one heading to the chosen node becomes a demand load
        (``promote``), and policies that load at arrival start the demand load now, or
        (``ADAPTIVE`` behind a long queue) arm it to start later (see
        :meth:`_arrival_load_start`)."""
        decision = self._route(sid, input_tokens, reused_tokens, now_s)
        node = decision.node
        s = self._session(sid)
        if s.inflight_nodes:
            for other in sorted(n for n in s.inflight_nodes if n != node):
                self._cancel(sid, other)
        heading = s.inflight_nodes.get(node)
        promote = heading is not None and heading.prefetch
        ready: float | None = INF if promote else None
        d = self.dram[node].get(sid)
        if d is not None and d.prefetched_unused and d.ready_at_s <= now_s:
            ready = d.ready_at_s
        adaptive = self.policy.load_start is _ADAPTIVE_START
        wait = self.view.queue_wait_s(node, now_s) if adaptive else 0.0
        if heading is not None:
            s.awaiting_node = node
        else:
            start = self._arrival_load_start(sid, node, reused_tokens, now_s, wait)
            if start is not None and start <= now_s:
                self._demand_load(sid, node, reused_tokens, now_s, now_s + wait)
            elif start is not None:
                self._arm(s, sid, node, min(reused_tokens, self.remote_tokens(sid)), start,
                          now_s + wait)
        if adaptive:
            s.expected_start_s = now_s + wait
            s.routed_drift_s = self._drift[node]
        return self._output(decision, promote=promote, prefetch_ready_s=ready)

    # A timed load waits with its request in the node's queue. Its times come from the
    # queue wait estimated at routing, and a queue runs ahead of or behind its estimates
    # (a load stalls a GPU, a prefill was over-estimated). Each GPU start on a node says by
    # how much: the request's estimated start minus now, counted into the node's drift,
    # and every armed load on the node moves by the drift since it was armed: started at
    # once when its time has come, armed again earlier when it moved by more than a tenth
    # of its lead (and checked again when its timer fires, if it moved later).
    def _arm(self, s: _Session, sid: str, node: int, tokens: int, start_s: float,
             due_s: float) -> None:
        """Arm the timed load of ``tokens`` for ``sid``'s request queued on ``node``, to
        start at ``start_s``, due at its estimated GPU start ``due_s``."""
        order = PrefetchOrder(sid, node, tokens, tokens * self.bpt, start_s, due_s,
                              QUEUED_PRIORITY, due_s, queued=True)
        s.queued = order
        s.queued_drift_s = self._drift[node]
        self._armed[node][sid] = order
        self._step.orders.append(order)

    def _disarm(self, sid: str, s: _Session) -> None:
        if s.queued is not None:
            self._armed[s.queued.node].pop(sid, None)
            s.queued = None

    def _queue_moved(self, node: int, now_s: float) -> None:
        """A GPU start on ``node``: start or re-arm the timed loads its drift moved."""
        drift = self._drift[node]
        for sid, order in list(self._armed[node].items()):
            s = self._sessions[sid]
            shift = drift - s.queued_drift_s
            if order.start_at_s - shift <= now_s:
                self._start_armed(sid, s, order, shift, now_s)
            elif shift > 0.1 * (order.deadline_s - order.start_at_s):
                self._rearm(sid, s, order, shift)

    def _rearm(self, sid: str, s: _Session, order: PrefetchOrder, shift: float) -> None:
        """Arm ``order`` again, ``shift`` seconds earlier (later if negative)."""
        self._disarm(sid, s)
        self._arm(s, sid, order.node, order.tokens, order.start_at_s - shift,
                  order.deadline_s - shift)

    def _start_armed(self, sid: str, s: _Session, order: PrefetchOrder, shift: float,
                     now_s: float) -> None:
        self._disarm(sid, s)
        self._demand_load(sid, order.node, order.tokens, now_s, order.deadline_s - shift)

    def _arrival_load_start(self, sid: str, node: int, reused_tokens: int, now_s: float,
                            wait: float) -> float | None:
        """When to start loading what the node lacks for a request routed to it now, with
        an estimated ``wait`` before the GPU picks it up; None: when it does (at GPU
        start). ``ON_ARRIVAL``: now. ``ADAPTIVE``: when the request queues (an estimated
        wait above 0) and the wait hides at least ``arrival_load_min_wait_fraction`` (by
        default 0) of the load's time to last byte
        (estimated as the router does: first-byte latency + bytes at the source's rate),
        ``arrival_load_max_wait_fraction`` TTLBs before the estimated GPU start, or now if
        that is sooner: behind a long queue a load at arrival would hold DRAM for the
        whole wait, evicting what the requests ahead need (an overloaded fleet then
        thrashes, as ``queue`` does), while one started a few TTLBs before the GPU start
        still lands off the GPU's critical path."""
        load_start = self.policy.load_start
        if load_start is _ON_ARRIVAL:
            return now_s
        if load_start is not _ADAPTIVE_START or wait <= 0.0:
            # No queue: the GPU picks the request up now, and an engine that reads the
            # remote store on its own (vLLM + LMCache) would fetch the same bytes.
            return None
        missing = min(reused_tokens, self.remote_tokens(sid)) - self.local_tokens(node, sid)
        if missing <= 0:
            return None
        s_per_byte, latency = self.view.remote_source(sid)
        ttlb = latency + missing * self.bpt * s_per_byte
        planner = self.fleet.planner
        if wait < planner.arrival_load_min_wait_fraction * ttlb:
            return None
        return now_s + max(0.0, wait - planner.arrival_load_max_wait_fraction * ttlb)

    def _route(self, sid: str, input_tokens: int, reused_tokens: int, now_s: float
               ) -> RouteDecision:
        """Locality + load, with affinity to the session's home node."""
        s = self._session(sid)
        s_per_byte, latency = self.view.remote_source(sid)
        req = RouteRequest(sid, input_tokens, reused_tokens, s.home, self.remote_tokens(sid),
                           s_per_byte, latency)
        view = self.view
        nodes: list[NodeNumbers] = []
        for n in range(self.fleet.nodes):
            if n in self._down:
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
        s = self._session(sid)
        awaiting, s.awaiting_node = s.awaiting_node, None
        self._disarm(sid, s)  # picked up before its timed load started: load now
        if awaiting is None and self.policy.load_start in (LoadStart.ON_SCHEDULE,
                                                          LoadStart.ADAPTIVE):
            self._demand_load(sid, node, reused_tokens, now_s)
        if s.expected_start_s is not None:
            expected = s.expected_start_s - (self._drift[node] - s.routed_drift_s)
            self._drift[node] += expected - now_s
            s.expected_start_s = None
            if self._armed[node]:
                self._queue_moved(node, now_s)
        return self._output()

    def _demand_load(self, sid: str, node: int, reused_tokens: int, now_s: float,
                     deadline_s: float | None = None) -> None:
        """A remote read of the reusable KV the node lacks, unless there is nothing to load,
        no remote copy, a transfer already under way, or no room. Due now (the GPU waits
        for it) unless a later ``deadline_s`` says when the GPU is expected to pick the
        request up: such a load yields the link to those a GPU waits for
        (``QUEUED_PRIORITY``)."""
        s = self._session(sid)
        if node in s.inflight_nodes:
            return
        want = min(reused_tokens, self.remote_tokens(sid))
        if want <= self.local_tokens(node, sid):
            return
        due = now_s if deadline_s is None else deadline_s
        ticket = self._reserve(sid, node, want, prefetch=False, deadline_s=due, now_s=now_s,
                               priority=QUEUED_PRIORITY if due > now_s else DEMAND_PRIORITY)
        if ticket is not None:
            s.awaiting_node = node
            self._step.loads.append(ticket)

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
            self._count_read(d)
        return usable

    def _count_read(self, d: TierEntry) -> None:
        """A request read the entry: what a prefetch brought into it was used."""
        self.stats.prefetch_used_bytes += d.prefetch_unused_bytes
        d.prefetch_unused_bytes = 0

    def mark_read(self, sid: str, node: int, tokens: int, arrived_s: float) -> None:
        """A request that arrived at ``arrived_s`` and ran on ``node`` took ``tokens`` of
        its prompt from a cache, as its engine says after the fact (an engine that does
        not call :meth:`use_local`): the session's DRAM entry there, if it had landed by
        then, was read. Changes nothing but the prefetch accounting."""
        d = self.dram[node].get(sid)
        if d is not None and tokens > 0 and d.ready_at_s <= arrived_s:
            self._count_read(d)

    def request_finished(self, event: SessionEvent, context_tokens: int) -> StepOutput:
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
        return self._output()

    def _write_through(self, sid: str, node: int, ctx: int, now_s: float) -> None:
        tier = self.dram[node]
        nbytes = ctx * self.bpt
        old = tier.get(sid)
        old_bytes = old.nbytes if old is not None else 0
        min_key = -INF
        eviction = self.policy.eviction
        if eviction is not _LRU and not (
                eviction is _ADAPTIVE_EVICTION and not self.duel.predicted_use_leads):
            min_key = self._own_key(sid, now_s)
        need = nbytes - old_bytes
        if self.shares is not None and not self._within_share(
                sid, node, need, now_s, min_key=min_key, prefetch=False):
            if old is not None:
                self.stats.wasted_bytes += old.prefetch_unused_bytes
                self._drop(node, sid)
            return
        victims = tier.victims_for(need, now_s, exclude=sid, min_key=min_key)
        if old is not None:
            self.stats.wasted_bytes += old.prefetch_unused_bytes
        if victims is None:
            if old is not None:
                self._drop(node, sid)
            return
        self._evict(node, victims, now_s, need_bytes=need)
        tier.put(TierEntry(sid, ctx, nbytes, now_s, ready_at_s=now_s))

    # ------------------------------------------------------------------ transfers
    def _reserve(self, sid: str, node: int, tokens: int, *, prefetch: bool, deadline_s: float,
                 now_s: float, min_key: float = -INF, free_only: bool = False,
                 priority: float = DEMAND_PRIORITY, warm_up: bool = False) -> LoadTicket | None:
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
        if warm_up:
            assert prefetch and free_only
            self.stats.warmup_bytes += delta * self.bpt
        elif prefetch and not self._within_waste_budget(delta * self.bpt):
            return None
        if self.shares is not None and not self._within_share(
                sid, node, nbytes - old_bytes, now_s, min_key=min_key, prefetch=prefetch,
                free_only=free_only):
            return None
        victims = tier.victims_for(nbytes - old_bytes, now_s, exclude=sid, min_key=min_key,
                                   strategy=self._predicted_use if prefetch else None)
        if victims is None:
            return None
        self._evict(node, victims, now_s, need_bytes=nbytes - old_bytes)
        carried = 0
        if have is not None and have_tokens == 0:
            # A prefetch still in flight is superseded: its bytes are lost.
            self.stats.wasted_bytes += have.prefetch_unused_bytes
        elif have is not None:
            # A landed one's stay as the new entry's prefix: unused still if this is a
            # prefetch too, read by the request this demand load is for otherwise.
            carried = have.prefetch_unused_bytes
            if not prefetch:
                self.stats.prefetch_used_bytes += carried
        tier.put(TierEntry(sid, tokens, nbytes, now_s, ready_at_s=INF, pinned=1,
                           prefetch_unused_bytes=(min(nbytes, carried + delta * self.bpt)
                                                  if prefetch else 0)))
        self._recheck.add(sid)
        ticket = LoadTicket(sid, node, tokens, delta * self.bpt, prefetch, deadline_s, priority)
        if prefetch:
            self.stats.prefetch_exposed_bytes += ticket.nbytes
            if self.shares is not None:
                self.shares.charge(sid, node, ticket.nbytes, now_s)
        self._session(sid).inflight_nodes[node] = ticket
        return ticket

    def transfer_done(self, sid: str, node: int, now_s: float, *, demand: bool) -> StepOutput:
        """The bytes landed. A demand load stays pinned until its request reads it."""
        s = self._sessions.get(sid)
        if s is not None:
            s.inflight_nodes.pop(node, None)
        entry = self.dram[node].get(sid)
        if entry is not None:
            entry.ready_at_s = now_s
            entry.last_use_s = now_s
            if not demand:
                entry.pinned = 0
        return self._output()

    def _cancel(self, sid: str, node: int) -> None:
        """Stop the session's transfer to the node and drop what it reserved."""
        s = self._sessions.get(sid)
        if s is not None:
            s.inflight_nodes.pop(node, None)
        self._drop(node, sid)
        self._step.cancels.append(Placement(sid, node))

    def transfer_failed(self, sid: str, node: int, now_s: float) -> StepOutput:
        """A transfer was lost or gave up (agent restart, timeout, error): drop what it
        reserved and plan the session again if it is idle."""
        s = self._sessions.get(sid)
        if s is not None:
            s.inflight_nodes.pop(node, None)
        self._drop(node, sid)
        self._plan_again(sid, now_s)
        return self._output()

    # ------------------------------------------------------------------ prefetch planning
    def sweep(self, now_s: float) -> StepOutput:
        """Re-plan idle sessions whose KV has left their home node and that have no armed
        order: their forecasts change as their silence grows (a session that was unlikely
        to return a minute ago may be likely now). Called every
        ``planner.sweep_interval_s``; one batched forecast for all candidates."""
        if not self.policy.prefetch or not self._evicted:
            return self._output()
        horizon = self.fleet.planner.max_lead_s
        due: list[str] = []
        if self._idle is not None:
            due = self._due_candidates(now_s)
        else:
            for sid in sorted(self._evicted):
                s = self._sessions[sid]
                if s.in_flight or s.home is None or now_s - s.last_finish_s > horizon:
                    self._evicted.discard(sid)
                elif s.pending is None and s.prefetches < MAX_PREFETCHES_PER_IDLE:
                    due.append(sid)
        if due:
            for sid, forecast in zip(due, self._forecasts(due, now_s), strict=True):
                self._plan(sid, now_s, forecast)
        return self._output()

    def _sync_due(self) -> None:
        """Bring the sweep's index up to date with the sessions the call changed."""
        idle = self._idle
        if idle is not None:
            group_of = self.predictor.idle_group  # type: ignore[attr-defined]
            for sid in self._due_dirty:
                s = self._sessions.get(sid)
                if (s is None or s.in_flight or s.home is None or s.pending is not None
                        or s.prefetches >= MAX_PREFETCHES_PER_IDLE or sid not in self._evicted):
                    idle.remove(sid)
                else:
                    idle.put(sid, group_of(sid), s.last_finish_s)
        self._due_dirty.clear()

    def _due_candidates(self, now_s: float) -> list[str]:
        """The due sessions a full sweep could plan an order for, or whose local copy may
        now cover them (see :mod:`kvprefetch.controlplane.core.sweep`), sorted as the full sweep
        plans them. Reads every due group's law once, as forecasting them all would."""
        idle = self._idle
        assert idle is not None
        self._sync_due()
        planner = self.fleet.planner
        horizon = planner.max_lead_s
        for sid in idle.expire(now_s, horizon):
            self._evicted.discard(sid)  # silent too long: not due again before an event
        gated: GatedPredictor = self.predictor  # type: ignore[assignment]
        due: set[str] = set(idle.ungrouped())
        for group in idle.groups():
            region = gated.gate_region(group, min_p_return=planner.min_p_return,
                                       min_confidence=planner.min_confidence,
                                       max_silence_s=horizon)
            if region:
                due.update(idle.members_in(group, now_s, region))
        if self._recheck:
            due.update(sid for sid in self._recheck if sid in idle)
        return sorted(due)

    def _plan_again(self, sid: str, now_s: float) -> None:
        """The session's KV left a node other than by a plan (a transfer failed, an agent
        reported it gone): if it is idle, any order planned against the old books is void;
        plan it afresh."""
        s = self._sessions.get(sid)
        if self.policy.prefetch and s is not None and not s.in_flight:
            s.pending = None
            self._plan(sid, now_s)

    def _plan(self, sid: str, now_s: float, forecast: ArrivalForecast | None = None) -> None:
        """Plan (or re-plan) a prefetch of an idle session to its home node."""
        s = self._session(sid)
        self._due_dirty.add(sid)
        tokens = s.remote_tokens
        if s.home is None or tokens <= 0 or s.in_flight:
            return
        if s.prefetches >= MAX_PREFETCHES_PER_IDLE:
            return
        self._recheck.discard(sid)
        if self.local_tokens(s.home, sid) >= tokens:
            s.pending = None
            self._evicted.discard(sid)
            return
        self._evicted.add(sid)
        if forecast is None:
            forecast = self._forecast(sid, now_s)
        s_per_byte, latency = self.view.remote_source(sid)
        transfer = TransferEstimate(latency, s_per_byte, self.view.link_backlog_s(s.home,
                                                                                  now_s))
        if self._valued:
            order = self._plan_by_value(sid, s.home, tokens, forecast, transfer, now_s)
        else:
            order = plan_prefetch(
                forecast, session_id=sid, node=s.home, tokens=tokens,
                nbytes=tokens * self.bpt, now_s=now_s, transfer=transfer,
                cfg=self.fleet.planner, safety_margin_s=self.policy.safety_margin_s,
            )
        s.pending = order
        if order is not None:
            self._step.orders.append(order)

    def _plan_by_value(self, sid: str, node: int, tokens: int,
                       forecast: ArrivalForecast | None, transfer: TransferEstimate,
                       now_s: float) -> PrefetchOrder | None:
        """An order when the session's value net of the transfer's cost is positive, timed
        to land before an early quantile of its arrival given its silence so far (no
        confidence threshold: admission compares values when the order starts)."""
        cfg = self._values.cfg
        cand = self._values.candidate(sid, tokens, forecast, transfer.ttlb_s, now_s)
        if cand.net_density(cfg) <= 0.0 or math.isinf(cand.land_by_s):
            return None
        return PrefetchOrder(sid, node, tokens, cand.nbytes, cand.start_at_s(now_s, cfg),
                             cand.land_by_s, cand.density * GIB, cand.next_use_s)

    def start_prefetch(self, order: PrefetchOrder, now_s: float) -> StepOutput:
        """An armed order's start time came: re-check it and start the load, re-arm it
        (its forecast moved later), or drop it (superseded, the session is back, or no
        room). A ``queued`` order starts the demand load of its request if the GPU has
        not picked it up yet (the engine then waits for that transfer)."""
        sid = order.session_id
        s = self._sessions.get(sid)
        if order.queued:
            if s is not None and s.queued is order:  # its request still waits in the queue
                shift = self._drift[order.node] - s.queued_drift_s
                if order.start_at_s - shift > now_s:  # the queue fell behind: not yet
                    self._rearm(sid, s, order, shift)
                else:
                    self._start_armed(sid, s, order, shift, now_s)
            return self._output()
        if s is None or s.pending is not order or s.in_flight:
            return self._output()
        self._due_dirty.add(sid)
        forecast = self._forecast(sid, now_s)
        if forecast is not None and s.replans < MAX_REPLANS:
            q = self.fleet.planner.arrival_quantile
            later = (forecast.arrival_quantile_after(q, now_s) if self._valued
                     else forecast.arrival_at(q))
            if later - order.deadline_s > REPLAN_SLACK_S:
                s.replans += 1
                self._plan(sid, now_s, forecast)  # what _plan would ask again
                return self._output()
        s.replans = 0
        s.pending = None
        if self.local_tokens(order.node, sid) >= order.tokens:
            return self._output()
        use = max(now_s, forecast.arrival_at(0.5) if forecast else order.predicted_use_s)
        if self._valued:
            # Admitted only over residents worth less per byte than it is, net of the
            # transfer's cost (the value rule; no confidence threshold).
            s_per_byte, latency = self.view.remote_source(sid)
            transfer = TransferEstimate(latency, s_per_byte,
                                        self.view.link_backlog_s(order.node, now_s))
            net = self._values.candidate(sid, order.tokens, forecast, transfer.ttlb_s,
                                         now_s).net_density(self._values.cfg)
            ticket = None if net <= 0.0 else self._reserve(
                sid, order.node, order.tokens, prefetch=True, deadline_s=order.deadline_s,
                now_s=now_s, min_key=-net, priority=order.priority)
        else:
            # An uncertain prefetch only fills free room: under pressure, whatever it would
            # evict is likelier to be used first (every such admission measured waste). A
            # sharp one (a hint's ETA, the oracle) displaces the residents predicted to be
            # used after a late quantile of its arrival (for the oracle: after it, Belady).
            cfg = self.fleet.planner
            free_only, min_key = True, use
            if forecast is not None and forecast.confidence >= cfg.displace_min_confidence:
                free_only = False
                min_key = max(use, forecast.arrival_at(cfg.displace_quantile))
            ticket = self._reserve(sid, order.node, order.tokens, prefetch=True,
                                   deadline_s=order.deadline_s, now_s=now_s, min_key=min_key,
                                   free_only=free_only, priority=order.priority)
        if ticket is None:
            self.stats.prefetches_dropped += 1
            return self._output()
        self._start_load(s, ticket, use)
        return self._output()

    def _start_load(self, s: _Session, ticket: LoadTicket, use_s: float) -> None:
        """Start a prefetch the tier has room for; the entry is kept until ``use_s``."""
        self.stats.prefetches += 1
        s.planned_use_s = use_s
        self._touch(ticket.session_id)
        self._due_dirty.add(ticket.session_id)
        s.prefetches += 1
        self._step.loads.append(ticket)

    def hint(self, event: SessionEvent) -> StepOutput:
        """A hint changes the forecast: re-plan the session now."""
        self._observe(event)
        if self.policy.prefetch:
            self._plan(event.session_id, event.time_s)
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
            self._disarm(sid, s)
            for node in sorted(s.inflight_nodes):
                self._cancel(sid, node)
        self._evicted.discard(sid)
        self._recheck.discard(sid)
        self.predictor.forget(sid)
        self._last_forecast = None
        return self._output()

    # ------------------------------------------------------------------ node restarts
    def clear_local(self, now_s: float) -> StepOutput:
        """Every node restarted cold: forget their DRAM tiers and re-plan idle sessions."""
        for node, tier in enumerate(self.dram):
            for e in tier.clear():
                self._step.dropped.append(Placement(e.session_id, node))
                self.stats.wasted_bytes += e.prefetch_unused_bytes
        if self.policy.prefetch:
            for sid in sorted(self._sessions):
                s = self._sessions[sid]
                if s.home is not None and not s.in_flight:
                    self._plan(sid, now_s)
            for node in range(self.fleet.nodes):
                self._warm(node, [sid for sid, s in sorted(self._sessions.items())
                                  if s.home == node and s.pending is None], now_s)
        return self._output()

    def _warm(self, node: int, sids: Sequence[str], now_s: float, *,
              rehome: bool = False) -> None:
        """Warm a node that is empty (restarted or joined): fill its free DRAM with the
        idle sessions of ``sids`` that routing will send there, soonest predicted use
        first, at once (``rehome``: make the node their home). Free room displaces
        nothing, so no forecast has to be confident; the transfers yield the link to
        demand loads, and the waste budget does not hold them back (see
        :meth:`_within_waste_budget`)."""
        homed = [sid for sid in sids
                 if not self._sessions[sid].in_flight and self._sessions[sid].remote_tokens > 0
                 and node not in self._sessions[sid].inflight_nodes]
        if not homed:
            return
        uses = self._next_uses(homed, now_s)
        # Soonest predicted use first; sessions with no forecast of a return (their
        # predicted use is never) by recency, as an LRU tier would have kept them.
        order = sorted(zip(uses, homed, strict=True),
                       key=lambda u: (u[0], -self._sessions[u[1]].last_finish_s, u[1]))
        for use, sid in order:
            s = self._sessions[sid]
            ticket = self._reserve(sid, node, s.remote_tokens, prefetch=True, deadline_s=use,
                                   now_s=now_s, free_only=True, priority=0.0, warm_up=True)
            if ticket is not None:
                self._start_load(s, ticket, use)
                if rehome:
                    s.home = node
                    s.pending = None
                    self._due_dirty.add(sid)

    def node_left(self, node: int, now_s: float) -> StepOutput:
        """A node left the fleet (or is not in it yet): no request is routed there, its
        books are dropped, transfers to it stop, and its sessions have no home until they
        are served again."""
        self._down.add(node)
        for entry in self.dram[node].clear():
            self._step.dropped.append(Placement(entry.session_id, node))
        for sid, s in sorted(self._sessions.items()):
            if node in s.inflight_nodes:
                self._cancel(sid, node)
            if s.home == node:
                s.home = None
                s.pending = None
                self._due_dirty.add(sid)
        return self._output()

    def node_joined(self, node: int, now_s: float) -> StepOutput:
        """A node joined (empty): requests may be routed there from now on. Idle sessions
        whose KV is local nowhere have no locality to keep them where they were, so the
        router sends them by load: to this node first. It is warmed with them (they move
        home here), soonest predicted use first, within its free DRAM."""
        self._down.discard(node)
        if self.policy.prefetch:
            adrift = [sid for sid, s in sorted(self._sessions.items())
                      if s.home is not None and s.home != node
                      and self.local_tokens(s.home, sid) == 0]
            self._warm(node, adrift, now_s, rehome=True)
        return self._output()

    def reconcile(self, node: int, holds: Callable[[str, int], bool], now_s: float
                  ) -> StepOutput:
        """A node's agent reported what its tier holds: drop the book entries of sessions it
        does not hold (``holds(session_id, tokens)``), except those still arriving, whose
        transfers decide, and plan the idle ones again (a prefetch may bring them back, as
        after an eviction). Unknown sessions' entries are dropped too."""
        for entry in list(self.dram[node]):
            if entry.ready_at_s > now_s:
                continue
            sid = entry.session_id
            if sid not in self._sessions or not holds(sid, entry.tokens):
                self._drop(node, sid)
                self._plan_again(sid, now_s)
        return self._output()

    def forget_local(self, node: int, sids: set[str], now_s: float) -> StepOutput:
        """The node's tier lost these sessions (it evicted them by its own order): their
        book entries go and idle ones are planned again, as in :meth:`reconcile`."""
        return self.reconcile(node, lambda sid, _tokens: sid not in sids, now_s)

    def set_tier_capacity(self, node: int, capacity_bytes: int, now_s: float) -> StepOutput:
        """The node's DRAM-tier books may hold ``capacity_bytes`` from now on (its agent
        reported a smaller tier than configured, or this shard's quota of it moved). Over
        the new capacity, the sessions the policy evicts first go (the last one cut back
        to a prefix under suffix eviction) and are planned again. KV still arriving (or
        loaded for a waiting request) is pinned: if that alone is over, every other session
        goes and the books stay over until it lands (admissions find no free room). More
        capacity is free room for the next plans."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        tier = self.dram[node]
        tier.capacity_bytes = capacity_bytes
        over = tier.used_bytes - capacity_bytes
        if over > 0:
            victims = tier.victims_for(0, now_s)
            if victims is None:  # the pinned entries alone are over: all others go
                victims = [e for e in tier if not e.pinned]
            self._evict(node, victims, now_s, need_bytes=over)
        return self._output()

    def _within_waste_budget(self, nbytes: int) -> bool:
        """Whether a prefetch of ``nbytes`` more may start: every byte a prefetch started
        ends read (used), evicted or cut unread, or cancelled (wasted), or is still
        unread, so keeping ``exposed + nbytes <= (1 + r) x used + allowance`` at every
        start keeps ``wasted <= r x used + allowance`` at all times, whatever the forecasts
        (``r`` = ``planner.waste_per_used_byte``, 1: a prefetch never wastes more than it
        brings to requests, beyond a fixed credit). Forecasts that are right earn the
        budget they need; on traffic where they are wrong, prefetch stops once the credit
        is spent and resumes only as prefetches already started are read: a budget spent
        with none of them left unread stays spent until the scheduler restarts.

        Warm-ups of empty nodes (:meth:`_warm`) are outside it: they fill free room only,
        so what they can waste is bounded by the room, once per restart or join, and a
        budget spent (or never earned: a cold start) must not leave a restarted node empty.
        Their bytes widen the credit by as much, so the bound reads ``wasted <= r x used +
        allowance + warmed``."""
        if not self.policy.waste_budget:
            return True
        st = self.stats
        planner = self.fleet.planner
        credit = ((1.0 + planner.waste_per_used_byte) * st.prefetch_used_bytes
                  + planner.waste_allowance_gib * GIB + st.warmup_bytes)
        if st.prefetch_exposed_bytes + nbytes <= credit:
            return True
        st.prefetches_over_budget += 1
        return False

    # ------------------------------------------------------------------ tenant shares
    def _within_share(self, sid: str, node: int, grow_bytes: int, now_s: float, *,
                      min_key: float, prefetch: bool, free_only: bool = False) -> bool:
        """Whether the session's tenant may grow the node's books by ``grow_bytes`` (and,
        for a prefetch, start one now) within its shares; evicts the tenant's own sessions
        first where they make the room (see :mod:`kvprefetch.controlplane.core.quotas`)."""
        shares = self.shares
        assert shares is not None
        if prefetch and not shares.may_prefetch(sid, node, now_s):
            return False
        tier = self.dram[node]
        own = shares.own_victims(tier, sid, grow_bytes, now_s, min_key=min_key,
                                 free_only=free_only,
                                 strategy=self._predicted_use if prefetch else tier.strategy)
        if own is None:
            return False
        if own:
            # Whole sessions: a share counts whole entries (need = the whole tier keeps
            # suffix eviction from cutting the last one back instead).
            self._evict(node, own, now_s, need_bytes=tier.capacity_bytes)
        return True
