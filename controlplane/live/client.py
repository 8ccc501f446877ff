"""The gateway's Python API: :class:`Client` and its transports
(:func:`kvprefetch.controlplane.live.connect.connect` builds one from an address).

Every call is validated here (pydantic, :mod:`kvprefetch.controlplane.base.api`) before it leaves
the process, carries a tenant, and waits at most ``timeout_s``: a ``route`` that times out or
cannot reach the scheduler answers :meth:`RouteAnswer.no_prefetch` (``node`` None: run the
request anywhere, without prefetch), and an event (``request_started``,
``request_finished``, ``hint``, ``session_closed``) answers ``Ack(accepted=False)``
(``timed_out`` True when it timed out), counted in :attr:`Client.dropped`; none of them
raises then, so the inference path is never held up for long nor broken. "Cannot reach"
includes a 5xx answer (the scheduler failed the call, or a proxy before it found none) and
an answer that is not the scheduler's (not its JSON); an event of a session the scheduler
does not hold (the route that opens it did not reach it, or a restart lost it) is dropped
the same way. ``request_finished`` takes the route answer's ``node``
as it is, None included (see :class:`~kvprefetch.controlplane.base.api.RequestFinished`).

Every route carries a request id (one the caller gives, else a fresh one,
:class:`RequestIds`), which its answer repeats, a timed-out one too: with it the caller
sends the route again (``route(..., request_id=...)``: the scheduler answers the first
answer and applies nothing twice, also across its restarts) or cancels it
(:meth:`Client.cancel_route`). The service's other refusals come back as typed errors
(:class:`~kvprefetch.controlplane.base.errors.UnknownSessionError` from ``session_state``,
:class:`~kvprefetch.controlplane.base.errors.WrongTenantError`,
:class:`~kvprefetch.controlplane.base.errors.MalformedHintError`, ...).

``tenant``: the tenant the calls are made for. Over HTTP with a tenant's own token leave it
out (the token says whose calls they are; naming another tenant is refused); with the
admin or the shared token, or elsewhere, it names the tenant (default ``"default"``).

A client holds a :class:`~kvprefetch.controlplane.live.protocol.GatewayAPI`: ``address="inproc"``
with ``service=`` (a :class:`~kvprefetch.controlplane.live.service.SchedulerService` in this
process: tests, embedding; its calls run on a small thread pool so that the timeout holds there
too), a :class:`RayTransport` for a Ray address (``"auto"``, ``"ray://host:10001"``,
``"127.0.0.2:6379"``: the named scheduler actor), or an :class:`HttpTransport` for an HTTP URL
(``http://host:8000``, the FastAPI app of :mod:`kvprefetch.controlplane.live.http_api`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import (
    InvalidRequestError,
    KvPrefetchError,
    MalformedHintError,
    RequestIdConflictError,
    ServiceError,
    ServiceUnavailableError,
    UnauthorizedError,
    UnknownSessionError,
    WrongTenantError,
)
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    HbmReport,
    TierEvictions,
    TransferReport,
)
from kvprefetch.controlplane.live.batching import EventBatcher, EventBatching
from kvprefetch.controlplane.live.node_registry import NodeListing, NodeRegistryAPI
from kvprefetch.controlplane.live.packing import pack, unpack
from kvprefetch.controlplane.live.protocol import GatewayAPI, RemoteAPI, SchedulerAPI
from kvprefetch.controlplane.live.routes.claims import ClaimHolder
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionState
from kvprefetch.controlplane.live.tenants import TenantQuotaError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
#: Seconds between attempts at a call while a Ray scheduler actor restarts.
RETRY_PAUSE_S = 0.05
#: Threads of an in-process transport: calls waiting on the service's lock at once.
INPROC_WORKERS = 8

_Call = TypeVar("_Call", bound=BaseModel)
_Model = TypeVar("_Model", bound=BaseModel)
_T = TypeVar("_T")


class _Timed(Protocol):
    timeout_s: float


_Transport = TypeVar("_Transport", bound=_Timed)


def with_timeout(transport: _Transport, timeout_s: float) -> _Transport:
    """``transport`` with its calls bounded by ``timeout_s``: itself when that is already
    its timeout (a client asks for a view on every call), else a shallow copy, which shares
    its connection."""
    if timeout_s == transport.timeout_s:
        return transport
    view = copy.copy(transport)
    view.timeout_s = timeout_s
    return view


class RayTransport:
    """:class:`~kvprefetch.controlplane.live.protocol.SchedulerAPI` over the named scheduler actor:
    each call waits for the actor's answer at most ``timeout_s``; Ray's errors are
    translated here (the service's typed errors are raised as they are). With
    ``batching`` the fire-and-forget events are queued (:class:`EventBatcher`): their
    calls answer ``Ack(accepted=True)`` at once, and a refusal is counted in
    ``batcher.stats`` and logged. The calls made per request and the route answers cross
    as tuples (:mod:`kvprefetch.controlplane.live.packing`)."""

    def __init__(self, address: str, namespace: str, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 batching: EventBatching | None = None, shard: int = 0) -> None:
        import ray

        from kvprefetch.controlplane.base.actors import scheduler_name

        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        try:
            self._handle = ray.get_actor(scheduler_name(shard), namespace=namespace)
        except ValueError as exc:
            raise ServiceUnavailableError(
                f"no kvprefetch scheduler (shard {shard}) in Ray namespace {namespace!r} "
                f"at {address!r}: start one with `kvprefetch serve`") from exc
        self.shard = shard
        self.timeout_s = timeout_s
        self.batcher: EventBatcher | None = (
            None if batching is None else EventBatcher(self._handle, batching, self._get))
        #: The route coalescer of each event loop that routes through this transport
        #: (shared by its timeout views; a loop's entry goes with the loop).
        self._coalescers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                                    _RouteCoalescer] = (
            weakref.WeakKeyDictionary())
        #: What the coalescers sent: ``calls`` actor calls carrying ``routes`` routes.
        self.coalesced = Coalesced()

    def with_timeout(self, timeout_s: float) -> RayTransport:
        return with_timeout(self, timeout_s)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()

    def _queued(self, kind: str, call: Any) -> bool:
        if self.batcher is None:
            return False
        self.batcher.submit(kind, pack(call))
        return True

    def _get(self, op: str, ref: Any) -> Any:
        """The answer behind ``ref`` (the actor call ``op``, named for errors)."""
        import ray
        from ray.exceptions import (
            ActorUnavailableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError as exc:
            raise TimeoutError(f"{op} timed out after {self.timeout_s} s") from exc
        except (RayTaskError, RayActorError, ActorUnavailableError) as exc:
            raise _ray_error(op, exc) from exc

    async def _aget(self, op: str, ref: Any) -> Any:
        """:meth:`_get` without blocking the event loop: the reference is awaited."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"{op} timed out after {self.timeout_s} s") from exc
        except (RayTaskError, RayActorError, ActorUnavailableError) as exc:
            raise _ray_error(op, exc) from exc

    async def acall(self, op: str, call: Any) -> Any:
        """The gateway call ``op`` (a :class:`~kvprefetch.controlplane.live.protocol.GatewayAPI`
        method name) as a coroutine: the same answers and errors as the method, the actor's
        answer awaited (the event loop is free meanwhile). A queued event answers at once;
        a route carries the queued events ahead of it in its actor call."""
        if op in _EVENTS and self._queued(op, call):
            return api.ACCEPTED
        if op == "route":
            return await self._aretried(op, lambda: self._aroute_once(call))
        if op == "cancel_route":
            if self.batcher is not None:
                self.batcher.flush()
            return await self._aretried(op, lambda: self._aget(
                op, self._handle.cancel_route.remote(call)))
        if op not in _GATEWAY_OPS:
            raise ValueError(f"not a gateway call: {op!r}")
        return await self._aget(op, getattr(self._handle, op).remote(call))

    async def _aroute_once(self, call: api.RouteQuery) -> api.RouteAnswer:
        """The route through this event loop's :class:`_RouteCoalescer`: alone when no
        route of this loop is unanswered, else in one actor call with the routes that
        arrived meanwhile."""
        loop = asyncio.get_running_loop()
        coalescer = self._coalescers.get(loop)
        if coalescer is None:
            coalescer = self._coalescers[loop] = _RouteCoalescer(self)
        future = coalescer.submit(pack(call))
        try:
            # On a timeout (or a cancel) the future is cancelled: its answer is dropped.
            answer = await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"route timed out after {self.timeout_s} s") from exc
        if isinstance(answer, ServiceError):
            raise answer
        return unpack(api.RouteAnswer, answer)

    def send_routes_packed(self, packed: list[Any]) -> tuple[Any, list[tuple[str, Any]]]:
        """Packed routes (and the queued events, ahead of them) in one actor call: the
        reference and the events it carried."""
        if self.batcher is None:
            return self._handle.route_many_after.remote([], packed), []
        return self.batcher.send_with(
            lambda events: self._handle.route_many_after.remote(events, packed))

    async def _aretried(self, op: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """:meth:`_retried` as a coroutine (the pauses do not block the event loop)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return await call()
            except ServiceUnavailableError:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise
                log.info("%s: scheduler shard %d unavailable; retrying", op, self.shard)
                await asyncio.sleep(RETRY_PAUSE_S)

    # ------------------------------------------------------------------ gateway calls
    def request_started(self, call: api.RequestStarted) -> api.Ack:
        if self._queued("request_started", call):
            return api.ACCEPTED
        answer: api.Ack = self._get("request_started",
                                    self._handle.request_started.remote(call))
        return answer

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        answer: api.RouteAnswer = self._retried("route", lambda: self._route_once(call))
        return answer

    def _route_once(self, call: api.RouteQuery) -> api.RouteAnswer:
        if self.batcher is None:
            answer: api.RouteAnswer = self._get("route", self._handle.route.remote(call))
            return answer
        # The queued events go first, in the same call. If it times out they were sent
        # all the same (the actor applies them); a refusal is counted.
        packed = pack(call)
        sent: tuple[Any, list[tuple[str, Any]]] = self.batcher.send_with(
            lambda events: self._handle.route_after.remote(events, packed))
        ref, events = sent
        try:
            refused, answer = self._get("route", ref)
        except ServiceUnavailableError:
            self.batcher.put_back(events)  # the actor died: they go again, first
            raise
        self.batcher.settle_refusals(refused)
        return unpack(api.RouteAnswer, answer)

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        """The queued events go first (Ray runs one caller's calls in order); repeated
        while the actor restarts, as a cancel is idempotent."""
        if self.batcher is not None:
            self.batcher.flush()
        answer: api.RouteCancelled = self._retried("cancel_route", lambda: self._get(
            "cancel_route", self._handle.cancel_route.remote(call)))
        return answer

    def _retried(self, op: str, call: Callable[[], _T]) -> _T:
        """``call`` again while the actor is unavailable (Ray is restarting it; the calls
        sent meanwhile wait for the new incarnation), until ``timeout_s`` has passed. A
        route is safe to repeat: with its request id the scheduler answers the first
        answer, and without one it routes the same request again."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return call()
            except ServiceUnavailableError:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise
                log.info("%s: scheduler shard %d unavailable; retrying", op, self.shard)
                time.sleep(RETRY_PAUSE_S)

    def send_routes(self, calls: Sequence[api.RouteQuery]) -> tuple[Any, list[tuple[str, Any]]]:
        """Send ``calls`` (and the queued events, ahead of them) in one actor call; the
        reference and the events it carried, for :meth:`routes_answered`."""
        packed = [pack(call) for call in calls]
        if self.batcher is None:
            return self._handle.route_many_after.remote([], packed), []
        return self.batcher.send_with(
            lambda events: self._handle.route_many_after.remote(events, packed))

    def routes_answered(self, sent: tuple[Any, list[tuple[str, Any]]]
                        ) -> list[api.RouteAnswer | ServiceError]:
        """The answers to :meth:`send_routes`, one per call (a refused one is its error)."""
        ref, events = sent
        try:
            refused, answers = self._get("route_many", ref)
        except ServiceUnavailableError:
            if self.batcher is not None:
                self.batcher.put_back(events)
            raise
        if self.batcher is not None:
            self.batcher.settle_refusals(refused)
        return [unpack(api.RouteAnswer, a) for a in answers]

    def route_many(self, calls: Sequence[api.RouteQuery]
                   ) -> list[api.RouteAnswer | ServiceError]:
        """Route several requests (of any sessions) in one actor call, in order: a gateway
        with many requests arriving at once pays one round trip, not one each."""
        return self._retried("route_many",
                             lambda: self.routes_answered(self.send_routes(calls)))

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        if self._queued("request_finished", call):
            return api.ACCEPTED
        answer: api.Ack = self._get("request_finished",
                                    self._handle.request_finished.remote(call))
        return answer

    def hint(self, call: api.HintCall) -> api.Ack:
        if self._queued("hint", call):
            return api.ACCEPTED
        answer: api.Ack = self._get("hint", self._handle.hint.remote(call))
        return answer

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        if self._queued("session_closed", call):
            return api.ACCEPTED
        answer: api.Ack = self._get("session_closed", self._handle.session_closed.remote(call))
        return answer

    # ------------------------------------------------------------------ engine calls
    def gpu_start(self, node: int, tenant: str, session_id: str,
                  reused_tokens: int) -> GpuStartPlan:
        plan: GpuStartPlan = self._get("gpu_start", self._handle.gpu_start.remote(
            node, tenant, session_id, reused_tokens))
        return plan

    def use_local(self, node: int, tenant: str, session_id: str, reused_tokens: int,
                  done: TransferReport | None = None) -> int:
        return int(self._get("use_local", self._handle.use_local.remote(
            node, tenant, session_id, reused_tokens, done)))

    def engine_report(self, report: EngineReport) -> None:
        if not self._queued("engine_report", report):
            self._get("engine_report", self._handle.engine_report.remote(report))

    # ------------------------------------------------------------------ agent calls
    def agent_hello(self, hello: AgentHello) -> None:
        self._get("agent_hello", self._handle.agent_hello.remote(hello))

    def report_transfer(self, report: TransferReport) -> None:
        if not self._queued("report_transfer", report):
            self._get("report_transfer", self._handle.report_transfer.remote(report))

    def node_status(self, status: AgentStatus) -> None:
        self._get("node_status", self._handle.node_status.remote(status))

    def tier_evicted(self, evictions: TierEvictions) -> None:
        self._get("tier_evicted", self._handle.tier_evicted.remote(evictions))

    def hbm_changed(self, report: HbmReport) -> None:
        self._get("hbm_changed", self._handle.hbm_changed.remote(report))

    # ------------------------------------------------------------------ introspection
    def shard_info(self) -> tuple[int, int]:
        """(the shard this transport calls, how many the deployment runs)."""
        shard, shards = self._get("shard_info", self._handle.shard_info.remote())
        return int(shard), int(shards)

    def summary(self) -> dict[str, Any]:
        return dict(self._get("summary", self._handle.summary.remote()))

    def sessions(self) -> int:
        return int(self._get("sessions", self._handle.sessions.remote()))

    def has_session(self, tenant: str, session_id: str) -> bool:
        return bool(self._get("has_session", self._handle.has_session.remote(tenant,
                                                                              session_id)))

    def claim_request_id(self, tenant: str, request_id: str, session_id: str,
                         replacing: str | None = None) -> ClaimHolder | None:
        """The shard's :meth:`SchedulerService.claim_request_id`."""
        holder: ClaimHolder | None = self._get("claim_request_id",
                                               self._handle.claim_request_id.remote(
                                                   tenant, request_id, session_id, replacing))
        return holder

    def remembers_route(self, tenant: str, request_id: str, session_id: str) -> bool:
        return bool(self._get("remembers_route", self._handle.remembers_route.remote(
            tenant, request_id, session_id)))

    def nodes(self) -> NodeListing:
        listing: NodeListing = self._get("nodes", self._handle.nodes.remote())
        return listing

    def session_state(self, call: SessionQuery) -> SessionState:
        state: SessionState = self._get("session_state",
                                        self._handle.session_state.remote(call))
        return state


#: Routes of one event loop in one actor call at most.
MAX_COALESCED_ROUTES = 256
#: Actor calls of one event loop's routes unanswered at once: the next batch is on its
#: way while the actor works on one (the actor still runs them in order).
ROUTE_CALLS_IN_FLIGHT = 2


@dataclass(slots=True)
class Coalesced:
    """Async routes sent by a :class:`RayTransport` (cumulative): ``calls`` actor calls
    carried ``routes`` routes."""

    calls: int = 0
    routes: int = 0


class _RouteCoalescer:
    """The async routes of one event loop to one scheduler actor: a route leaves at once
    while fewer than :data:`ROUTE_CALLS_IN_FLIGHT` of this loop's actor calls are
    unanswered; otherwise it waits for one to answer and leaves with every route that
    arrived meanwhile, in one ``route_many_after`` call (the queued events ahead of
    them). A lone route pays one actor call, and many callers share one call instead of
    queueing one each behind the actor. Routes keep the order they were submitted in (Ray
    runs one caller's calls in order); each answer is the packed answer or its typed
    error."""

    def __init__(self, transport: RayTransport) -> None:
        self._transport = transport
        self._pending: list[tuple[Any, asyncio.Future[Any]]] = []
        self._in_flight = 0

    def submit(self, packed: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((packed, future))
        if self._in_flight < ROUTE_CALLS_IN_FLIGHT:
            self._launch()
        return future

    def _launch(self) -> None:
        batch = self._pending[:MAX_COALESCED_ROUTES]
        del self._pending[:MAX_COALESCED_ROUTES]
        batch = [(p, f) for p, f in batch if not f.done()]  # gone: timed out, cancelled
        if not batch:
            return
        self._in_flight += 1
        try:
            sent = self._transport.send_routes_packed([p for p, _ in batch])
        except Exception as exc:
            self._in_flight -= 1
            for _, future in batch:
                future.set_exception(exc)
            return
        self._transport.coalesced.calls += 1
        self._transport.coalesced.routes += len(batch)
        task = asyncio.ensure_future(self._settle(sent, batch))
        task.add_done_callback(self._next)

    def _next(self, _: asyncio.Future[Any]) -> None:
        self._in_flight -= 1
        if self._pending:
            self._launch()

    async def _settle(self, sent: tuple[Any, list[tuple[str, Any]]],
                      batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        transport = self._transport
        ref, events = sent
        try:
            refused, answers = await transport._aget("route", ref)
        except Exception as exc:
            if isinstance(exc, ServiceUnavailableError) and transport.batcher is not None:
                transport.batcher.put_back(events)  # the actor died: they go again, first
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        if transport.batcher is not None:
            transport.batcher.settle_refusals(refused)
        for (_, future), answer in zip(batch, answers, strict=True):
            if not future.done():
                future.set_result(answer)


def route_each(route: Callable[[api.RouteQuery], api.RouteAnswer],
               calls: Sequence[api.RouteQuery]) -> list[api.RouteAnswer | ServiceError]:
    """``route_many`` of a transport without a batched call: one call each, in order (a
    refusal is that call's answer; a timeout is raised)."""
    answers: list[api.RouteAnswer | ServiceError] = []
    for call in calls:
        try:
            answers.append(route(call))
        except ServiceError as exc:
            answers.append(exc)
    return answers


#: What an event call answers ``accepted=False`` instead of raising (:meth:`Client._ack`).
_DROPPED = (TimeoutError, ServiceUnavailableError, UnknownSessionError)
#: The fire-and-forget gateway calls (queued by a batching transport).
_EVENTS = frozenset({"request_started", "request_finished", "hint", "session_closed"})
#: Every gateway call, the name of its method on each transport.
_GATEWAY_OPS = _EVENTS | {"route", "cancel_route", "session_state"}
#: Gateway call -> the model of its answer.
_ANSWERS: dict[str, type[BaseModel]] = {
    "route": api.RouteAnswer, "cancel_route": api.RouteCancelled,
    "request_started": api.Ack, "request_finished": api.Ack, "hint": api.Ack,
    "session_closed": api.Ack, "session_state": SessionState,
}


@contextlib.contextmanager
def _http_errors(op: str, timeout_s: float) -> Iterator[None]:
    """httpx's errors of the call ``op`` as the client's: TimeoutError past ``timeout_s``,
    ServiceUnavailableError when the API cannot be reached."""
    import httpx

    try:
        yield
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"{op} timed out after {timeout_s} s") from exc
    except httpx.HTTPError as exc:
        raise ServiceUnavailableError(f"scheduler HTTP API unreachable: {exc}") from exc


def _answer(op: str, resp: Any, model: type[_Model]) -> _Model:
    """The answer as ``model``, or the typed error of its status. An answer that is not
    the scheduler's (not JSON, or not ``model``: a proxy's page, another service on the
    port) is ServiceUnavailableError, as the scheduler is not what answered."""
    if resp.status_code >= 400:
        raise _http_error(op, resp.status_code, resp.text)
    try:
        return model.model_validate_json(resp.content)
    except ValueError:  # pydantic's ValidationError is one
        raise ServiceUnavailableError(
            f"{op}: the HTTP {resp.status_code} answer is not the scheduler's: "
            f"{resp.text[:120]!r}") from None


def _ray_error(op: str, exc: Exception) -> Exception:
    """What a Ray error of the actor call ``op`` is raised as: the scheduler's own typed
    error, a ServiceError, or ServiceUnavailableError when the actor is gone."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError):
        cause = exc.cause if isinstance(exc.cause, KvPrefetchError) else None
        if cause is not None:
            return cause
        return ServiceError(f"{op} failed in the scheduler: {exc}")
    return ServiceUnavailableError(f"scheduler unavailable: {exc}")


class InProcessTransport:
    """:class:`~kvprefetch.controlplane.live.protocol.RemoteAPI` over a scheduler in this process:
    each call runs on a small shared thread pool and is waited for at most ``timeout_s``
    (then ``TimeoutError``; a call still queued is cancelled, one already running
    completes later, as a remote call that timed out may). Without it a caller would wait
    as long as the service's lock is held. The service is not closed with the transport."""

    def __init__(self, scheduler: GatewayAPI, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 workers: int = INPROC_WORKERS) -> None:
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvprefetch-inproc")

    def with_timeout(self, timeout_s: float) -> InProcessTransport:
        return with_timeout(self, timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _wait(self, op: str, call: Callable[[], Any]) -> Any:
        future: Future[Any] = self._pool.submit(call)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"{op} timed out after {self.timeout_s} s") from None

    async def acall(self, op: str, call: Any) -> Any:
        """The gateway call ``op`` as a coroutine, on the same pool and timeout."""
        if op not in _GATEWAY_OPS:
            raise ValueError(f"not a gateway call: {op!r}")
        future: Future[Any] = self._pool.submit(getattr(self.scheduler, op), call)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{op} timed out after {self.timeout_s} s") from None

    def request_started(self, call: api.RequestStarted) -> api.Ack:
        answer: api.Ack = self._wait("request_started",
                                     lambda: self.scheduler.request_started(call))
        return answer

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        answer: api.RouteAnswer = self._wait("route", lambda: self.scheduler.route(call))
        return answer

    def route_many(self, calls: Sequence[api.RouteQuery]
                   ) -> list[api.RouteAnswer | ServiceError]:
        return route_each(self.route, calls)

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        answer: api.RouteCancelled = self._wait("cancel_route",
                                                lambda: self.scheduler.cancel_route(call))
        return answer

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        answer: api.Ack = self._wait("request_finished",
                                     lambda: self.scheduler.request_finished(call))
        return answer

    def hint(self, call: api.HintCall) -> api.Ack:
        answer: api.Ack = self._wait("hint", lambda: self.scheduler.hint(call))
        return answer

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        answer: api.Ack = self._wait("session_closed",
                                     lambda: self.scheduler.session_closed(call))
        return answer

    def nodes(self) -> NodeListing:
        scheduler = self.scheduler
        if not isinstance(scheduler, NodeRegistryAPI):
            raise ServiceUnavailableError("this scheduler keeps no node registry")
        listing: NodeListing = self._wait("nodes", scheduler.nodes)
        return listing

    def session_state(self, call: SessionQuery) -> SessionState:
        state: SessionState = self._wait("session_state",
                                         lambda: self.scheduler.session_state(call))
        return state


_STATUS_ERRORS: dict[int, type[ServiceError]] = {
    401: UnauthorizedError,
    403: WrongTenantError,
    404: UnknownSessionError,
    409: RequestIdConflictError,
    413: InvalidRequestError,
    422: InvalidRequestError,
    429: TenantQuotaError,
    503: ServiceUnavailableError,
}
#: The typed errors the HTTP API names in its answers' ``error`` field.
_NAMED_ERRORS: dict[str, type[ServiceError]] = {
    cls.__name__: cls for cls in (*_STATUS_ERRORS.values(), MalformedHintError, ServiceError)
}


class HttpTransport:
    """:class:`~kvprefetch.controlplane.live.protocol.GatewayAPI` over the HTTP API (``POST
    /v1/<call>``), with an optional bearer token; each call waits at most ``timeout_s``.
    Its error answers (``{"error": <type>, "detail": <message>}``) are raised as the typed
    error they name, or by status."""

    def __init__(self, base_url: str, token: str | None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._base_url = base_url.rstrip("/")
        self._headers = {**headers, "Content-Type": "application/json"}
        self._client = httpx.Client(base_url=self._base_url, headers=headers)
        #: The connections of :meth:`acall`, made on its first call (one event loop).
        self._async: list[Any] = []
        self.timeout_s = timeout_s

    def with_timeout(self, timeout_s: float) -> HttpTransport:
        return with_timeout(self, timeout_s)

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        """Close the connections of :meth:`acall` (from the event loop that used them)."""
        while self._async:
            await self._async.pop().aclose()

    async def acall(self, op: str, call: Any) -> Any:
        """The gateway call ``op`` as a coroutine over persistent connections of their
        own (an ``httpx.AsyncClient``, bound to the event loop of the first call): the
        same answers and errors as the method. The whole call is bounded by ``timeout_s``
        (httpx bounds each phase, connect, write and every read, separately)."""
        import httpx

        if op not in _GATEWAY_OPS:
            raise ValueError(f"not a gateway call: {op!r}")
        if not self._async:
            self._async.append(httpx.AsyncClient(base_url=self._base_url,
                                                 headers=self._headers))
        with _http_errors(op, self.timeout_s):
            try:
                resp = await asyncio.wait_for(self._async[0].post(
                    f"/v1/{op}", content=call.model_dump_json(exclude_none=True,
                                                              exclude_unset=True),
                    timeout=self.timeout_s), self.timeout_s)
            except TimeoutError as exc:
                raise TimeoutError(f"{op} timed out after {self.timeout_s} s") from exc
        return _answer(op, resp, _ANSWERS[op])

    def _post(self, path: str, payload: BaseModel, model: type[_Model]) -> _Model:
        """POST ``payload`` to ``/v1/<path>``; the answer as ``model``. Fields the caller did
        not set stay out (a tenant left out is the token's)."""
        with _http_errors(path, self.timeout_s):
            resp = self._client.post(f"/v1/{path}",
                                     content=payload.model_dump_json(exclude_none=True,
                                                                     exclude_unset=True),
                                     headers={"Content-Type": "application/json"},
                                     timeout=self.timeout_s)
        return _answer(path, resp, model)

    def request_started(self, call: api.RequestStarted) -> api.Ack:
        return self._post("request_started", call, api.Ack)

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        return self._post("route", call, api.RouteAnswer)

    def route_many(self, calls: Sequence[api.RouteQuery]
                   ) -> list[api.RouteAnswer | ServiceError]:
        return route_each(self.route, calls)

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        return self._post("cancel_route", call, api.RouteCancelled)

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        return self._post("request_finished", call, api.Ack)

    def hint(self, call: api.HintCall) -> api.Ack:
        return self._post("hint", call, api.Ack)

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        return self._post("session_closed", call, api.Ack)

    def session_state(self, call: SessionQuery) -> SessionState:
        return self._post("session_state", call, SessionState)

    def nodes(self) -> NodeListing:
        """``GET /nodes``."""
        with _http_errors("nodes", self.timeout_s):
            resp = self._client.get("/nodes", timeout=self.timeout_s)
        return _answer("nodes", resp, NodeListing)


def _http_error(path: str, status: int, text: str) -> ServiceError:
    """The typed error of an error answer: the one its ``error`` field names, else its
    status's. Any 5xx (the scheduler failed the call, or a proxy before it found no
    scheduler: 502, 504) is ServiceUnavailableError: a route answers without prefetch and
    an event is dropped, as when the scheduler cannot be reached."""
    name = None
    detail: Any = text[:200]
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        name = body.get("error")
        detail = body.get("detail", text)
    cls = _NAMED_ERRORS.get(name) if isinstance(name, str) else None
    if status >= 500:
        cls = ServiceUnavailableError
    elif cls is None:
        cls = (MalformedHintError if path == "hint" and status == 422
               else _STATUS_ERRORS.get(status, ServiceError))
    return cls(f"HTTP {status}: {detail}")


#: Forks of this process so far, as seen by a child (:class:`RequestIds` redraws after one).
_forks = [0]
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


class RequestIds:
    """A client's route request ids: 32 hex digits, 16 drawn at random (from the OS, once
    per client and again in a forked child) and a counter of 16: unique per client by
    construction, and across clients as the random half is, without a system call per
    route. Thread-safe (``next`` on a count is atomic)."""

    def __init__(self) -> None:
        self._draw()

    def _draw(self) -> None:
        self._forks = _forks[0]
        self._prefix = os.urandom(8).hex()
        self._seq = itertools.count()

    def __call__(self) -> str:
        if self._forks != _forks[0]:  # a forked child would repeat its parent's ids
            self._draw()
        return f"{self._prefix}{next(self._seq):016x}"


class Client:
    """See the module docstring. Thread-safe when its API is (all three are)."""

    def __init__(self, scheduler: GatewayAPI, *, tenant: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._scheduler = scheduler
        #: What calls go through, each with its timeout (the transport, or one in process).
        self._remote: RemoteAPI = (scheduler if isinstance(scheduler, RemoteAPI)
                                   else InProcessTransport(scheduler, timeout_s=timeout_s))
        #: The tenant named in each call (None: the token's over HTTP, else "default").
        self.tenant = tenant
        self.timeout_s = timeout_s
        #: Calls that waited out their timeout (routes answered without prefetch, events
        #: dropped).
        self.timeouts = 0
        #: Events the scheduler did not take (timed out, unreachable): answered
        #: ``accepted=False`` and not sent again.
        self.dropped = 0
        self._request_ids = RequestIds()

    @property
    def scheduler(self) -> GatewayAPI:
        """The scheduler this client calls, or the transport to it (the HTTP API of
        ``kvprefetch serve`` fronts it)."""
        return self._scheduler

    def close(self) -> None:
        """Close the transport (a service in this process is left running)."""
        self._remote.close()

    async def aclose(self) -> None:
        """:meth:`close`, and the async connections of the coroutine calls (from the event
        loop that made them)."""
        aclose = getattr(self._remote, "aclose", None)
        if aclose is not None:
            await aclose()
        self.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _bounded(self, timeout_s: float | None) -> RemoteAPI:
        """The API with this call's timeout."""
        return self._remote.with_timeout(timeout_s or self.timeout_s)

    def _fields(self, session_id: str, tenant: str | None, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"session_id": session_id}
        if tenant or self.tenant:
            out["tenant"] = tenant or self.tenant
        out.update({k: v for k, v in kw.items() if v is not None})
        return out

    def _ack(self, op: str, send: Callable[[_Call], api.Ack], payload: _Call) -> api.Ack:
        """Send an event; one the scheduler does not take in time, cannot take as it is
        unreachable, or does not know the session of (its first route did not reach it,
        or it lost the session in a restart) is dropped: logged, counted in
        :attr:`dropped` and answered ``accepted=False``, never raised."""
        try:
            return send(payload)
        except _DROPPED as exc:
            return self._dropped(op, exc)

    def _dropped(self, op: str, exc: Exception) -> api.Ack:
        timed_out = isinstance(exc, TimeoutError)
        self.timeouts += timed_out
        self.dropped += 1
        log.warning("%s: %s; the event is dropped", op, exc)
        return api.Ack(accepted=False, timed_out=timed_out)

    async def _acall(self, op: str, payload: BaseModel, timeout_s: float | None) -> Any:
        """The call ``op`` awaited: the transport's own coroutine where it has one (Ray:
        the actor's answer awaited; HTTP: async connections), else the blocking call on a
        worker thread."""
        remote = self._bounded(timeout_s)
        acall = getattr(remote, "acall", None)
        if acall is not None:
            return await acall(op, payload)
        return await asyncio.to_thread(getattr(remote, op), payload)

    async def _aack(self, op: str, payload: BaseModel, timeout_s: float | None) -> api.Ack:
        """:meth:`_ack` awaited."""
        try:
            answer: api.Ack = await self._acall(op, payload, timeout_s)
            return answer
        except _DROPPED as exc:
            return self._dropped(op, exc)

    def _no_prefetch(self, payload: api.RouteQuery, exc: Exception) -> api.RouteAnswer:
        self.timeouts += isinstance(exc, TimeoutError)
        log.warning("route %s: %s; running without prefetch", payload.request_id, exc)
        return api.RouteAnswer.no_prefetch(timed_out=isinstance(exc, TimeoutError),
                                           request_id=payload.request_id)

    # ------------------------------------------------------------------ the API
    def route(self, session_id: str, *, input_tokens: int | None = None,
              token_ids: Sequence[int] | None = None,
              chunk_hashes: Sequence[str] | None = None, reused_tokens: int | None = None,
              parent_id: str | None = None, tenant: str | None = None,
              request_id: str | None = None, timeout_s: float | None = None
              ) -> api.RouteAnswer:
        """The node to run this request on (and ``request_started`` if not yet sent).
        ``request_id``: the id of this route (default: a new one, :class:`RequestIds`); the answer
        repeats it, also when it is ``no_prefetch`` (timed out, or the scheduler
        unreachable): send the route again with it, or cancel it
        (:meth:`cancel_route`)."""
        payload = self._route_payload(session_id, input_tokens, token_ids, chunk_hashes,
                                      reused_tokens, parent_id, tenant, request_id)
        try:
            return self._bounded(timeout_s).route(payload)
        except (TimeoutError, ServiceUnavailableError) as exc:
            return self._no_prefetch(payload, exc)

    async def route_async(self, session_id: str, *, input_tokens: int | None = None,
                          token_ids: Sequence[int] | None = None,
                          chunk_hashes: Sequence[str] | None = None,
                          reused_tokens: int | None = None, parent_id: str | None = None,
                          tenant: str | None = None, request_id: str | None = None,
                          timeout_s: float | None = None) -> api.RouteAnswer:
        """:meth:`route` as a coroutine, for event loops (a gateway): the same answers,
        the scheduler's answer awaited without a thread per call where the transport
        allows (Ray, HTTP). Cancelling it abandons the answer, not the route: the
        scheduler may still apply it (its ``request_id`` names it)."""
        payload = self._route_payload(session_id, input_tokens, token_ids, chunk_hashes,
                                      reused_tokens, parent_id, tenant, request_id)
        try:
            answer: api.RouteAnswer = await self._acall("route", payload, timeout_s)
            return answer
        except (TimeoutError, ServiceUnavailableError) as exc:
            return self._no_prefetch(payload, exc)

    def _route_payload(self, session_id: str, input_tokens: int | None,
                       token_ids: Sequence[int] | None, chunk_hashes: Sequence[str] | None,
                       reused_tokens: int | None, parent_id: str | None, tenant: str | None,
                       request_id: str | None) -> api.RouteQuery:
        return api.parse(api.RouteQuery, self._fields(
            session_id, tenant, input_tokens=input_tokens,
            token_ids=list(token_ids) if token_ids is not None else None,
            chunk_hashes=list(chunk_hashes) if chunk_hashes is not None else None,
            reused_tokens=reused_tokens, parent_id=parent_id,
            request_id=request_id or self._request_ids()))

    def cancel_route(self, session_id: str, request_id: str, *, tenant: str | None = None,
                     timeout_s: float | None = None) -> api.RouteCancelled:
        """Undo the route ``request_id`` of this session, whose request will not run (its
        answer was lost, or the caller gave up): while that request is in flight it ends
        (the session's first request closes the session, releasing its tenant's quota; a
        later one finishes as aborted, the context unchanged). Idempotent; ``outcome``
        says what it found (``unknown``: nothing applied under that id). Raises
        TimeoutError when the scheduler does not answer (send it again)."""
        payload = api.parse(api.RouteCancel, self._fields(session_id, tenant,
                                                          request_id=request_id))
        return self._bounded(timeout_s).cancel_route(payload)

    def route_many(self, requests: Sequence[dict[str, Any]], *,
                   timeout_s: float | None = None) -> list[api.RouteAnswer]:
        """Route several requests at once (a gateway with many arriving together): each
        item holds :meth:`route`'s keyword arguments (``session_id`` and the rest); the
        answers in order. Through Ray it is one actor call per shard, all shards at once.
        As with ``route``, a request that cannot be routed (refused, timed out, the
        scheduler unreachable) answers ``RouteAnswer.no_prefetch``; a refusal is logged."""
        payloads = []
        for item in requests:
            fields = dict(item)
            session_id = fields.pop("session_id")
            tenant = fields.pop("tenant", None)
            fields["request_id"] = fields.get("request_id") or self._request_ids()
            payloads.append(api.parse(api.RouteQuery, self._fields(session_id, tenant,
                                                                   **fields)))
        try:
            got = self._bounded(timeout_s).route_many(payloads)
        except (TimeoutError, ServiceUnavailableError) as exc:
            self.timeouts += isinstance(exc, TimeoutError)
            log.warning("route_many: %s; running without prefetch", exc)
            return [api.RouteAnswer.no_prefetch(timed_out=isinstance(exc, TimeoutError),
                                                request_id=payload.request_id)
                    for payload in payloads]
        answers = []
        for payload, answer in zip(payloads, got, strict=True):
            if isinstance(answer, ServiceError):
                log.warning("route of %s refused: %s", payload.session_id, answer)
                answer = api.RouteAnswer.no_prefetch(request_id=payload.request_id)
            answers.append(answer)
        return answers

    def request_started(self, session_id: str, *, input_tokens: int | None = None,
                        token_ids: Sequence[int] | None = None,
                        chunk_hashes: Sequence[str] | None = None,
                        reused_tokens: int | None = None, parent_id: str | None = None,
                        tenant: str | None = None, timeout_s: float | None = None) -> api.Ack:
        payload = api.parse(api.RequestStarted, self._fields(
            session_id, tenant, input_tokens=input_tokens,
            token_ids=list(token_ids) if token_ids is not None else None,
            chunk_hashes=list(chunk_hashes) if chunk_hashes is not None else None,
            reused_tokens=reused_tokens, parent_id=parent_id))
        return self._ack("request_started", self._bounded(timeout_s).request_started, payload)

    def request_finished(self, session_id: str, *, node: int | None, input_tokens: int,
                         output_tokens: int = 0, context_tokens: int | None = None,
                         stop_reason: str | None = None,
                         chunk_hashes: Sequence[str] | None = None, tenant: str | None = None,
                         local_tokens_read: int | None = None,
                         timeout_s: float | None = None) -> api.Ack:
        """The response ended on ``node``: the route answer's node, as it came. None (the
        route gave no advice) is a finish on no known node, which the scheduler
        acknowledges without recording it (``accepted`` False; see
        :class:`~kvprefetch.controlplane.base.api.RequestFinished`)."""
        payload = self._finished_payload(session_id, node, input_tokens, output_tokens,
                                         context_tokens, stop_reason, chunk_hashes, tenant,
                                         local_tokens_read)
        return self._ack("request_finished", self._bounded(timeout_s).request_finished,
                         payload)

    async def request_finished_async(
            self, session_id: str, *, node: int | None, input_tokens: int,
            output_tokens: int = 0, context_tokens: int | None = None,
            stop_reason: str | None = None, chunk_hashes: Sequence[str] | None = None,
            tenant: str | None = None, local_tokens_read: int | None = None,
            timeout_s: float | None = None) -> api.Ack:
        """:meth:`request_finished` as a coroutine (see :meth:`route_async`)."""
        payload = self._finished_payload(session_id, node, input_tokens, output_tokens,
                                         context_tokens, stop_reason, chunk_hashes, tenant,
                                         local_tokens_read)
        return await self._aack("request_finished", payload, timeout_s)

    def _finished_payload(self, session_id: str, node: int | None, input_tokens: int,
                          output_tokens: int, context_tokens: int | None,
                          stop_reason: str | None, chunk_hashes: Sequence[str] | None,
                          tenant: str | None, local_tokens_read: int | None
                          ) -> api.RequestFinished:
        return api.parse(api.RequestFinished, self._fields(
            session_id, tenant, node=node, input_tokens=input_tokens,
            output_tokens=output_tokens, context_tokens=context_tokens,
            stop_reason=stop_reason, local_tokens_read=local_tokens_read,
            chunk_hashes=list(chunk_hashes) if chunk_hashes is not None else None))

    def hint(self, session_id: str, hint: api.Hint | dict[str, Any] | str, *,
             eta_s: float | None = None, tenant: str | None = None,
             timeout_s: float | None = None) -> api.Ack:
        """A typed hint: ``api.Hint(kind="tool_running", eta_s=2.0)``, the same as a dict,
        or a kind name with ``eta_s``."""
        return self._ack("hint", self._bounded(timeout_s).hint,
                         self._hint_payload(session_id, hint, eta_s, tenant))

    async def hint_async(self, session_id: str, hint: api.Hint | dict[str, Any] | str, *,
                         eta_s: float | None = None, tenant: str | None = None,
                         timeout_s: float | None = None) -> api.Ack:
        """:meth:`hint` as a coroutine (see :meth:`route_async`)."""
        return await self._aack("hint", self._hint_payload(session_id, hint, eta_s, tenant),
                                timeout_s)

    def _hint_payload(self, session_id: str, hint: api.Hint | dict[str, Any] | str,
                      eta_s: float | None, tenant: str | None) -> api.HintCall:
        raw: Any = hint
        if isinstance(hint, str):
            raw = {"kind": hint, "eta_s": eta_s} if eta_s is not None else {"kind": hint}
        elif isinstance(hint, api.Hint):
            raw = hint.model_dump()
        return api.parse(api.HintCall, self._fields(session_id, tenant, hint=raw))

    def session_closed(self, session_id: str, *, tenant: str | None = None,
                       timeout_s: float | None = None) -> api.Ack:
        payload = api.parse(api.SessionClosed, self._fields(session_id, tenant))
        return self._ack("session_closed", self._bounded(timeout_s).session_closed, payload)

    def session_state(self, session_id: str, *, tenant: str | None = None,
                      timeout_s: float | None = None) -> SessionState:
        """What the scheduler holds for this session (UnknownSessionError when the tenant
        has no live session by that id). Raises TimeoutError when it does not answer."""
        try:
            payload = SessionQuery.model_validate(self._fields(session_id, tenant))
        except ValueError as exc:
            raise InvalidRequestError(f"invalid SessionQuery: {exc}") from None
        return self._bounded(timeout_s).session_state(payload)

    def nodes(self, *, timeout_s: float | None = None) -> NodeListing:
        """The scheduler's node registry: every node slot, whether it is routed to and
        its engine's URL (:mod:`~kvprefetch.controlplane.live.node_registry`)."""
        remote = self._bounded(timeout_s)
        if not isinstance(remote, NodeRegistryAPI):
            raise ServiceUnavailableError("this transport has no node registry")
        return remote.nodes()


if TYPE_CHECKING:  # mypy checks the transports against the Protocols they implement
    _RAY: type[SchedulerAPI] = RayTransport
    _RAY_REMOTE: type[RemoteAPI] = RayTransport
    _HTTP: type[RemoteAPI] = HttpTransport
    _INPROC: type[RemoteAPI] = InProcessTransport
