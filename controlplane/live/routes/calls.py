"""The live service's idempotent route calls, over its driver and under its lock: a route
with a ``request_id`` routed once and remembered (:func:`route_once`), and the undoing of
a route whose request the caller abandoned (:func:`cancel_route`). What is remembered,
for how long and how it is journalled is :mod:`kvprefetch.controlplane.live.routes.ledger`'s
(the ledger); this module applies it to the driver's sessions. Called by
:class:`~kvprefetch.controlplane.live.service.SchedulerService`, once per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import RequestIdConflictError
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.live.ports import Outbox
from kvprefetch.controlplane.live.routes.ledger import RouteMemo, route_digest
from kvprefetch.controlplane.live.sessions import SessionInfo

if TYPE_CHECKING:
    from kvprefetch.controlplane.live.driver import LiveDriver

__all__ = ["cancel_route", "route_once"]


def route_once(driver: LiveDriver, call: api.RouteQuery, box: Outbox) -> api.RouteAnswer:
    """:meth:`LiveDriver.route`, once per request id: a query without one is routed; one
    whose id is remembered, with the same session and body, answers the remembered answer
    and applies nothing; a new id is routed, then remembered (until its request ends) and
    journalled (:mod:`~kvprefetch.controlplane.live.routes.ledger`). RequestIdConflictError (nothing
    applied) for an id of another session or body, or of a cancelled route."""
    request_id = call.request_id
    if request_id is None:
        return driver.route(call, box)
    key = SessionKey(call.tenant, call.session_id)
    digest = route_digest(call)
    memo = driver.routes.get(call.tenant, request_id)
    if memo is None:
        answer = driver.route(call, box)
        info = driver.registry.known(key)
        memo = RouteMemo(key.wire, digest, info.turns - 1, info.arrival_s, answer)
        driver.routes.put(call.tenant, request_id, memo)
    else:
        memo.check(request_id, key.wire, digest)
        if memo.cancelled:
            raise RequestIdConflictError(
                f"request id {request_id!r}: its route was cancelled; nothing was "
                "applied: send the query with a new id")
    _journal_route(driver, call.tenant, request_id, memo)
    return memo.answer


def cancel_route(driver: LiveDriver, call: api.RouteCancel, box: Outbox) -> api.RouteCancelled:
    """Undo the route ``call.request_id``, whose request the caller abandoned. Undo
    means: when that request is still the session's request in flight, it ends as
    the client would have ended it: the session's first request closes the session (a
    ``session_closed`` event: the tenant's live-session quota is released and its
    prefetches stop); a later one finishes as ``aborted`` with no output, the session's
    context unchanged (a ``request_finished`` event); either way the request leaves
    its node's queue. Idempotent: a second cancel answers ``cancelled`` and changes
    nothing; an id not remembered answers ``unknown`` (a request that finished, or whose
    session closed, is forgotten: nothing undone); a remembered one whose request is no
    longer in flight answers ``finished``. RequestIdConflictError for an id of another
    session."""
    request_id = call.request_id
    key = SessionKey(call.tenant, call.session_id)
    memo = driver.routes.get(call.tenant, request_id)
    if memo is None:
        return api.RouteCancelled(request_id=request_id, outcome="unknown")
    memo.check(request_id, key.wire, None)
    if not memo.cancelled:
        info = driver.registry.get(key)
        if (info is None or not info.in_flight or info.turns - 1 != memo.turn
                or info.arrival_s != memo.arrival_s):
            return api.RouteCancelled(request_id=request_id, outcome="finished")
        _abandon(driver, call, info, memo, box)  # its end forgets the memo: put it back
        memo.cancelled, memo.journalled = True, False
        driver.routes.put(call.tenant, request_id, memo)
    _journal_route(driver, call.tenant, request_id, memo)
    return api.RouteCancelled(request_id=request_id, outcome="cancelled")


def _abandon(driver: LiveDriver, call: api.RouteCancel, info: SessionInfo, memo: RouteMemo,
             box: Outbox) -> None:
    """End the in-flight request of a cancelled route (see :func:`cancel_route`)."""
    if info.node is not None:
        driver.fleet.dequeue(info.node, info.est_service_s)
        info.node, info.est_service_s = None, 0.0
    if memo.turn == 0:
        driver.session_closed(api.SessionClosed(tenant=call.tenant,
                                                session_id=call.session_id), box)
        return
    node = memo.answer.node
    assert node is not None
    driver.request_finished(api.RequestFinished(
        tenant=call.tenant, session_id=call.session_id, node=node,
        input_tokens=info.context_tokens, output_tokens=0,
        context_tokens=info.context_tokens, stop_reason="aborted"), box)


def _journal_route(driver: LiveDriver, tenant: str, request_id: str, memo: RouteMemo) -> None:
    """Journal ``memo``'s state unless it is there already (JournalUnavailableError
    when the write fails: the memo stays, and the next call with its id tries again)."""
    if memo.journalled:
        return
    if driver.journal is not None:
        driver.journal.write_route(memo.record(tenant, request_id, driver.clock.now_s()))
        driver.journal_records += 1
    memo.journalled = True
