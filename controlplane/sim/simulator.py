"""Discrete-event replay of a trace over a modelled GPU fleet, for one policy.

What is modelled, per node: a FIFO prefill queue served by the GPU one request at a time
(decode runs batched beside it and does not hold the queue), an HBM KV tier (the engine's
prefix cache: LRU, or the policy's HBM retention,
:mod:`kvprefetch.controlplane.sim.peers.hbm_retention`), a DRAM tier (the node-local tier the
agents warm; LRU, predicted-next-use or retention-window eviction), and an ingress link
shared by all transfers into the node
(:mod:`kvprefetch.controlplane.sim.link`). The remote store holds every session's latest context
once written (Valkey, LRU-bounded, in front of S3, unbounded). Writes to the remote store use
the NIC's egress direction and are not on any request's critical path.

A request's life: arrival -> routing (:mod:`kvprefetch.controlplane.core.router`) -> (policy: load
missing KV at arrival) -> prefill queue -> (policy: load at schedule; the GPU waits = stall) ->
DRAM->HBM copy of reused KV (stall) -> prefill of the new tokens -> first token (TTFT)
-> decode -> finish: the context is written to HBM, the DRAM tier and the remote store.

Every policy runs on one engine profile (:mod:`kvprefetch.controlplane.core.engines`),
which sets the mechanisms above for all of them alike. Under demote-on-evict (lazy offload,
write-back) a finished context goes to HBM alone and reaches DRAM when HBM evicts it (or
does not take it), where the core's DRAM ranking admits it or not. Under asynchronous
loads a request whose KV is still loading when the GPU picks it up is set aside, and the
GPU serves the next request; once the load lands the request goes before the queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.types import (
    EventKind,
    SessionEvent,
    Trace,
    TraceRequest,
    TraceSession,
)
from kvprefetch.controlplane.core.engines import (
    DEFAULT_ENGINE,
    EngineProfile,
    engine_profile,
    on_engine,
)
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.policies import PolicySpec
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import DEMAND_PRIORITY, LoadTicket, StepOutput
from kvprefetch.controlplane.core.tiers import Tier
from kvprefetch.controlplane.sim.peers.hbm_retention import HbmRetention
from kvprefetch.controlplane.sim.sharded_core import ShardedCore
from kvprefetch.predictors.base import Predictor

from .engine_hbm import EngineHbm
from .hints import HintCounts, PlannedHint, hints_by_turn
from .link import DEMAND, PREFETCH, QUEUED, Link, Transfer
from .remote import RemoteStore

(_ARRIVE, _XFER_DONE, _PREFILL_DONE, _FINISH, _PREFETCH_START, _CLEAR, _SWEEP, _HINT,
 _JOIN) = range(9)
INF = float("inf")


@dataclass(slots=True, eq=False)
class _Req:
    req: TraceRequest
    session: TraceSession
    arrival_s: float
    node: int = -1
    start_s: float = -1.0
    kv_ready_s: float = -1.0
    first_token_s: float = -1.0
    stall_s: float = 0.0
    reused_local_tokens: int = 0
    waiting_on: Transfer | None = None
    est_service_s: float = 0.0
    prefetch_ready_s: float | None = None

    def event(self, kind: EventKind, node: int | None, now_s: float) -> SessionEvent:
        """The request's start or finish as the scheduling core hears of it."""
        req = self.req
        finished = kind is EventKind.REQUEST_FINISHED
        return SessionEvent(
            kind=kind, session_id=req.session_id, time_s=now_s, turn=req.turn,
            input_tokens=req.input_tokens,
            output_tokens=req.output_tokens if finished else 0,
            reused_tokens=req.reused_tokens,
            stop_reason=req.stop_reason if finished else None,
            node=node, tenant=self.session.tenant, parent_id=self.session.parent_id)


