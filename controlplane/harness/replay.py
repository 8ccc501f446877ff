"""Replays a trace against a live control plane through the Python client, closed-loop, on
a compressed wall clock: the stand-in for a gateway in the demo.

Each session's first request arrives at ``start_s / compression`` wall seconds after the
start; each later one ``gap_s / compression`` after the previous response ended. The start
times come from the trace: for a trace without a shared clock they are drawn by the seeded
arrival process of :mod:`kvprefetch.controlplane.traces.arrivals` when it is loaded, so the arrival
seed is the ``seed`` given to :func:`~kvprefetch.controlplane.traces.load_trace`; the replay itself
draws nothing. Per request: ``client.route`` -> the chosen node's engine serves it
(``serve(node, request)``, blocking) -> ``client.request_finished``. Records are on the
service clock.

Client hints (``hints``, planned by :func:`kvprefetch.controlplane.sim.hints.plan_hints` on the same
trace): a hint for request ``turn`` is sent through ``client.hint`` ``after_finish_s /
compression`` wall seconds after the response before that request ended, as the gateway
would. A session's next request waits until its earlier hints were answered, so the service
sees them in the order the client sent them. Hints still due when the last request is done
(abandoned ones after a session's last response) are not sent.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvprefetch.agents.engine_emulator import ServeRequest, ServeResult
from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.live.client import Client
from kvprefetch.controlplane.sim.hints import PlannedHint, hints_by_turn
from kvprefetch.controlplane.sim.simulator import RequestRecord

log = logging.getLogger(__name__)

Serve = Callable[[int, ServeRequest], ServeResult]

#: The API's bound on a hint's ETA (seconds); a noisy planned ETA is clipped to it.
_MAX_ETA_S = 86_400.0


@dataclass
class ReplayResult:
    records: list[RequestRecord] = field(default_factory=list)
    results: list[ServeResult] = field(default_factory=list)
    unrouted: int = 0
    failed: int = 0
    wall_s: float = 0.0
    #: Hints the service accepted, and those it did not (timed out or failed).
    hints_sent: int = 0
    hints_failed: int = 0


@dataclass(frozen=True, slots=True)
class _Arrival:
    session: TraceSession
    request: TraceRequest


@dataclass(frozen=True, slots=True)
class _HintDue:
    session: TraceSession
    hint: PlannedHint


class Replayer:
    def __init__(self, trace: Trace, client: Client, serve: Serve, *, compression: float,
                 nodes: int, workers: int = 64,
                 progress: Callable[[int], None] | None = None,
                 stop: threading.Event | None = None,
                 hints: Sequence[PlannedHint] = ()) -> None:
        self.trace = trace
        self.client = client
        self.serve = serve
        self.compression = compression
        self.nodes = nodes
        self.workers = workers
        self.progress = progress
        self.stop = stop or threading.Event()
        self._hints = hints_by_turn(hints)
        self._heap: list[tuple[float, int, _Arrival | _HintDue]] = []
        self._seq = 0
        self._cv = threading.Condition()
        self._outstanding = 0
        self._out = ReplayResult()
        self._t0 = 0.0
        #: Hints submitted but maybe not yet answered, per session (dispatcher thread only).
        self._hints_in_flight: dict[str, list[Future[None]]] = {}

    def _push(self, at_wall: float, item: _Arrival | _HintDue) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (at_wall, self._seq, item))
            self._cv.notify_all()

    def run(self) -> ReplayResult:
        self._t0 = time.time()
        for s in self.trace.sessions:
            if s.requests:
                self._push(self._t0 + s.start_s / self.compression, _Arrival(s, s.requests[0]))
                self._outstanding += len(s.requests)
        with ThreadPoolExecutor(self.workers, thread_name_prefix="replay") as pool:
            while not self.stop.is_set():
                with self._cv:
                    if self._outstanding <= 0:
                        break
                    if not self._heap:
                        self._cv.wait(0.1)
                        continue
                    at = self._heap[0][0]
                    delay = at - time.time()
                    if delay > 0:
                        self._cv.wait(min(delay, 0.1))
                        continue
                    _, _, item = heapq.heappop(self._heap)
                self._dispatch(pool, item, at)
        self._out.wall_s = time.time() - self._t0
        return self._out

    def _dispatch(self, pool: ThreadPoolExecutor, item: _Arrival | _HintDue, at: float) -> None:
        sid = item.session.session_id
        if isinstance(item, _HintDue):
            self._hints_in_flight.setdefault(sid, []).append(pool.submit(self._send_hint, item))
            return
        earlier = self._hints_in_flight.pop(sid, [])
        pool.submit(self._one, item.session, item.request, at, earlier)

    def _send_hint(self, item: _HintDue) -> None:
        h = item.hint
        eta = min(h.eta_s, _MAX_ETA_S) if h.eta_s is not None else None
        try:
            ack = self.client.hint(item.session.session_id, api.Hint(kind=h.kind.value,
                                                                      eta_s=eta),
                                   tenant=item.session.tenant)
            accepted = ack.accepted
        except Exception:
            log.exception("hint for %s/%d failed", item.session.session_id, h.turn)
            accepted = False
        with self._cv:
            if accepted:
                self._out.hints_sent += 1
            else:
                self._out.hints_failed += 1

    def _done(self, n: int = 1) -> None:
        with self._cv:
            self._outstanding -= n
            self._cv.notify_all()
        if self.progress is not None:
            self.progress(n)

    def _one(self, session: TraceSession, req: TraceRequest, arrival_wall: float,
             earlier_hints: Sequence[Future[None]] = ()) -> None:
        for f in earlier_hints:  # _send_hint catches its own errors
            f.result()
        try:
            self._serve_one(session, req, arrival_wall)
        except Exception:
            log.exception("replay of %s/%d failed", session.session_id, req.turn)
            with self._cv:
                self._out.failed += 1
            # the rest of the session cannot run without this turn's context
            self._done(len(session.requests) - req.turn)
            return

    def _serve_one(self, session: TraceSession, req: TraceRequest, arrival_wall: float) -> None:
        sid = session.session_id
        answer = self.client.route(sid, input_tokens=req.input_tokens,
                                   reused_tokens=req.reused_tokens, tenant=session.tenant)
        node = answer.node
        if node is None:  # no advice: any node, without prefetch
            with self._cv:
                self._out.unrouted += 1
            node = hash(sid) % self.nodes
        prev = session.requests[req.turn - 1] if req.turn > 0 else None
        stored = prev.context_tokens_after if prev is not None else None
        res = self.serve(node, ServeRequest(session.tenant, sid, req.turn, req.input_tokens,
                                            req.reused_tokens, req.output_tokens,
                                            arrival_wall, stored_context_tokens=stored))
        self.client.request_finished(sid, node=node, input_tokens=req.input_tokens,
                                     output_tokens=req.output_tokens,
                                     stop_reason=req.stop_reason, tenant=session.tenant)
        c, t0 = self.compression, self._t0
        record = RequestRecord(
            sid, req.turn, node, (res.arrival_wall_s - t0) * c, (res.start_wall_s - t0) * c,
            (res.kv_ready_wall_s - t0) * c, (res.first_token_wall_s - t0) * c,
            req.reused_tokens > 0, res.stall_wall_s * c, req.reused_tokens, res.local_tokens)
        with self._cv:
            self._out.records.append(record)
            self._out.results.append(res)
            if res.error:
                self._out.failed += 1
        self._turn_done(session, req.turn, time.time())

    def _turn_done(self, session: TraceSession, turn: int, finished: float) -> None:
        """Turn ``turn`` of ``session`` ended at wall time ``finished``: queue the hints of
        the gap after it and the next turn's arrival, and count the turn done."""
        nxt, c = turn + 1, self.compression
        # Hints first: one due at the same instant as the request is dispatched before it.
        for h in self._hints.get((session.session_id, nxt), ()):
            self._push(finished + h.after_finish_s / c, _HintDue(session, h))
        if nxt < len(session.requests):
            gap = session.requests[nxt].gap_s or 0.0
            self._push(finished + gap / c, _Arrival(session, session.requests[nxt]))
        self._done()
