"""The HTTP API on a real uvicorn server on loopback: the Python client's HTTP transport
round trip, bearer token, typed 4xx errors, field-naming 422s, /metrics after real
transfers, the OpenAPI document, timeouts answered without prefetch."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvptest.live_fleet import build_local_fleet  # noqa: E402

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey  # noqa: E402
from kvprefetch.agents.engine_emulator import ServeRequest  # noqa: E402
from kvprefetch.controlplane.base import api  # noqa: E402
from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.base.errors import (  # noqa: E402
    ConfigError,
    InvalidRequestError,
    MalformedHintError,
    ServiceUnavailableError,
    UnauthorizedError,
    WrongTenantError,
)
from kvprefetch.controlplane.live.client import Client  # noqa: E402
from kvprefetch.controlplane.live.connect import connect  # noqa: E402
from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402
from kvprefetch.controlplane.live.metrics import PrometheusMetrics  # noqa: E402
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig  # noqa: E402
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionState  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPS = ("route", "request_started", "request_finished", "hint", "session_closed")


@dataclass
class Api:
    service: SchedulerService
    metrics: PrometheusMetrics
    url: str

    def client(self, **kw: Any) -> Client:
        kw.setdefault("token", TOKEN)
        kw.setdefault("tenant", "acme")
        return connect(self.url, **kw)

    def post(self, op: str, body: Any, headers: dict[str, str] | None = None) -> Any:
        return httpx.post(f"{self.url}/v1/{op}", json=body,
                          headers=AUTH if headers is None else headers, timeout=5)


@pytest.fixture
def http_api() -> Iterator[Api]:
    metrics = PrometheusMetrics()
    svc = SchedulerService(ServiceConfig(fleet=FLEET, tenants=("acme", "globex")),
                           metrics=metrics).start()
    try:
        with HttpServer(create_app(svc, bearer_token=TOKEN, metrics_registry=metrics)) as srv:
            yield Api(svc, metrics, srv.url)
    finally:
        svc.close()


def test_round_trip_through_the_python_client(http_api: Api) -> None:
    with http_api.client() as c:
        ans = c.route("s1", input_tokens=5000)
        assert ans.node in (0, 1) and ans.node_name == f"node-{ans.node}" and not ans.timed_out
        assert c.request_finished("s1", node=ans.node, input_tokens=5000,
                                  output_tokens=200).accepted
        assert c.hint("s1", "tool_running", eta_s=3.0).accepted
        assert c.hint("s1", api.Hint(kind="user_typing")).accepted
        # the gateway may send request_started before route (and key chunks by content)
        assert c.request_started("s1", token_ids=list(range(6000))).accepted
        again = c.route("s1", input_tokens=6000)
        assert again.node is not None
        assert c.request_finished("s1", node=again.node, input_tokens=6000).accepted
        assert http_api.service.has_session("acme", "s1")
        assert c.session_closed("s1").accepted
        assert not http_api.service.has_session("acme", "s1")
        # closed and forgotten: the event is dropped
        assert c.hint("s1", "user_typing") == api.Ack(accepted=False)
    # route after request_started records no second start
    assert http_api.service.stats.events == 7


def test_a_finish_without_a_node_is_acknowledged_and_not_recorded(http_api: Api) -> None:
    """``node`` left out or null (the route gave no advice): 200 with ``accepted`` false, the
    request still in flight; the OpenAPI document shows the field as optional."""
    s1 = {"tenant": "acme", "session_id": "s1"}
    assert http_api.post("route", {**s1, "input_tokens": 5000}).status_code == 200
    events = http_api.service.stats.events
    for body in ({**s1, "input_tokens": 5000, "output_tokens": 100},
                 {**s1, "node": None, "input_tokens": 5000}):
        resp = http_api.post("request_finished", body)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"accepted": False, "timed_out": False}
    state = http_api.post("session_state", s1).json()
    assert state["in_flight"] and state["context_tokens"] == 0
    assert http_api.service.stats.events == events
    schema = httpx.get(f"{http_api.url}/openapi.json").json()["components"]["schemas"]
    finished = next(v for k, v in schema.items() if k.startswith("RequestFinished"))
    assert "node" in finished["properties"] and "node" not in finished.get("required", [])


def test_a_session_closed_hint_closes_the_session(http_api: Api) -> None:
    s1 = {"tenant": "acme", "session_id": "s1"}
    assert http_api.post("route", {**s1, "input_tokens": 100}).status_code == 200
    resp = http_api.post("hint", {**s1, "hint": {"kind": "session_closed"}})
    assert resp.status_code == 200 and resp.json()["accepted"], resp.text
    assert not http_api.service.has_session("acme", "s1")
    gone = http_api.post("session_state", s1)
    assert gone.status_code == 404 and gone.json()["error"] == "UnknownSessionError"


def test_a_call_is_not_held_back_by_delayed_acks(http_api: Api) -> None:
    # uvicorn serving a socket bound by the caller does not set TCP_NODELAY on the
    # connections it accepts; they inherit it from the listening socket. Without it every
    # answer's body waited for the client's delayed ACK: ~44 ms per call on loopback.
    with http_api.client() as c:
        c.route("warm", input_tokens=100)
        took = []
        for i in range(30):
            t0 = time.perf_counter()
            c.route(f"s{i}", input_tokens=100)
            took.append(time.perf_counter() - t0)
    took.sort()
    assert took[len(took) // 2] < 0.02, f"median call {took[len(took) // 2] * 1e3:.1f} ms"


def test_bearer_token_is_required_on_the_operations(http_api: Api) -> None:
    body = {"tenant": "acme", "session_id": "s", "input_tokens": 10}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        resp = http_api.post("route", body, headers=headers)
        assert resp.status_code == 401, resp.text
        assert resp.headers["www-authenticate"] == "Bearer"
        assert resp.json()["error"] == "UnauthorizedError" and resp.json()["detail"]
    with pytest.raises(UnauthorizedError, match="wrong bearer token"):
        http_api.client(token="wrong").route("s", input_tokens=10)
    with pytest.raises(UnauthorizedError, match="missing bearer token"):
        http_api.client(token=None).request_started("s", input_tokens=10)
    assert http_api.service.stats.events == 0  # nothing got through
    assert http_api.post("route", body).status_code == 200
    # probes and scrapers need no token
    assert httpx.get(f"{http_api.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{http_api.url}/metrics").status_code == 200
    assert httpx.get(f"{http_api.url}/openapi.json").status_code == 200


def test_typed_errors_are_4xx_with_a_message_and_the_service_keeps_running(
        http_api: Api) -> None:
    c = http_api.client()
    ans = c.route("mine", input_tokens=1000)
    c.request_finished("mine", node=ans.node or 0, input_tokens=1000)
    cases = [
        ("hint", {"tenant": "acme", "session_id": "nope", "hint": {"kind": "user_typing"}},
         404, "UnknownSessionError", "unknown session 'nope'"),
        ("request_finished", {"tenant": "acme", "session_id": "nope", "node": 0,
                              "input_tokens": 1}, 404, "UnknownSessionError", "nope"),
        ("hint", {"tenant": "acme", "session_id": "mine", "hint": {"kind": "dancing"}},
         422, "MalformedHintError", "hint.kind"),
        ("hint", {"tenant": "acme", "session_id": "mine",
                  "hint": {"kind": "tool_running", "eta_s": -3}},
         422, "MalformedHintError", "hint.eta_s"),
        ("hint", {"tenant": "acme", "session_id": "mine",
                  "hint": {"kind": "session_closed", "eta_s": 1}},
         422, "MalformedHintError", "takes no eta_s"),
        # another tenant's session is, to the caller, one that does not exist
        ("hint", {"tenant": "globex", "session_id": "mine", "hint": {"kind": "user_typing"}},
         404, "UnknownSessionError", "unknown session 'mine' of tenant 'globex'"),
        ("route", {"tenant": "initech", "session_id": "x", "input_tokens": 1},
         403, "WrongTenantError", "'initech' is not allowed"),
        ("request_finished", {"tenant": "acme", "session_id": "mine", "node": 7,
                              "input_tokens": 1}, 422, "InvalidRequestError", "out of range"),
    ]
    for op, body, status, error, message in cases:
        resp = http_api.post(op, body)
        assert resp.status_code == status, (op, body, resp.text)
        assert resp.json()["error"] == error and message in resp.json()["detail"], resp.text
    # the same refusals through the Python client, as typed errors; an event of a session
    # the scheduler does not hold is dropped instead (the inference path goes on)
    assert c.hint("nope", "user_typing") == api.Ack(accepted=False)
    assert c.hint("mine", "user_typing", tenant="globex") == api.Ack(accepted=False)
    assert c.dropped == 2
    with pytest.raises(WrongTenantError, match="HTTP 403"):
        c.route("x", input_tokens=1, tenant="initech")
    with pytest.raises(InvalidRequestError, match=r"HTTP 422.*out of range"):
        c.request_finished("mine", node=7, input_tokens=1)
    with pytest.raises(MalformedHintError):  # refused by the client before it is sent
        c.hint("mine", "dancing")
    # still serving, nothing half-applied
    assert c.hint("mine", "tool_running", eta_s=1.0).accepted
    assert httpx.get(f"{http_api.url}/healthz").status_code == 200
    assert http_api.service.sessions() == 1 and http_api.service.stats.loop_errors == 0


def test_validation_errors_are_422_and_name_the_field(http_api: Api) -> None:
    cases = [
        ("route", {"tenant": "acme", "session_id": "s", "input_tokens": -5}, "input_tokens"),
        ("route", {"tenant": "acme", "input_tokens": 5}, "session_id"),
        ("route", {"tenant": "acme", "session_id": "bad id!", "input_tokens": 5},
         "session_id"),
        ("request_started", {"tenant": "acme", "session_id": "s", "input_tokens": 5,
                             "colour": "red"}, "colour"),
        ("request_finished", {"tenant": "acme", "session_id": "s", "node": 0}, "input_tokens"),
        ("hint", {"tenant": "acme", "session_id": "s", "hint": {"eta_s": 1}}, "hint.kind"),
        ("session_closed", {"tenant": "", "session_id": "s"}, "tenant"),
    ]
    for op, body, field in cases:
        resp = http_api.post(op, body)
        assert resp.status_code == 422, (op, resp.text)
        data = resp.json()
        assert field in [e["loc"] for e in data["errors"]], data
        assert field in data["detail"] and data["detail"].startswith("invalid "), data
    # a body that is not JSON at all, and a cross-field rule of the model
    resp = httpx.post(f"{http_api.url}/v1/route", content=b"{not json",
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 422 and resp.json()["error"] == "InvalidRequestError"
    resp = http_api.post("route", {"tenant": "acme", "session_id": "s"})
    assert resp.status_code == 422 and "give input_tokens" in resp.json()["detail"]
    assert http_api.service.stats.events == 0
    assert http_api.post("route", {"tenant": "acme", "session_id": "s",
                                   "input_tokens": 5}).status_code == 200


def test_openapi_lists_the_operations(http_api: Api) -> None:
    doc = httpx.get(f"{http_api.url}/openapi.json").json()
    assert doc["info"]["title"] == "kvprefetch"
    paths = doc["paths"]
    for op in OPS:
        post = paths[f"/v1/{op}"]["post"]
        assert {"200", "401", "404", "422"} <= set(post["responses"]), post["responses"]
        assert post["security"] == [{"HTTPBearer": []}]
    assert "get" in paths["/metrics"] and "get" in paths["/healthz"]
    schemas = doc["components"]["schemas"]
    assert {"RouteQuery", "RouteAnswer", "HintCall", "Hint", "Ack", "ErrorBody"} <= set(schemas)
    assert schemas["Hint"]["properties"]["kind"]["enum"] == [
        "user_typing", "tool_running", "session_closed"]


def test_metrics_after_traffic_have_lateness_and_ttlb(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3) -> None:
    """Real transfers (agents, Valkey, S3 in process) driven through the HTTP API."""
    fleet = build_local_fleet(FLEET, valkey_server, s3_server, compression=200.0,
                              policy="predictive", tier_bytes=64 * MIB, predictor="hinted")
    metrics = PrometheusMetrics()
    fleet.service.metrics = metrics  # before any traffic
    svc = fleet.service
    try:
        app = create_app(svc, bearer_token=None, metrics_registry=metrics)
        with HttpServer(app) as srv, connect(srv.url, tenant="t") as c:
            def turn(n: int, tokens: int, reused: int) -> int:
                ans = c.route("s", input_tokens=tokens, reused_tokens=reused)
                assert ans.node is not None
                fleet.engines[ans.node].serve(ServeRequest(
                    "t", "s", n, tokens, reused, 50, time.time()))
                c.request_finished("s", node=ans.node, input_tokens=tokens, output_tokens=50)
                return ans.node

            node = turn(0, 60_000, 0)
            fleet.agents[node].evict(prefixes=("t/s/",))  # the node lost it, as pressure does
            svc.core.dram[node].remove("t/s")
            assert c.hint("s", "tool_running", eta_s=20.0).accepted  # -> prefetch to node
            deadline = time.time() + 10
            while time.time() < deadline and svc.stats.orders_done == 0:
                time.sleep(0.02)
            assert svc.stats.orders_done >= 1
            turn(1, 60_100, 60_050)
            text = httpx.get(f"{srv.url}/metrics").text
    finally:
        fleet.close()
    samples = _samples(text)
    assert samples['kvprefetch_ttlb_seconds_count{kind="prefetch"}'] >= 1
    assert samples["kvprefetch_prefetch_lateness_seconds_count"] >= 1
    assert samples['kvprefetch_transfer_bytes_total{kind="prefetch"}'] > 0
    assert samples['kvprefetch_events_total{kind="request_started"}'] == 2
    assert samples['kvprefetch_http_requests_total{op="route",status="200"}'] == 2
    assert samples['kvprefetch_http_request_seconds_count{op="hint"}'] == 1
    for name in ("kvprefetch_local_hit_rate", "kvprefetch_wasted_bytes_total",
                 "kvprefetch_useful_bytes_total", "kvprefetch_events_per_second"):
        assert name in samples
    assert samples["kvprefetch_prefetches_over_budget_total"] == 0
    assert samples["kvprefetch_warmup_bytes_total"] == 0  # no node restarted or joined
    for outcome in ("won", "lost"):  # nothing displaced yet: no bet settled
        assert samples[f'kvprefetch_displacement_bets_total{{outcome="{outcome}"}}'] == 0
    assert 'kvprefetch_orders_in_flight{node="node-0"}' in samples


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class _SlowScheduler:
    """A scheduler that never answers in time (a RemoteAPI stand-in: the timeout path is
    pure logic)."""

    def __init__(self) -> None:
        self.timeout_s = 0.0

    def with_timeout(self, timeout_s: float) -> _SlowScheduler:
        self.timeout_s = timeout_s
        return self

    def close(self) -> None:
        return None

    def _late(self, op: str) -> Any:
        raise TimeoutError(f"{op} timed out after {self.timeout_s} s")

    def session_state(self, call: SessionQuery) -> SessionState:
        return self._late("session_state")

    def request_started(self, call: api.RequestStarted) -> api.Ack:
        return self._late("request_started")

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        return self._late("route")

    def route_many(self, calls: Sequence[api.RouteQuery]) -> list[api.RouteAnswer]:
        return self._late("route_many")

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        return self._late("cancel_route")

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        return self._late("request_finished")

    def hint(self, call: api.HintCall) -> api.Ack:
        return self._late("hint")

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        return self._late("session_closed")


def test_a_scheduler_timeout_answers_without_prefetch_and_health_reports_it() -> None:
    def down() -> None:
        raise ConnectionError("scheduler actor unreachable")

    slow = _SlowScheduler()
    app = create_app(slow, bearer_token=None, call_timeout_s=0.1, health_check=down)
    assert slow.timeout_s == 0.1  # the app bounds a remote scheduler by its call timeout
    with HttpServer(app) as srv, connect(srv.url) as c:
        ans = c.route("s", input_tokens=10, request_id="r1")
        assert ans.node is None and ans.timed_out and ans.request_id == "r1"
        with pytest.raises(ServiceUnavailableError, match="cancel_route"):
            c.cancel_route("s", "r1")
        ack = c.request_finished("s", node=0, input_tokens=10)
        assert not ack.accepted and ack.timed_out
        health = httpx.get(f"{srv.url}/healthz")
        assert health.status_code == 503 and "unreachable" in health.json()["detail"]


def test_bad_arguments_fail_at_start() -> None:
    svc = SchedulerService(ServiceConfig(fleet=FLEET))
    with pytest.raises(ConfigError, match="bearer_token"):
        create_app(svc, bearer_token="  ")
    with pytest.raises(ConfigError, match="cannot serve"):
        create_app(object(), bearer_token=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="metrics_registry"):
        create_app(svc, bearer_token=None, metrics_registry=42)
    with HttpServer(create_app(svc, bearer_token=None)) as first:  # noqa: SIM117
        with pytest.raises(ConfigError, match="cannot listen"):
            HttpServer(create_app(svc, bearer_token=None), port=first.port).start()
