"""Demand loads and the timed loads of queued requests: :class:`DemandLoads`.

A demand load brings the reusable KV a node lacks for a request routed there, from the
remote store. When it starts depends on the policy's ``load_start``: at arrival
(``ON_ARRIVAL``), when the GPU picks the request up (``ON_SCHEDULE``), or (``ADAPTIVE``)
during the queue wait when the wait hides enough of it, behind a long queue as a *timed
load* armed to start a few TTLBs before the request's estimated GPU start.

Who calls what, once per request each: :meth:`DemandLoads.routed` after the router chose
the node; :meth:`DemandLoads.gpu_started` when the node's GPU picks the request up;
:meth:`DemandLoads.start_queued` when a timed load's ``start_at_s`` comes (the driver
calls ``start_prefetch`` with the ``queued`` order).

Queue drift
-----------
A timed load's times come from the queue wait estimated at routing, and a queue runs ahead
of or behind its estimates (a load stalls a GPU, a prefill was over-estimated). Each GPU
start on a node says by how much: the request's estimated start minus now, counted into the
node's drift (seconds, summed), and every armed load on the node moves by the drift since it
was armed: started at once when its time has come, armed again earlier when it moved by
more than a tenth of its lead (and checked again when its timer fires, if it moved later).
Invariant: a session has at most one armed timed load (``SessionState.queued``), listed in
its node's armed map until it starts or its request is picked up.
"""

from __future__ import annotations

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.core.books import TierBooks
from kvprefetch.controlplane.core.draft import StepDraft
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.policies import LoadStart, PolicySpec
from kvprefetch.controlplane.core.sessions import Sessions, SessionState
from kvprefetch.controlplane.core.step import DEMAND_PRIORITY, QUEUED_PRIORITY
from kvprefetch.controlplane.core.view import FleetView

__all__ = ["DemandLoads"]

#: The load starts that leave a demand load to the GPU start (ADAPTIVE: when not started
#: or armed during the queue wait).
_AT_GPU_START = (LoadStart.ON_SCHEDULE, LoadStart.ADAPTIVE)