@dataclass(slots=True)
class _Node:
    idx: int
    #: (Its DRAM tier is the scheduling core's books: the core answers for it.)
    hbm: Tier
    link: Link
    queue: deque[_Req] = field(default_factory=deque)
    #: Under asynchronous loads: requests the GPU set aside while their KV loads, and
    #: those whose KV has landed, which go before the queue.
    loading: list[_Req] = field(default_factory=list)
    loaded: deque[_Req] = field(default_factory=deque)
    running: _Req | None = None
    running_end_est_s: float = 0.0
    queued_est_s: float = 0.0
    inflight: dict[str, Transfer] = field(default_factory=dict)


@dataclass(slots=True)
class RequestRecord:
    """One served request, as the metrics see it."""

    session_id: str
    turn: int
    node: int
    arrival_s: float
    start_s: float
    kv_ready_s: float
    first_token_s: float
    returning: bool
    stall_s: float
    reused_tokens: int
    reused_local_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(slots=True)
class PolicyRun:
    """Everything one policy's replay produced (raw; summarised by :mod:`.metrics`)."""

    policy: str
    records: list[RequestRecord] = field(default_factory=list)
    prefetched_bytes: int = 0
    wasted_bytes: int = 0
    prefetch_used_bytes: int = 0
    remote_bytes: int = 0
    prefetches: int = 0
    prefetches_over_budget: int = 0
    warmup_bytes: int = 0
    prefetches_dropped: int = 0
    prefetches_cancelled: int = 0
    ttlb_s: list[float] = field(default_factory=list)
    lateness_s: list[float] = field(default_factory=list)
    events: int = 0


def clamp_request(r: TraceRequest, window: int) -> TraceRequest:
    """Fit a request into the model's context window: the oldest tokens fall out, the new
    ones stay, and the rest of the window is still the reusable prefix."""
    if r.context_tokens_after <= window:
        return r
    inp = min(r.input_tokens, window)
    new = min(r.new_tokens, inp)
    return replace(r, input_tokens=inp, reused_tokens=inp - new,
                   output_tokens=min(r.output_tokens, window - inp))


def clamp_to_window(trace: Trace, window: int) -> Trace:
    """The trace with every request clamped to ``window`` tokens (see clamp_request)."""
    if all(r.context_tokens_after <= window for r in trace.iter_requests()):
        return trace
    sessions = tuple(
        replace(s, requests=tuple(clamp_request(r, window) for r in s.requests))
        for s in trace.sessions
    )
    return replace(trace, sessions=sessions)


