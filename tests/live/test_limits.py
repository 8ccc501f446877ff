"""Per-call limits: the HTTP body limit (413 before the body is read
whole), list lengths and token-id range (422 naming the field, nothing half-applied),
session-id rules, token hashing outside the scheduler's lock, and the in-process client's
timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvprefetch.controlplane.base import api  # noqa: E402
from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.base.errors import InvalidRequestError  # noqa: E402
from kvprefetch.controlplane.base.names import check_session_id  # noqa: E402
from kvprefetch.controlplane.live import limits as limits_module  # noqa: E402
from kvprefetch.controlplane.live.connect import connect  # noqa: E402
from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402
from kvprefetch.controlplane.live.limits import RequestLimits  # noqa: E402
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig  # noqa: E402

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
SMALL = RequestLimits(max_body_bytes=64 * 1024, max_token_ids=5000, max_chunk_hashes=50,
                      max_token_id=65_535)


@pytest.fixture
def served() -> Iterator[tuple[SchedulerService, str]]:
    svc = SchedulerService(ServiceConfig(fleet=FLEET, chunk_tokens=16, limits=SMALL)).start()
    try:
        with HttpServer(create_app(svc, limits=SMALL)) as srv:
            yield svc, srv.url
    finally:
        svc.close()


def _post(url: str, op: str, body: Any) -> Any:
    return httpx.post(f"{url}/v1/{op}", json=body, timeout=10)


@pytest.mark.servers
def test_a_body_over_the_limit_is_413_before_it_is_read(
        served: tuple[SchedulerService, str]) -> None:
    svc, url = served
    big = {"session_id": "s", "input_tokens": 1, "chunk_hashes": ["a" * 100] * 1000}
    resp = _post(url, "route", big)  # ~100 KB, declared in Content-Length
    assert resp.status_code == 413, resp.text
    body = resp.json()
    assert body["error"] == "RequestTooLargeError" and "max_body_bytes" in body["detail"]
    assert "65536" in body["detail"]

    def stream() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"session_id": "s", "input_tokens": 1, "chunk_hashes": ['
        for _ in range(2000):
            yield b'"' + b"b" * 100 + b'",'
        yield b'"c"]}'

    resp = httpx.post(f"{url}/v1/route", content=stream(),
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert resp.status_code == 413 and "at least" in resp.json()["detail"]
    assert svc.sessions() == 0 and svc.stats.events == 0
    # within the limit: served
    assert _post(url, "route", {"session_id": "s", "input_tokens": 10}).status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvprefetch_http_requests_total{op="route",status="413"} 2.0' in metrics


@pytest.mark.servers
def test_list_lengths_and_token_ids_are_checked_at_the_edge_naming_the_field(
        served: tuple[SchedulerService, str]) -> None:
    svc, url = served
    cases = [
        ({"session_id": "s", "token_ids": list(range(5001))}, "token_ids"),
        ({"session_id": "s", "input_tokens": 9, "chunk_hashes": ["h"] * 51}, "chunk_hashes"),
        ({"session_id": "s", "token_ids": [1, 2, 1 << 63]}, "token_ids.2"),
        ({"session_id": "s", "token_ids": [1, 65_536]}, "token_ids.1"),
        ({"session_id": "s", "token_ids": [-1]}, "token_ids.0"),
    ]
    for body, field in cases:
        resp = _post(url, "route", body)
        assert resp.status_code == 422, (body, resp.text)
        assert field in [e["loc"] for e in resp.json()["errors"]], resp.json()
    resp = _post(url, "request_finished", {"session_id": "s", "node": 0, "input_tokens": 1,
                                           "chunk_hashes": ["h"] * 51})
    assert resp.status_code == 422 and resp.json()["errors"][0]["loc"] == "chunk_hashes"
    assert svc.sessions() == 0 and svc.stats.events == 0  # nothing half-created
    ok = _post(url, "route", {"session_id": "s", "token_ids": list(range(5000))})
    assert ok.status_code == 200, ok.text
    info = svc.registry.get(svc_key("s"))
    assert info is not None and info.hashes is not None and len(info.hashes) == 313


def svc_key(session_id: str) -> Any:
    from kvprefetch.controlplane.base.types import SessionKey

    return SessionKey("default", session_id)


@pytest.mark.servers
def test_session_id_rules_are_documented_and_enforced(
        served: tuple[SchedulerService, str]) -> None:
    _svc, url = served
    for bad in (".", "..", "a/../b", "a/./b", "a//b", "/a", "a/", "sp ace", "x" * 257):
        resp = _post(url, "route", {"session_id": bad, "input_tokens": 1})
        assert resp.status_code == 422, (bad, resp.text)
        assert "session_id" in [e["loc"] for e in resp.json()["errors"]]
        with pytest.raises(InvalidRequestError, match="session_id"):
            check_session_id(bad)
    for good in ("s1", "parent/agent_002", ".hidden", "...", "a.b/c..d", "x" * 256):
        assert _post(url, "route", {"session_id": good, "input_tokens": 1}).status_code == 200
    assert _post(url, "route", {"session_id": "p", "parent_id": "..",
                                "input_tokens": 1}).status_code == 422
    doc = httpx.get(f"{url}/openapi.json").json()
    schema = doc["components"]["schemas"]["RouteQuery"]["properties"]
    assert "no part empty" in schema["session_id"]["description"]
    assert schema["token_ids"]["anyOf"][0]["maxItems"] == 5000
    assert schema["token_ids"]["anyOf"][0]["items"]["maximum"] == 65_535
    assert {"413", "422", "429", "404", "403"} <= set(doc["paths"]["/v1/route"]["post"]
                                                      ["responses"])


@pytest.mark.servers
def test_booleans_and_strings_are_refused_where_the_document_says_integer_or_number(
        served: tuple[SchedulerService, str]) -> None:
    # Found by the boundary pass of `make fuzz` (schemathesis' coverage phase): pydantic's
    # lax mode took `false` as 0 (and "5" as 5) for every integer and number field, which
    # the OpenAPI document does not allow; the calls were answered 200 and recorded.
    svc, url = served
    route = {"session_id": "s", "input_tokens": 10}
    finished = {"session_id": "s", "node": 0, "input_tokens": 10}
    cases = [
        ("route", {"session_id": "s", "input_tokens": False}, "input_tokens"),
        ("route", {"session_id": "s", "input_tokens": "10"}, "input_tokens"),
        ("route", {**route, "reused_tokens": True}, "reused_tokens"),
        ("route", {"session_id": "s", "token_ids": [1, True]}, "token_ids"),
        ("request_started", {"session_id": "s", "token_ids": ["7"]}, "token_ids"),
        ("request_finished", {**finished, "node": False}, "node"),
        ("request_finished", {**finished, "output_tokens": "5"}, "output_tokens"),
        ("request_finished", {**finished, "context_tokens": True}, "context_tokens"),
        ("hint", {"session_id": "s", "hint": {"kind": "tool_running", "eta_s": True}},
         "hint.eta_s"),
        ("hint", {"session_id": "s", "hint": {"kind": "tool_running", "eta_s": "3"}},
         "hint.eta_s"),
    ]
    for op, body, field in cases:
        resp = _post(url, op, body)
        assert resp.status_code == 422, (op, body, resp.text)
        assert field in [e["loc"] for e in resp.json()["errors"]], resp.json()
    assert svc.sessions() == 0 and svc.stats.events == 0
    # JSON Schema counts 10.0 as an integer: still accepted, as are ints for numbers
    assert _post(url, "route", {"session_id": "s", "input_tokens": 10.0}).status_code == 200
    assert _post(url, "route", {"session_id": "t", "token_ids": [1.0, 2]}).status_code == 200
    assert _post(url, "hint", {"session_id": "s", "hint": {"kind": "tool_running",
                                                           "eta_s": 3}}).status_code == 200
    # the same rule for Python callers (one schema for the client, the API and the service)
    with pytest.raises(ValidationError, match="valid integer"):
        api.RouteQuery(session_id="s", input_tokens=True)
    with pytest.raises(ValidationError, match="valid number"):
        api.Hint(kind="tool_running", eta_s="3")


def test_the_service_checks_limits_too_before_touching_state() -> None:
    with SchedulerService(ServiceConfig(fleet=FLEET, limits=SMALL)) as svc:
        c = connect(service=svc, tenant="acme")
        with pytest.raises(InvalidRequestError, match="token_ids"):
            c.route("s", token_ids=[1, 1 << 63])  # was: HTTP 500 and a half-made session
        with pytest.raises(InvalidRequestError, match="session_id"):
            c.route("..", input_tokens=5)
        with pytest.raises(InvalidRequestError, match="tenant"):
            c.route("s", input_tokens=5, tenant="..")
        with pytest.raises(InvalidRequestError, match="max_chunk_hashes"):
            c.route("s", input_tokens=5, chunk_hashes=["h"] * 5000)
        assert svc.sessions() == 0 and svc.stats.events == 0
        assert c.route("s", token_ids=[1, 2, 3]).node is not None


def test_limits_are_validated() -> None:
    with pytest.raises(ValidationError, match="cannot hold"):
        RequestLimits(max_body_bytes=1 << 20, max_token_ids=1_000_000)
    with pytest.raises(ValidationError):
        RequestLimits(max_body_bytes=10)
    with pytest.raises(ValidationError):
        RequestLimits(max_token_id=1 << 63)
    default = RequestLimits()
    assert default.max_token_ids == 1 << 20 and default.max_body_bytes == 16 << 20


def test_token_ids_are_hashed_outside_the_lock_so_small_routes_do_not_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hashing, release = threading.Event(), threading.Event()
    real = limits_module.chunk_hashes

    def slow_hashes(token_ids: Any, chunk_tokens: int) -> list[str]:
        if len(token_ids) > 1000:  # the big one: hold it while the small one runs
            hashing.set()
            assert release.wait(10)
        return real(token_ids, chunk_tokens)

    monkeypatch.setattr(limits_module, "chunk_hashes", slow_hashes)
    with SchedulerService(ServiceConfig(fleet=FLEET)) as svc:
        big_answer: list[api.RouteAnswer] = []
        c = connect(service=svc, tenant="acme", timeout_s=5.0)
        big = threading.Thread(target=lambda: big_answer.append(
            c.route("big", token_ids=list(range(200_000)))))
        big.start()
        try:
            assert hashing.wait(5)
            started = time.monotonic()
            small = c.route("small", input_tokens=100, timeout_s=2.0)
            waited = time.monotonic() - started
            assert small.node is not None and not small.timed_out
            assert waited < 1.0 and not big_answer  # the big one is still hashing
        finally:
            release.set()
            big.join(10)
        assert big_answer and big_answer[0].node is not None
        assert svc.has_session("acme", "big")


def test_the_in_process_client_honours_its_timeout() -> None:
    with SchedulerService(ServiceConfig(fleet=FLEET)) as svc:
        c = connect(service=svc, tenant="acme", timeout_s=0.2)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with svc._lock:  # a scheduler busy for a long time
                held.set()
                release.wait(10)

        t = threading.Thread(target=hold)
        t.start()
        try:
            assert held.wait(5)
            started = time.monotonic()
            ans = c.route("s", input_tokens=100)
            ack = c.request_started("t", input_tokens=100)
            waited = time.monotonic() - started
            assert ans.node is None and ans.timed_out
            assert not ack.accepted and ack.timed_out
            assert waited < 1.5 and c.timeouts == 2
        finally:
            release.set()
            t.join(10)
        assert c.route("u", input_tokens=100).node is not None  # serving again
        c.close()
        assert svc.has_session("acme", "u")  # the service outlives the client


def test_a_rate_limit_for_a_bad_tenant_name_is_refused() -> None:
    assert RequestLimits(tenant_rate_limits_calls_per_s={"acme": 5.0}).rate_limit_for(
        "acme") == (5.0, 5)
    with pytest.raises(ValidationError, match=r"tenant_rate_limits_calls_per_s: '\.\.' is not"):
        RequestLimits(tenant_rate_limits_calls_per_s={"..": 5.0})
