"""The scheduler's calls as typed Protocols: the one seam between the live scheduler and
whatever carries calls to it.

:class:`SchedulerAPI` is every call the scheduler takes; :class:`GatewayAPI` is the
gateway's part of it (the calls of the HTTP API), and
:class:`~kvprefetch.controlplane.base.scheduler_api.NodeAPI` the engines' and agents' part
(in the bottom layer, where the agents may import it). Implementations:

* :class:`~kvprefetch.controlplane.live.service.SchedulerService` (SchedulerAPI): the
  scheduler in this process;
* the Ray ``SchedulerActor`` (:mod:`kvprefetch.controlplane.live.ray_app`, SchedulerAPI): the
  service wrapped as an actor;
* :class:`~kvprefetch.controlplane.live.client.RayTransport` (SchedulerAPI): calls that actor;
* :class:`~kvprefetch.controlplane.live.client.HttpTransport` (GatewayAPI): calls the HTTP
  API of :mod:`kvprefetch.controlplane.live.http_api`, which fronts any GatewayAPI.

Calls take and answer the records of :mod:`kvprefetch.controlplane.base.api` (gateway) and
:mod:`kvprefetch.controlplane.base.wire` (engines, agents); a caller holding a dict parses
it at its own edge (:func:`kvprefetch.controlplane.base.api.parse`). Every method may be
called from any thread. Refusals are the typed errors of
:mod:`kvprefetch.controlplane.base.errors` (``UnknownSessionError``, ``WrongTenantError``,
``InvalidRequestError``, ...); a transport across a process boundary
also raises ``TimeoutError`` when the scheduler does not answer in time and
``ServiceUnavailableError`` when it cannot be reached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import ServiceError
from kvprefetch.controlplane.base.scheduler_api import NodeAPI
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionState


@runtime_checkable
class GatewayAPI(Protocol):
    """The gateway's calls: a session's requests as they arrive, are routed and finish, its
    hints, its end. The gateway calls these once per event of a session, so at the
    request rate of the fleet (tens to thousands per second); each answers at once (the
    scheduler's work that follows runs after the answer).

    Only ``route`` with a ``request_id`` and ``cancel_route`` are idempotent; every other
    call records one event in the journal, so a retry of a call that did reach the
    scheduler records it twice.
    """

    def request_started(self, call: api.RequestStarted) -> api.Ack:
        """A request of the session arrived (optional: ``route`` records it when it was
        not sent for this request). Once per request, before ``route``."""
        ...

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        """The node to run the request on. Once per request; a second call for the same
        request (before ``request_finished``) routes it again, moving the estimate of the
        queue it waits in, and records no second start. With ``call.request_id`` it is
        idempotent: the same id again (the same session and body) answers the first
        answer and applies nothing, also after the scheduler restarted;
        ``RequestIdConflictError`` (409) for the id with another session or body, or
        after it was cancelled."""
        ...

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        """Undo the route ``call.request_id`` whose request the caller abandoned (its
        answer was lost, or the request will not run): its request, still in flight,
        ends (the session's first request closes the session). Idempotent; at most once
        per route; ``outcome`` says what it found."""
        ...

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        """The response ended on ``call.node``; the session's context grew. Once per
        request. ``call.node`` None (its route gave no advice) is answered
        ``accepted=False`` and not recorded."""
        ...

    def hint(self, call: api.HintCall) -> api.Ack:
        """A typed hint (a person typing, a tool running): zero or more per idle gap. A
        ``session_closed`` hint is :meth:`session_closed`."""
        ...

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        """The session will not return: its prefetches stop, its state is freed. Once per
        session; the session is unknown afterwards (a second call raises
        ``UnknownSessionError``)."""
        ...

    def session_state(self, call: SessionQuery) -> SessionState:
        """What the scheduler holds for the caller's session (turns, context, in flight);
        ``UnknownSessionError`` when the tenant has no live session by that id. Read-only;
        any time (operators, gateways checking their books)."""
        ...


@runtime_checkable
class SchedulerAPI(GatewayAPI, NodeAPI, Protocol):
    """Every call the scheduler takes: the gateway's (:class:`GatewayAPI`), each node's
    engine's and prefetch agent's (:class:`~kvprefetch.controlplane.base.scheduler_api.NodeAPI`),
    and introspection for
    operators and tests."""

    # ------------------------------------------------------------------ introspection
    def summary(self) -> dict[str, Any]:
        """Counters and measurements (a JSON object) for operators, the live demo and
        tests; read-only, any time."""
        ...

    def sessions(self) -> int:
        """How many sessions the scheduler holds; read-only, any time."""
        ...

    def has_session(self, tenant: str, session_id: str) -> bool:
        """Whether the scheduler holds this session; read-only, any time."""
        ...


@runtime_checkable
class RemoteAPI(GatewayAPI, Protocol):
    """A :class:`GatewayAPI` in another process (the Ray and HTTP transports): each call
    waits at most the transport's timeout, then raises ``TimeoutError``. Whoever opened
    the transport closes it."""

    def route_many(self, calls: Sequence[api.RouteQuery]
                   ) -> list[api.RouteAnswer | ServiceError]:
        """``route`` for each call, in order, in as few round trips as the transport can
        (one per shard through Ray); a refused call answers its typed error."""
        ...

    def with_timeout(self, timeout_s: float) -> RemoteAPI:
        """The same connection, its calls bounded by ``timeout_s`` instead (cheap: made
        per call by a client that was given a per-call timeout)."""
        ...

    def close(self) -> None:
        """Release the connection (idempotent); views made by ``with_timeout`` share it."""
        ...