class Simulation:
    """Replays ``trace`` on ``fleet`` under ``policy`` as it runs on ``engine`` (a profile
    or its name; :func:`~kvprefetch.controlplane.core.engines.on_engine`): the physics of
    the fleet (GPU queues, HBM, links, the remote store) around one :class:`SchedulerCore`,
    which makes every decision. Deterministic: no clock, no randomness beyond the trace and
    the predictor, ties broken by insertion order."""

    def __init__(
        self,
        trace: Trace,
        fleet: FleetConfig,
        policy: PolicySpec,
        predictor: Predictor,
        *,
        clear_tiers_at_s: float | None = None,
        join_at_s: float | None = None,
        record_links: bool = False,
        hints: Iterable[PlannedHint] = (),
        shards: int = 1,
        shared_tier: bool = False,
        engine: EngineProfile | str = DEFAULT_ENGINE,
    ) -> None:
        self.trace = trace
        self.fleet = fleet
        self.engine = engine_profile(engine) if isinstance(engine, str) else engine
        self.policy = policy = on_engine(policy, self.engine)
        self.predictor = predictor
        self.clear_tiers_at_s = clear_tiers_at_s
        #: Scale-out: the last node is absent until then, and joins empty.
        self.join_at_s = join_at_s
        self.bpt = fleet.model.kv_bytes_per_token
        self.out = PolicyRun(policy.name)
        self._now = 0.0
        self._seq = 0
        self._events: list[tuple[float, int, int, object]] = []
        self._tid = 0
        #: Orders the core armed during the event being handled (armed after it).
        self._orders: list[PrefetchOrder] = []
        self.remote = RemoteStore(fleet)
        #: One core, or ``shards`` cores each planning with its quota of the fleet (or
        #: sharing each node's tier).
        self.core: SchedulerCore | ShardedCore = (
            SchedulerCore(fleet, policy, predictor, self) if shards == 1
            else ShardedCore(fleet, policy, predictor, self, shards, shared_tier=shared_tier))
        node_cfg = fleet.node
        self.hbm = EngineHbm(fleet, policy, self.core, self.remote, self._carry,
                             self.queue_wait_s)
        #: The engine's HBM retention under this policy; None: LRU.
        self.hbm_retention: HbmRetention | None = self.hbm.retention
        self.nodes = [_Node(i, self.hbm.tiers[i], Link(i)) for i in range(fleet.nodes)]
        if record_links:
            for n in self.nodes:
                n.link.record = []
        self._h2d_s_per_byte = 1.0 / (node_cfg.h2d_gbyte_s * 1e9)
        #: Client hints (:mod:`.hints`), sent relative to the end of the response before
        #: their request; and those sent so far.
        self._hints = hints_by_turn(hints)
        self.hints_sent = HintCounts()

    # ------------------------------------------------------------------ FleetView
    def queue_wait_s(self, node: int, now_s: float) -> float:
        n = self.nodes[node]
        wait = n.queued_est_s
        if n.running is not None:
            wait += max(0.0, n.running_end_est_s - now_s)
        return wait

    def link_backlog_s(self, node: int, now_s: float) -> float:
        return self.nodes[node].link.backlog_s(now_s)

    def hbm_tokens(self, node: int, session_id: str) -> int:
        e = self.nodes[node].hbm.get(session_id)
        return e.tokens if e is not None else 0

    def remote_source(self, session_id: str) -> tuple[float, float]:
        s_per_byte, latency, _ = self.remote.source(session_id)
        return s_per_byte, latency

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _push_completion(self, nxt: tuple[float, Transfer] | None) -> None:
        if nxt is not None:
            t, xfer = nxt
            self._push(t, _XFER_DONE, (xfer, xfer.version))

    def _carry(self, out: StepOutput, own: str | None = None) -> None:
        """Carry out what the core decided: stop the transfers it cancelled, start its
        prefetch loads and the timed loads of requests waiting in a queue (each such
        request then waits for its own), and keep its new orders to arm once the event is
        handled. (The demand load of ``own``, the request the call is about, is the
        caller's to attach.) Evictions need nothing here: the DRAM tiers the nodes use are
        the core's books."""
        for c in out.cancels:
            node = self.nodes[c.node]
            xfer = node.inflight.get(c.session_id)
            if xfer is not None:
                self._cancel_transfer(node, xfer)
        for ticket in out.loads:
            if ticket.prefetch:
                self._submit(ticket)
            elif ticket.session_id != own:
                queued = self.nodes[ticket.node].queue
                r = next(r for r in queued if r.req.session_id == ticket.session_id)
                r.waiting_on = self._submit(ticket)
        self._orders.extend(out.orders)

    def _arm_orders(self) -> None:
        for order in self._orders:
            self._push(order.start_at_s, _PREFETCH_START, order)
        self._orders.clear()

    def run(self, progress: Callable[[int], None] | None = None) -> PolicyRun:
        self.trace = clamp_to_window(self.trace, self.fleet.model.max_context_tokens)
        # Open-loop requests (and every first request) are known up front; closed-loop
        # ones are scheduled when the previous response of their session ends.
        for s in self.trace.sessions:
            for r in s.requests:
                if r.turn == 0 or r.gap_s is None:
                    self._push(s.start_s + r.offset_s, _ARRIVE, _Req(r, s, s.start_s + r.offset_s))
        if self.clear_tiers_at_s is not None:
            self._push(self.clear_tiers_at_s, _CLEAR, None)
        if self.join_at_s is not None:
            self._carry(self.core.node_left(self.fleet.nodes - 1, 0.0))
            self._push(self.join_at_s, _JOIN, self.fleet.nodes - 1)
        handlers: dict[int, Callable[[Any], None]] = {
            _ARRIVE: self._on_arrive,
            _XFER_DONE: self._on_transfer_done,
            _PREFILL_DONE: self._on_prefill_done,
            _FINISH: self._on_finish,
            _PREFETCH_START: self._on_prefetch_start,
            _CLEAR: self._on_clear,
            _SWEEP: self._on_sweep,
            _HINT: self._on_hint,
            _JOIN: self._on_join,
        }
        if self.policy.prefetch:
            self._push(self.fleet.planner.sweep_interval_s, _SWEEP, None)
        events = self._events
        done_before = 0
        while events:
            t, _, kind, payload = heapq.heappop(events)
            self._now = t
            handlers[kind](payload)
            self._arm_orders()
            self.out.events += 1
            if progress is not None and len(self.out.records) - done_before >= 500:
                progress(len(self.out.records) - done_before)
                done_before = len(self.out.records)
        if progress is not None:
            progress(len(self.out.records) - done_before)
        stats = self.core.stats
        self.out.prefetches = stats.prefetches
        self.out.prefetches_dropped = stats.prefetches_dropped
        self.out.wasted_bytes += stats.wasted_bytes
        self.out.prefetch_used_bytes = stats.prefetch_used_bytes
        self.out.prefetches_over_budget = stats.prefetches_over_budget
        self.out.warmup_bytes = stats.warmup_bytes
        return self.out

    # ------------------------------------------------------------------ helpers
    # ------------------------------------------------------------------ transfers
    def _submit(self, ticket: LoadTicket) -> Transfer:
        node = self.nodes[ticket.node]
        s_per_byte, latency, from_s3 = self.remote.source(ticket.session_id)
        self._tid += 1
        klass = (PREFETCH if ticket.prefetch
                 else QUEUED if ticket.priority < DEMAND_PRIORITY else DEMAND)
        xfer = Transfer(self._tid, ticket.session_id, node.idx, ticket.tokens, ticket.nbytes,
                        s_per_byte, latency, klass, ticket.deadline_s, self._now,
                        from_s3=from_s3, prefetch=ticket.prefetch)
        node.inflight[ticket.session_id] = xfer
        self._push_completion(node.link.submit(xfer, self._now))
        return xfer

    def _cancel_transfer(self, node: _Node, xfer: Transfer) -> None:
        self._push_completion(node.link.cancel(xfer, self._now))
        node.inflight.pop(xfer.session_id, None)
        moved = xfer.moved_bytes
        self.out.remote_bytes += moved
        if xfer.prefetch:
            self.out.prefetched_bytes += moved
            self.out.wasted_bytes += moved
            self.out.prefetches_cancelled += 1

    def _on_transfer_done(self, payload: object) -> None:
        xfer: Transfer
        version: int
        xfer, version = payload  # type: ignore[misc]
        if xfer.version != version or xfer.cancelled:
            return
        node = self.nodes[xfer.node]
        self._push_completion(node.link.complete(xfer, self._now))
        node.inflight.pop(xfer.session_id, None)
        self.out.remote_bytes += xfer.nbytes
        self.out.ttlb_s.append(self._now - xfer.submitted_s)
        if xfer.prefetch:
            self.out.prefetched_bytes += xfer.nbytes
        self.remote.touch(xfer.session_id)
        self._carry(self.core.transfer_done(xfer.session_id, node.idx, self._now,
                                            demand=xfer.klass != PREFETCH))
        waiting = node.running
        if waiting is not None and waiting.waiting_on is xfer:
            self._landed(waiting)
            self._begin_prefill(node, waiting)
            return
        aside = next((r for r in node.loading if r.waiting_on is xfer), None)
        if aside is not None:
            node.loading.remove(aside)
            self._landed(aside)
            node.loaded.append(aside)
            self._try_start(node)

    def _landed(self, r: _Req) -> None:
        """The load ``r`` waited for landed."""
        r.waiting_on = None
        if r.prefetch_ready_s is not None:
            r.prefetch_ready_s = self._now

    # ------------------------------------------------------------------ requests
    def _on_arrive(self, r: _Req) -> None:
        sid = r.req.session_id
        if self.hbm_retention is not None:
            self.hbm_retention.arrived(sid, self._now)
        self._carry(self.core.request_started(r.event(EventKind.REQUEST_STARTED, None, self._now)))
        out = self.core.route_request(sid, r.req.input_tokens, r.req.reused_tokens, self._now)
        self._carry(out, sid)
        node = self.nodes[out.node]
        r.node = node.idx
        r.prefetch_ready_s = out.prefetch_ready_s
        inflight = node.inflight.get(sid)
        if inflight is not None:
            r.waiting_on = inflight
            if out.promote:
                self._push_completion(node.link.promote(inflight, self._now))
        elif r.prefetch_ready_s == INF:  # the books' prefetch is not on this node's link
            r.prefetch_ready_s = None
        self._attach_demand(r, out)
        assert out.route is not None
        r.est_service_s = out.route.estimated_ttft_s - self.queue_wait_s(node.idx, self._now)
        node.queued_est_s += r.est_service_s
        node.queue.append(r)
        self._try_start(node)

    def _attach_demand(self, r: _Req, out: StepOutput) -> None:
        ticket = out.demand_load(r.req.session_id)
        if ticket is not None:
            r.waiting_on = self._submit(ticket)

    def _try_start(self, node: _Node) -> None:
        while node.running is None and node.loaded:
            r = node.loaded.popleft()
            node.queued_est_s = max(0.0, node.queued_est_s - r.est_service_s)
            self._run(node, r)
            self._begin_prefill(node, r)
        while node.running is None and node.queue:
            r = node.queue.popleft()
            node.queued_est_s = max(0.0, node.queued_est_s - r.est_service_s)
            self._run(node, r)
            r.start_s = self._now
            out = self.core.gpu_start(r.req.session_id, node.idx, r.req.reused_tokens,
                                      self._now)
            self._carry(out, r.req.session_id)
            self._attach_demand(r, out)
            if r.waiting_on is not None and r.waiting_on.done_s is None:
                # The transfer goes first; the GPU waits for it (resumed by
                # _on_transfer_done), or under asynchronous loads sets the request aside
                # and serves the next one.
                self._push_completion(node.link.promote(r.waiting_on, self._now))
                if not self.policy.async_load:
                    return
                node.running = None
                node.loading.append(r)
                node.queued_est_s += r.est_service_s
                continue
            self._start_ready(node, r)

    def _run(self, node: _Node, r: _Req) -> None:
        node.running = r
        node.running_end_est_s = self._now + r.est_service_s

    def _start_ready(self, node: _Node, r: _Req) -> None:
        """The GPU picked up ``r`` and its KV needs no load it waits for: prefill."""
        if r.waiting_on is not None and r.prefetch_ready_s == INF:
            r.prefetch_ready_s = r.waiting_on.done_s  # the prefetch landed while it queued
        r.waiting_on = None
        self._begin_prefill(node, r)

    def _begin_prefill(self, node: _Node, r: _Req) -> None:
        now = self._now
        sid = r.req.session_id
        reuse = r.req.reused_tokens
        hbm = min(reuse, node.hbm.usable_tokens(sid, now))
        dram = self.core.use_local(sid, node.idx, reuse, now)
        local = max(hbm, dram)
        if r.prefetch_ready_s is not None:
            self.out.lateness_s.append(r.prefetch_ready_s - r.arrival_s)
        copy_s = max(0, dram - hbm) * self.bpt * self._h2d_s_per_byte
        r.kv_ready_s = now
        r.stall_s = (now - r.start_s) + copy_s
        r.reused_local_tokens = local
        prefill_s = self.fleet.prefill_s(r.req.input_tokens - local, local)
        r.first_token_s = (now + copy_s + prefill_s + self.fleet.model.decode_s_per_token
                           + self.fleet.node.request_overhead_s)
        self.hbm.put(node.idx, sid, r.req.input_tokens, 1, now)
        self._push(r.first_token_s, _PREFILL_DONE, r)

    def _on_prefill_done(self, r: _Req) -> None:
        node = self.nodes[r.node]
        node.running = None
        req = r.req
        self.out.records.append(
            RequestRecord(req.session_id, req.turn, r.node, r.arrival_s, r.start_s, r.kv_ready_s,
                          r.first_token_s, req.reused_tokens > 0, r.stall_s, req.reused_tokens,
                          r.reused_local_tokens)
        )
        decode_left = max(0, req.output_tokens - 1) * self.fleet.model.decode_s_per_token
        self._push(self._now + decode_left, _FINISH, r)
        self._try_start(node)

    def _on_finish(self, r: _Req) -> None:
        node = self.nodes[r.node]
        req = r.req
        sid = req.session_id
        ctx = req.context_tokens_after
        hbm_first = self.hbm.takes_finished_first
        if hbm_first:
            self.hbm.keep_finished(node.idx, sid, ctx, req.stop_reason, self._now)
        if self.policy.remote:
            self.remote.write(sid, ctx)
        self._carry(self.core.request_finished(
            r.event(EventKind.REQUEST_FINISHED, node.idx, self._now), ctx))
        if not hbm_first:
            self.hbm.keep_finished(node.idx, sid, ctx, req.stop_reason, self._now)
        nxt = req.turn + 1
        session = r.session
        self._push_hints(session, nxt)
        if nxt < len(session.requests):
            nreq = session.requests[nxt]
            if nreq.gap_s is not None:
                t = self._now + nreq.gap_s
                self._push(t, _ARRIVE, _Req(nreq, session, t))

    def _push_hints(self, session: TraceSession, turn: int) -> None:
        """The response before request ``turn`` just ended: schedule the hints of that gap.
        Pushed before the request's arrival, so a hint due at the arrival instant still
        precedes it; one due after the arrival (not from this trace's plan) is never sent."""
        planned = self._hints.get((session.session_id, turn), ())
        if not planned:
            return
        arrival_s = INF  # after the session's last response: no request follows
        if turn < len(session.requests):
            nxt = session.requests[turn]
            arrival_s = (self._now + nxt.gap_s if nxt.gap_s is not None
                         else session.start_s + nxt.offset_s)
        for h in planned:
            t = self._now + h.after_finish_s
            if t <= arrival_s:
                self._push(t, _HINT, (h, session))

    def _on_hint(self, payload: tuple[PlannedHint, TraceSession]) -> None:
        """A client hint reaches the core like any other event (an abandoned one too: the
        predictor cannot tell it apart)."""
        hint, session = payload
        self.hints_sent = self.hints_sent.add(hint)
        self._carry(self.core.hint(SessionEvent(
            kind=EventKind.HINT, session_id=hint.session_id, time_s=self._now, turn=hint.turn,
            hint=hint.kind, eta_s=hint.eta_s, tenant=session.tenant,
            parent_id=session.parent_id)))

    def _on_prefetch_start(self, order: PrefetchOrder) -> None:
        self._carry(self.core.start_prefetch(order, self._now))

    def _on_sweep(self, _: object) -> None:
        self._carry(self.core.sweep(self._now))
        if len(self._events) > 0:  # keep sweeping while anything else is left to happen
            self._push(self._now + self.fleet.planner.sweep_interval_s, _SWEEP, None)

    def _on_join(self, node: int) -> None:
        """A node joins (empty); the core routes to it from now on and may warm it."""
        self._carry(self.core.node_joined(node, self._now))

    def _on_clear(self, _: object) -> None:
        """Every node restarts cold; the core then re-plans every idle session."""
        for n in self.nodes:
            n.hbm.clear()
        self._carry(self.core.clear_local(self._now))
