"""The typed seam between the scheduler and its transports (kvprefetch.controlplane.live.protocol):
who
implements which Protocol, and how the client uses a remote one (pure logic: no servers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.errors import ServiceError
from kvprefetch.controlplane.base.scheduler_api import NodeAPI
from kvprefetch.controlplane.live.client import (
    Client,
    HttpTransport,
    InProcessTransport,
    RayTransport,
)
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.protocol import GatewayAPI, RemoteAPI, SchedulerAPI
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionState

FLEET = fleet_from_dict({"nodes": 2})


def _static_conformance(svc: SchedulerService, ray_t: RayTransport,
                        http_t: HttpTransport) -> None:
    """Never called: mypy checks these assignments (``mypy tests/live/test_protocol.py``)."""
    service: SchedulerAPI = svc
    over_ray: SchedulerAPI = ray_t
    remote_ray: RemoteAPI = ray_t
    over_http: RemoteAPI = http_t
    del service, over_ray, remote_ray, over_http


def test_who_implements_which_protocol() -> None:
    assert isinstance(SchedulerService(ServiceConfig(fleet=FLEET)), SchedulerAPI)
    # the nodes' part, which the agents and engines type their calls by
    assert issubclass(SchedulerAPI, NodeAPI) and isinstance(
        SchedulerService(ServiceConfig(fleet=FLEET)), NodeAPI)
    assert not issubclass(HttpTransport, NodeAPI)
    assert issubclass(RayTransport, SchedulerAPI) and issubclass(RayTransport, RemoteAPI)
    assert issubclass(HttpTransport, RemoteAPI)
    # the HTTP API carries the gateway's calls only
    assert issubclass(HttpTransport, GatewayAPI) and not issubclass(HttpTransport, SchedulerAPI)
    assert not issubclass(SchedulerService, RemoteAPI)  # in process: no timeout, not closed
    # ... a client reaches one through a transport that bounds each call by its timeout
    assert issubclass(InProcessTransport, RemoteAPI)


@dataclass
class _Remote:
    """A RemoteAPI that records the timeout of each call and answers at once."""

    timeout_s: float = 0.0
    log: list[tuple[str, float]] = field(default_factory=list)
    closed: bool = False
    slow: bool = False

    def with_timeout(self, timeout_s: float) -> _Remote:
        return _Bound(self, timeout_s)

    def close(self) -> None:
        self.closed = True

    def _seen(self, op: str) -> None:
        self.log.append((op, self.timeout_s))
        if self.slow:
            raise TimeoutError(op)

    def request_started(self, call: api.RequestStarted) -> api.Ack:
        self._seen("request_started")
        return api.Ack()

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        self._seen("route")
        return api.RouteAnswer(node=1, node_name="node-1")

    def route_many(self, calls: Sequence[api.RouteQuery]
                   ) -> list[api.RouteAnswer | ServiceError]:
        self._seen("route_many")
        return [api.RouteAnswer(node=1, node_name="node-1") for _ in calls]

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        self._seen("cancel_route")
        return api.RouteCancelled(request_id=call.request_id, outcome="unknown")

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        self._seen("request_finished")
        return api.Ack()

    def hint(self, call: api.HintCall) -> api.Ack:
        self._seen("hint")
        return api.Ack()

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        self._seen("session_closed")
        return api.Ack()

    def session_state(self, call: SessionQuery) -> SessionState:
        self._seen("session_state")
        return SessionState(session_id=call.session_id, turns=1, in_flight=False,
                            context_tokens=10, keyed_by_content=False)


class _Bound(_Remote):
    def __init__(self, parent: _Remote, timeout_s: float) -> None:
        super().__init__(timeout_s, parent.log, parent.closed, parent.slow)


def test_a_remote_api_is_called_with_each_calls_timeout_and_closed_by_the_client() -> None:
    remote = _Remote()
    with Client(remote, tenant="t", timeout_s=2.0) as c:
        assert c.scheduler is remote
        assert c.route("s", input_tokens=10).node == 1
        assert c.request_finished("s", node=1, input_tokens=10, timeout_s=0.5).accepted
        assert c.hint("s", "user_typing").accepted
        assert c.session_closed("s", timeout_s=0.1).accepted
    assert remote.log == [("route", 2.0), ("request_finished", 0.5), ("hint", 2.0),
                          ("session_closed", 0.1)]
    assert remote.closed


def test_a_view_with_the_transports_own_timeout_is_the_transport() -> None:
    """A client asks for a view on every call: with the transport's own timeout it gets
    the transport, with another a copy that shares its state."""
    with SchedulerService(ServiceConfig(fleet=FLEET)) as svc:
        transport = InProcessTransport(svc, timeout_s=2.0)
        assert transport.with_timeout(2.0) is transport
        view = transport.with_timeout(0.5)
        assert view is not transport and view.timeout_s == 0.5 and transport.timeout_s == 2.0
        assert view.route(api.RouteQuery(session_id="s", input_tokens=10)).node in (0, 1)
        assert svc.has_session("default", "s")
        transport.close()


def test_timeouts_answer_without_prefetch_and_drop_the_event() -> None:
    c = Client(_Remote(slow=True), timeout_s=1.0)
    ans = c.route("s", input_tokens=10)
    assert ans.node is None and ans.timed_out
    ack = c.request_started("s", input_tokens=10)
    assert not ack.accepted and ack.timed_out
    assert c.timeouts == 2


def test_a_client_in_process_leaves_the_service_running() -> None:
    with SchedulerService(ServiceConfig(fleet=FLEET)) as svc:
        with connect(service=svc, tenant="acme") as c:
            assert c.scheduler is svc
            assert c.route("s", input_tokens=100).node in (0, 1)
        assert svc.has_session("acme", "s") and svc.sessions() == 1  # still serving
    with pytest.raises(Exception, match="needs service="):
        connect("inproc")


def test_route_many_answers_in_order_and_a_refusal_runs_without_prefetch() -> None:
    """Through a service in this process (route_each): every answer in its request's
    place; a refused one (an unknown tenant) answers no_prefetch instead of raising."""
    svc = SchedulerService(ServiceConfig(fleet=fleet_from_dict({"nodes": 2}),
                                         tenants=("a",))).start()
    try:
        with Client(svc, tenant="a") as c:
            answers = c.route_many([{"session_id": "s1", "input_tokens": 100},
                                    {"session_id": "s2", "input_tokens": 100, "tenant": "b"},
                                    {"session_id": "s3", "input_tokens": 100}])
            assert [a.node is not None for a in answers] == [True, False, True]
            assert svc.has_session("a", "s1") and svc.has_session("a", "s3")
            assert not svc.has_session("b", "s2")
    finally:
        svc.close()