class DemandLoads:
    """Demand loads and timed loads of one core (module docstring)."""

    def __init__(self, fleet: FleetConfig, policy: PolicySpec, view: FleetView,
                 books: TierBooks, sessions: Sessions, draft: StepDraft) -> None:
        self._planner = fleet.planner
        self._policy = policy
        self._view = view
        self._books = books
        self._sessions = sessions
        self._draft = draft
        self._bpt = fleet.model.kv_bytes_per_token
        #: Per node: how far ahead of the estimates made at routing its GPU queue runs
        #: (seconds, summed over its GPU starts), and the timed loads armed for requests
        #: waiting in it (session -> order).
        self._drift = [0.0] * fleet.nodes
        self._armed: list[dict[str, PrefetchOrder]] = [{} for _ in range(fleet.nodes)]

    def routed(self, sid: str, s: SessionState, node: int, reused_tokens: int,
               heading: bool, now_s: float) -> None:
        """The request was routed to ``node`` (``heading``: a transfer of the session is
        already on its way there): start its demand load now, arm it for later, or leave
        it to the GPU start (see :meth:`_arrival_load_start`)."""
        adaptive = self._policy.load_start is LoadStart.ADAPTIVE
        wait = self._view.queue_wait_s(node, now_s) if adaptive else 0.0
        if heading:
            s.awaiting_node = node
        else:
            start = self._arrival_load_start(sid, node, reused_tokens, now_s, wait)
            if start is not None and start <= now_s:
                self.demand_load(sid, node, reused_tokens, now_s, now_s + wait)
            elif start is not None:
                self._arm(s, sid, node, min(reused_tokens, self._sessions.remote_tokens(sid)),
                          start, now_s + wait)
        if adaptive:
            s.expected_start_s = now_s + wait
            s.routed_drift_s = self._drift[node]

    def gpu_started(self, sid: str, node: int, reused_tokens: int, now_s: float) -> None:
        """The node's GPU picks the request up: policies that load then start the demand
        load of what the node lacks, unless the request already waits for a transfer; the
        node's queue drift moves the timed loads armed behind it."""
        s = self._sessions.of(sid)
        awaiting, s.awaiting_node = s.awaiting_node, None
        self.disarm(sid, s)  # picked up before its timed load started: load now
        if awaiting is None and self._policy.load_start in _AT_GPU_START:
            self.demand_load(sid, node, reused_tokens, now_s)
        if s.expected_start_s is not None:
            expected = s.expected_start_s - (self._drift[node] - s.routed_drift_s)
            self._drift[node] += expected - now_s
            s.expected_start_s = None
            if self._armed[node]:
                self._queue_moved(node, now_s)

    def start_queued(self, order: PrefetchOrder, now_s: float) -> None:
        """A timed load's start time came: start it if its request still waits in the
        queue, or arm it again if the queue fell behind."""
        sid = order.session_id
        s = self._sessions.get(sid)
        if s is not None and s.queued is order:  # its request still waits in the queue
            shift = self._drift[order.node] - s.queued_drift_s
            if order.start_at_s - shift > now_s:  # the queue fell behind: not yet
                self._rearm(sid, s, order, shift)
            else:
                self._start_armed(sid, s, order, shift, now_s)

    def demand_load(self, sid: str, node: int, reused_tokens: int, now_s: float,
                    deadline_s: float | None = None) -> None:
        """A remote read of the reusable KV the node lacks, unless there is nothing to load,
        no remote copy, a transfer already under way, or no room. Due now (the GPU waits
        for it) unless a later ``deadline_s`` says when the GPU is expected to pick the
        request up: such a load yields the link to those a GPU waits for
        (``QUEUED_PRIORITY``)."""
        s = self._sessions.of(sid)
        if node in s.inflight_nodes:
            return
        want = min(reused_tokens, self._sessions.remote_tokens(sid))
        if want <= self._books.local_tokens(node, sid):
            return
        due = now_s if deadline_s is None else deadline_s
        ticket = self._books.reserve(
            sid, node, want, prefetch=False, deadline_s=due, now_s=now_s,
            priority=QUEUED_PRIORITY if due > now_s else DEMAND_PRIORITY)
        if ticket is not None:
            s.awaiting_node = node
            self._draft.loads.append(ticket)

    def disarm(self, sid: str, s: SessionState) -> None:
        """Forget the session's timed load, if one is armed."""
        if s.queued is not None:
            self._armed[s.queued.node].pop(sid, None)
            s.queued = None

    def _arm(self, s: SessionState, sid: str, node: int, tokens: int, start_s: float,
             due_s: float) -> None:
        """Arm the timed load of ``tokens`` for ``sid``'s request queued on ``node``, to
        start at ``start_s``, due at its estimated GPU start ``due_s``."""
        order = PrefetchOrder(sid, node, tokens, tokens * self._bpt, start_s, due_s,
                              QUEUED_PRIORITY, due_s, queued=True)
        s.queued = order
        s.queued_drift_s = self._drift[node]
        self._armed[node][sid] = order
        self._draft.orders.append(order)

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

    def _rearm(self, sid: str, s: SessionState, order: PrefetchOrder, shift: float) -> None:
        """Arm ``order`` again, ``shift`` seconds earlier (later if negative)."""
        self.disarm(sid, s)
        self._arm(s, sid, order.node, order.tokens, order.start_at_s - shift,
                  order.deadline_s - shift)

    def _start_armed(self, sid: str, s: SessionState, order: PrefetchOrder, shift: float,
                     now_s: float) -> None:
        self.disarm(sid, s)
        self.demand_load(sid, order.node, order.tokens, now_s, order.deadline_s - shift)

    def _arrival_load_start(self, sid: str, node: int, reused_tokens: int, now_s: float,
                            wait: float) -> float | None:
        """When to start loading what the node lacks for a request routed to it now, with
        an estimated ``wait`` before the GPU picks it up; None: when it does (at GPU
        start). ``ON_ARRIVAL``: now. ``ADAPTIVE``: when the request queues (an estimated
        wait above 0) and the wait hides at least ``arrival_load_min_wait_fraction`` (by
        default 0) of the load's time to last byte (estimated as the router does:
        first-byte latency + bytes at the source's rate), ``arrival_load_max_wait_fraction``
        TTLBs before the estimated GPU start, or now if that is sooner: behind a long queue
        a load at arrival would hold DRAM for the whole wait, evicting what the requests
        ahead need (an overloaded fleet then thrashes, as ``queue`` does), while one
        started a few TTLBs before the GPU start still lands off the GPU's critical
        path."""
        load_start = self._policy.load_start
        if load_start is LoadStart.ON_ARRIVAL:
            return now_s
        if load_start is not LoadStart.ADAPTIVE or wait <= 0.0:
            # No queue: the GPU picks the request up now, and an engine that reads the
            # remote store on its own (vLLM + LMCache) would fetch the same bytes.
            return None
        missing = (min(reused_tokens, self._sessions.remote_tokens(sid))
                   - self._books.local_tokens(node, sid))
        if missing <= 0:
            return None
        s_per_byte, latency = self._view.remote_source(sid)
        ttlb = latency + missing * self._bpt * s_per_byte
        planner = self._planner
        if wait < planner.arrival_load_min_wait_fraction * ttlb:
            return None
        return now_s + max(0.0, wait - planner.arrival_load_max_wait_fraction * ttlb)
