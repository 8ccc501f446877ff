"""Discrete-event replay of a trace over a modelled GPU fleet, for one policy.

What is modelled, per node: a FIFO prefill queue served by the GPU one request at a time
(decode runs batched beside it and does not hold the queue), an HBM KV tier (LRU, as the
engine's prefix cache), a DRAM tier (the node-local tier the agents warm; LRU or
predicted-next-use eviction), and an ingress link shared by all transfers into the node
(:mod:`controlplane.sim.link`). The remote store holds every session's latest context once
written (Valkey, LRU-bounded, in front of S3, unbounded). Writes to the remote store use
the NIC's egress direction and are not on any request's critical path.

A request's life: arrival -> routing (:mod:`controlplane.router`) -> (policy: load missing
KV at arrival) -> prefill queue -> (policy: load at schedule; the GPU waits = stall) ->
DRAM->HBM copy of reused KV (stall) -> prefill of the new tokens -> first token (TTFT)
-> decode -> finish: the context is written to HBM, the DRAM tier and the remote store.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from controlplane.config import FleetConfig
from controlplane.planner import (
    PrefetchOrder,
    TransferEstimate,
    plan_prefetch,
    predicted_use_s,
)
from controlplane.policies import EvictionKind, LoadStart, PolicySpec
from controlplane.router import NodeView, RouteRequest, route
from controlplane.tiers import LruEviction, PredictedUseEviction, Tier, TierEntry
from controlplane.types import EventKind, SessionEvent, Trace, TraceRequest, TraceSession
from predictors.base import Predictor

from .link import DEMAND, PREFETCH, Link, Transfer

_ARRIVE, _XFER_DONE, _PREFILL_DONE, _FINISH, _PREFETCH_START, _CLEAR = range(6)
INF = float("inf")
#: Prefetches of one session per idle period, so eviction ping-pong cannot loop.
MAX_PREFETCHES_PER_IDLE = 2
#: A prefetch timer that moved later by more than this is re-armed rather than executed.
REPLAN_SLACK_S = 1.0
MAX_REPLANS = 4


@dataclass(eq=False)
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


@dataclass(slots=True)
class _Node:
    idx: int
    hbm: Tier
    dram: Tier
    link: Link
    queue: deque[_Req] = field(default_factory=deque)
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
    remote_bytes: int = 0
    prefetches: int = 0
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
    """Replays ``trace`` on ``fleet`` under ``policy``. Deterministic: no clock, no
    randomness beyond the trace and the predictor, ties broken by insertion order."""

    def __init__(
        self,
        trace: Trace,
        fleet: FleetConfig,
        policy: PolicySpec,
        predictor: Predictor,
        *,
        clear_tiers_at_s: float | None = None,
        record_links: bool = False,
    ) -> None:
        self.trace = trace
        self.fleet = fleet
        self.policy = policy
        self.predictor = predictor
        self.clear_tiers_at_s = clear_tiers_at_s
        self.bpt = fleet.model.kv_bytes_per_token
        self.out = PolicyRun(policy.name)
        self._now = 0.0
        self._seq = 0
        self._events: list[tuple[float, int, int, object]] = []
        self._tid = 0
        self._in_flight: dict[str, int] = {}
        self._home: dict[str, int] = {}
        self._remote_tokens: dict[str, int] = {}
        self._valkey: OrderedDict[str, int] = OrderedDict()
        self._valkey_bytes = 0
        self._pending: dict[str, PrefetchOrder] = {}
        self._planned_use: dict[str, float] = {}
        self._replans: dict[str, int] = {}
        self._prefetch_count: dict[str, int] = {}
        self._sessions = {s.session_id: s for s in trace.sessions}
        node_cfg = fleet.node
        # The prefetcher admits an object only by displacing data predicted to be needed
        # later than its own; write-backs and demand loads follow the tier's own strategy.
        self._predicted_use = PredictedUseEviction(self._next_use)
        dram_strategy: LruEviction | PredictedUseEviction = (
            self._predicted_use if policy.eviction is EvictionKind.PREDICTED_USE
            else LruEviction()
        )
        dram_bytes = node_cfg.dram_tier_bytes if policy.dram_tier else 0
        self.nodes = [
            _Node(
                i,
                Tier(f"hbm{i}", node_cfg.hbm_kv_bytes, LruEviction()),
                Tier(f"dram{i}", dram_bytes, dram_strategy),
                Link(i),
            )
            for i in range(fleet.nodes)
        ]
        if record_links:
            for n in self.nodes:
                n.link.record = []
        remote = fleet.remote
        nic = node_cfg.nic_bytes_per_s
        self._valkey_s_per_byte = 1.0 / min(nic, remote.valkey_gbyte_s_per_node * 1e9)
        self._s3_s_per_byte = 1.0 / min(
            nic, remote.s3_gbyte_s_per_connection * 1e9 * remote.s3_connections
        )
        self._h2d_s_per_byte = 1.0 / (node_cfg.h2d_gbyte_s * 1e9)

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _push_completion(self, nxt: tuple[float, Transfer] | None) -> None:
        if nxt is not None:
            t, xfer = nxt
            self._push(t, _XFER_DONE, (xfer, xfer.version))

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
        handlers: dict[int, Callable[[Any], None]] = {
            _ARRIVE: self._on_arrive,
            _XFER_DONE: self._on_transfer_done,
            _PREFILL_DONE: self._on_prefill_done,
            _FINISH: self._on_finish,
            _PREFETCH_START: self._on_prefetch_start,
            _CLEAR: self._on_clear,
        }
        events = self._events
        done_before = 0
        while events:
            t, _, kind, payload = heapq.heappop(events)
            self._now = t
            handlers[kind](payload)
            self.out.events += 1
            if progress is not None and len(self.out.records) - done_before >= 500:
                progress(len(self.out.records) - done_before)
                done_before = len(self.out.records)
        if progress is not None:
            progress(len(self.out.records) - done_before)
        return self.out

    # ------------------------------------------------------------------ helpers
    def _observe(self, kind: EventKind, r: _Req, node: int) -> None:
        req = r.req
        self.predictor.observe(
            SessionEvent(
                kind=kind,
                session_id=req.session_id,
                time_s=self._now,
                turn=req.turn,
                input_tokens=req.input_tokens,
                output_tokens=req.output_tokens if kind is EventKind.REQUEST_FINISHED else 0,
                reused_tokens=req.reused_tokens,
                stop_reason=req.stop_reason if kind is EventKind.REQUEST_FINISHED else None,
                node=str(node),
                tenant=r.session.tenant,
                parent_id=r.session.parent_id,
            )
        )

    def _next_use(self, session_id: str, now_s: float) -> float:
        if session_id in self._in_flight:
            return now_s
        planned = self._planned_use.get(session_id)
        if planned is not None and now_s <= planned:
            return planned  # brought in on purpose: keep it until its predicted arrival
        return predicted_use_s(self.predictor.forecast(session_id, now_s), self.fleet.planner,
                               now_s)

    def _source(self, session_id: str) -> tuple[float, float, bool]:
        """(seconds per byte, first-byte latency, from S3?) of the session's remote copy."""
        remote = self.fleet.remote
        if session_id in self._valkey:
            return self._valkey_s_per_byte, remote.valkey_latency_s, False
        return self._s3_s_per_byte, remote.s3_first_byte_s, True

    def _local_tokens(self, node: _Node, session_id: str) -> int:
        """Tokens of the session on the node, in HBM or DRAM (ready or arriving)."""
        h = node.hbm.get(session_id)
        d = node.dram.get(session_id)
        return max(h.tokens if h else 0, d.tokens if d else 0)

    def _queue_wait(self, node: _Node) -> float:
        wait = node.queued_est_s
        if node.running is not None:
            wait += max(0.0, node.running_end_est_s - self._now)
        return wait

    def _evict_dram(self, node: _Node, victims: list[TierEntry]) -> None:
        for v in victims:
            node.dram.remove(v.session_id)
            if v.prefetched_unused:
                self.out.wasted_bytes += v.nbytes
            if self.policy.prefetch and v.session_id not in self._in_flight:
                self._plan(v.session_id)

    def _put_hbm(self, node: _Node, session_id: str, tokens: int, pinned: int) -> None:
        nbytes = tokens * self.bpt
        node.hbm.remove(session_id)
        victims = node.hbm.victims_for(nbytes, self._now, exclude=session_id)
        if victims is None:
            return  # does not fit beside pinned contexts: it is simply not cached
        for v in victims:
            node.hbm.remove(v.session_id)
        node.hbm.put(TierEntry(session_id, tokens, nbytes, self._now, pinned=pinned))

    # ------------------------------------------------------------------ transfers
    def _start_transfer(
        self, node: _Node, session_id: str, tokens: int, klass: int, deadline_s: float,
        *, min_key: float = -INF, strategy: PredictedUseEviction | None = None,
    ) -> Transfer | None:
        """Reserve DRAM for ``tokens`` of the session and queue the remote read."""
        have = node.dram.get(session_id)
        have_tokens = have.tokens if have is not None and have.ready_at_s <= self._now else 0
        delta = tokens - have_tokens
        if delta <= 0:
            return None
        nbytes = tokens * self.bpt
        old_bytes = have.nbytes if have is not None else 0
        victims = node.dram.victims_for(nbytes - old_bytes, self._now, exclude=session_id,
                                        min_key=min_key, strategy=strategy)
        if victims is None:
            return None
        self._evict_dram(node, victims)
        if have is not None and have.prefetched_unused:
            self.out.wasted_bytes += have.nbytes
        node.dram.put(
            TierEntry(session_id, tokens, nbytes, self._now, ready_at_s=INF, pinned=1,
                      prefetched_unused=klass == PREFETCH)
        )
        s_per_byte, latency, from_s3 = self._source(session_id)
        self._tid += 1
        xfer = Transfer(self._tid, session_id, node.idx, tokens, delta * self.bpt, s_per_byte,
                        latency, klass, deadline_s, self._now, from_s3=from_s3,
                        prefetch=klass == PREFETCH)
        node.inflight[session_id] = xfer
        self._push_completion(node.link.submit(xfer, self._now))
        return xfer

    def _cancel_transfer(self, node: _Node, xfer: Transfer) -> None:
        self._push_completion(node.link.cancel(xfer, self._now))
        node.inflight.pop(xfer.session_id, None)
        node.dram.remove(xfer.session_id)
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
        self._valkey_touch(xfer.session_id)
        entry = node.dram.get(xfer.session_id)
        if entry is not None:
            entry.ready_at_s = self._now
            entry.last_use_s = self._now
            if xfer.klass != DEMAND:
                entry.pinned = 0  # a demand load stays pinned until its request uses it
        waiting = node.running
        if waiting is not None and waiting.waiting_on is xfer:
            waiting.waiting_on = None
            if waiting.prefetch_ready_s is not None:
                waiting.prefetch_ready_s = self._now
            self._begin_prefill(node, waiting)

    def _valkey_touch(self, session_id: str) -> None:
        """Write or promote the session's object into Valkey (LRU beyond its capacity)."""
        cap = self.fleet.remote.valkey_capacity_bytes
        nbytes = self._remote_tokens.get(session_id, 0) * self.bpt
        old = self._valkey.pop(session_id, None)
        if old is not None:
            self._valkey_bytes -= old
        if nbytes > cap:
            return
        self._valkey[session_id] = nbytes
        self._valkey_bytes += nbytes
        while self._valkey_bytes > cap:
            _, b = self._valkey.popitem(last=False)
            self._valkey_bytes -= b

    # ------------------------------------------------------------------ requests
    def _on_arrive(self, r: _Req) -> None:
        sid = r.req.session_id
        self._in_flight[sid] = self._in_flight.get(sid, 0) + 1
        self._pending.pop(sid, None)
        self._prefetch_count.pop(sid, None)
        self._planned_use.pop(sid, None)
        self._observe(EventKind.REQUEST_STARTED, r, -1)
        remote_tokens = self._remote_tokens.get(sid, 0) if self.policy.remote else 0
        s_per_byte, latency, _ = self._source(sid)
        rr = RouteRequest(sid, r.req.input_tokens, r.req.reused_tokens, self._home.get(sid),
                          remote_tokens, s_per_byte, latency)
        views = []
        for n in self.nodes:
            h = n.hbm.get(sid)
            d = n.dram.get(sid)
            dram_wait = 0.0
            if d is not None and d.ready_at_s > self._now:
                dram_wait = n.link.backlog_s(self._now)
            views.append(NodeView(n.idx, self._queue_wait(n), h.tokens if h else 0,
                                  d.tokens if d else 0, dram_wait, n.link.backlog_s(self._now)))
        decision = route(rr, views, self.fleet)
        node = self.nodes[decision.node]
        r.node = node.idx
        # A prefetch heading elsewhere is now useless; one heading here becomes a demand.
        for other in self.nodes:
            xfer = other.inflight.get(sid)
            if xfer is None:
                continue
            if other is node:
                r.waiting_on = xfer
                r.prefetch_ready_s = INF if xfer.klass == PREFETCH else None
                self._push_completion(other.link.promote(xfer, self._now))
            elif xfer.klass == PREFETCH:
                self._cancel_transfer(other, xfer)
        d = node.dram.get(sid)
        if d is not None and d.prefetched_unused and d.ready_at_s <= self._now:
            r.prefetch_ready_s = d.ready_at_s
        if self.policy.load_start is LoadStart.ON_ARRIVAL:
            self._demand_load(node, r)
        r.est_service_s = decision.estimated_ttft_s - self._queue_wait(node)
        node.queued_est_s += r.est_service_s
        node.queue.append(r)
        self._try_start(node)

    def _demand_load(self, node: _Node, r: _Req) -> None:
        """Queue a remote read of the reusable KV that the node lacks."""
        sid = r.req.session_id
        if r.waiting_on is not None:
            return
        want = min(r.req.reused_tokens, self._remote_tokens.get(sid, 0))
        if want <= self._local_tokens(node, sid):
            return
        xfer = self._start_transfer(node, sid, want, DEMAND, self._now)
        if xfer is not None:
            r.waiting_on = xfer

    def _try_start(self, node: _Node) -> None:
        if node.running is not None or not node.queue:
            return
        r = node.queue.popleft()
        node.queued_est_s = max(0.0, node.queued_est_s - r.est_service_s)
        node.running = r
        node.running_end_est_s = self._now + r.est_service_s
        r.start_s = self._now
        if self.policy.load_start is LoadStart.ON_SCHEDULE:
            self._demand_load(node, r)
        if r.waiting_on is not None and r.waiting_on.done_s is None:
            return  # the GPU waits for the transfer: resumed by _on_transfer_done
        r.waiting_on = None
        self._begin_prefill(node, r)

    def _begin_prefill(self, node: _Node, r: _Req) -> None:
        now = self._now
        sid = r.req.session_id
        reuse = r.req.reused_tokens
        hbm = min(reuse, node.hbm.usable_tokens(sid, now))
        dram = min(reuse, node.dram.usable_tokens(sid, now))
        local = max(hbm, dram)
        d = node.dram.get(sid)
        if d is not None:
            d.pinned = 0
            if dram > 0:
                d.last_use_s = now
                d.prefetched_unused = False
        if r.prefetch_ready_s is not None:
            self.out.lateness_s.append(r.prefetch_ready_s - r.arrival_s)
        copy_s = max(0, dram - hbm) * self.bpt * self._h2d_s_per_byte
        r.kv_ready_s = now
        r.stall_s = (now - r.start_s) + copy_s
        r.reused_local_tokens = local
        prefill_s = self.fleet.prefill_s(r.req.input_tokens - local, local)
        r.first_token_s = now + copy_s + prefill_s + self.fleet.model.decode_s_per_token
        self._put_hbm(node, sid, r.req.input_tokens, pinned=1)
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
        left = self._in_flight.get(sid, 1) - 1
        if left:
            self._in_flight[sid] = left
        else:
            self._in_flight.pop(sid, None)
        self._home[sid] = node.idx
        self._put_hbm(node, sid, ctx, pinned=0)
        if self.policy.remote:
            self._remote_tokens[sid] = ctx
            self._valkey_touch(sid)
        self._observe(EventKind.REQUEST_FINISHED, r, node.idx)
        if self.policy.dram_tier and sid not in node.inflight:
            self._write_dram(node, sid, ctx)
        nxt = req.turn + 1
        session = r.session
        if nxt < len(session.requests):
            nreq = session.requests[nxt]
            if nreq.gap_s is not None:
                t = self._now + nreq.gap_s
                self._push(t, _ARRIVE, _Req(nreq, session, t))
        if self.policy.prefetch and not left:
            self._plan(sid)

    def _write_dram(self, node: _Node, sid: str, ctx: int) -> None:
        """Write-through of a finished context into the node's DRAM tier."""
        nbytes = ctx * self.bpt
        old = node.dram.get(sid)
        old_bytes = old.nbytes if old is not None else 0
        min_key = -INF
        if self.policy.eviction is EvictionKind.PREDICTED_USE:
            min_key = self._next_use(sid, self._now)
        victims = node.dram.victims_for(nbytes - old_bytes, self._now, exclude=sid,
                                        min_key=min_key)
        if victims is None:
            if old is not None:
                node.dram.remove(sid)
                if old.prefetched_unused:
                    self.out.wasted_bytes += old.nbytes
            return
        self._evict_dram(node, victims)
        if old is not None and old.prefetched_unused:
            self.out.wasted_bytes += old.nbytes
        node.dram.put(TierEntry(sid, ctx, nbytes, self._now, ready_at_s=self._now))

    # ------------------------------------------------------------------ prefetch planning
    def _plan(self, sid: str) -> None:
        """Plan (or re-plan) a prefetch of an idle session to its home node."""
        home = self._home.get(sid)
        tokens = self._remote_tokens.get(sid, 0)
        if home is None or tokens <= 0 or sid in self._in_flight:
            return
        if self._prefetch_count.get(sid, 0) >= MAX_PREFETCHES_PER_IDLE:
            return
        node = self.nodes[home]
        if self._local_tokens(node, sid) >= tokens:
            self._pending.pop(sid, None)
            return
        forecast = self.predictor.forecast(sid, self._now)
        s_per_byte, latency, _ = self._source(sid)
        order = plan_prefetch(
            forecast, session_id=sid, node=home, tokens=tokens, nbytes=tokens * self.bpt,
            now_s=self._now,
            transfer=TransferEstimate(latency, s_per_byte, node.link.backlog_s(self._now)),
            cfg=self.fleet.planner, safety_margin_s=self.policy.safety_margin_s,
        )
        if order is None:
            self._pending.pop(sid, None)
            return
        self._pending[sid] = order
        self._push(order.start_at_s, _PREFETCH_START, order)

    def _on_prefetch_start(self, order: PrefetchOrder) -> None:
        sid = order.session_id
        if self._pending.get(sid) is not order or sid in self._in_flight:
            return
        replans = self._replans.get(sid, 0)
        forecast = self.predictor.forecast(sid, self._now)
        if forecast is not None and replans < MAX_REPLANS:
            later = forecast.arrival_at(self.fleet.planner.arrival_quantile)
            if later - order.deadline_s > REPLAN_SLACK_S:
                self._replans[sid] = replans + 1
                self._plan(sid)
                return
        self._replans.pop(sid, None)
        del self._pending[sid]
        node = self.nodes[order.node]
        if self._local_tokens(node, sid) >= order.tokens:
            return
        min_key = max(self._now, order.predicted_use_s)
        if forecast is not None:
            min_key = max(self._now, forecast.arrival_at(0.5))
        xfer = self._start_transfer(node, sid, order.tokens, PREFETCH, order.deadline_s,
                                    min_key=min_key, strategy=self._predicted_use)
        if xfer is None:
            self.out.prefetches_dropped += 1
            return
        self.out.prefetches += 1
        self._planned_use[sid] = min_key
        self._prefetch_count[sid] = self._prefetch_count.get(sid, 0) + 1

    def _on_clear(self, _: object) -> None:
        """Every node restarts cold; the planner then re-plans every idle session."""
        for n in self.nodes:
            n.hbm.clear()
            for e in n.dram.clear():
                if e.prefetched_unused:
                    self.out.wasted_bytes += e.nbytes
        if self.policy.prefetch:
            for sid in sorted(self._home):
                if sid not in self._in_flight:
                    self._plan(sid)
