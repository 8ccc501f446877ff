"""``POST /v1/events`` on a real uvicorn server in front of a real scheduler service: a
batch of fire-and-forget events applied in order and answered per item, refused whole
(422 naming the item and field, 403 for a tenant the token may not name, 413 past
``large_body_bytes``) with nothing applied, counted in the API's metrics, and described
in the OpenAPI document."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402
from kvprefetch.controlplane.live.limits import RequestLimits  # noqa: E402
from kvprefetch.controlplane.live.metrics import PrometheusMetrics  # noqa: E402
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig  # noqa: E402
from kvprefetch.controlplane.live.tenants import TenantAuth  # noqa: E402

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
ACME, GLOBEX = "acme-token-for-tests", "globex-token-for-tests"
LIMITS = RequestLimits(max_batch_events=8, large_body_bytes=4096)


@dataclass
class Api:
    service: SchedulerService
    url: str

    def post(self, op: str, body: Any, token: str | None = ACME) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(f"{self.url}/v1/{op}", json=body, headers=headers, timeout=10)


@pytest.fixture
def http_api() -> Iterator[Api]:
    metrics = PrometheusMetrics()
    svc = SchedulerService(ServiceConfig(fleet=FLEET, tenants=("acme", "globex")),
                           metrics=metrics).start()
    auth = TenantAuth({"acme": ACME, "globex": GLOBEX})
    try:
        with HttpServer(create_app(svc, auth=auth, limits=LIMITS,
                                   metrics_registry=metrics)) as srv:
            yield Api(svc, srv.url)
    finally:
        svc.close()


def test_a_batch_is_applied_in_order_and_answered_per_item(http_api: Api) -> None:
    node = http_api.post("route", {"session_id": "s1", "input_tokens": 5000}).json()["node"]
    assert node in (0, 1)
    events = http_api.service.stats.events
    batch = [
        {"op": "request_finished", "session_id": "s1", "node": node, "input_tokens": 5000,
         "output_tokens": 200},
        {"op": "hint", "session_id": "s1", "hint": {"kind": "tool_running", "eta_s": 3.0}},
        {"op": "request_started", "session_id": "s1", "input_tokens": 5300},
        {"op": "request_finished", "session_id": "s1", "input_tokens": 5300},  # no node
        {"op": "session_closed", "session_id": "s1"},
        {"op": "hint", "session_id": "s1", "hint": {"kind": "user_typing"}},  # closed
    ]
    resp = http_api.post("events", {"events": batch})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert [a["accepted"] for a in answer["acks"]] == [True, True, True, False, True, False]
    assert answer["accepted"] == 4 and answer["not_accepted"] == 2
    # the hint after the close meets the error its own call answers (404); no other does
    assert all("error" not in a for a in answer["acks"][:-1]), answer
    assert answer["acks"][-1]["error"] == "UnknownSessionError"
    assert "s1" in answer["acks"][-1]["detail"]
    # recorded one by one, in order: the finish before the close, nothing after it
    assert http_api.service.stats.events == events + 4
    assert not http_api.service.has_session("acme", "s1")


def test_an_item_that_meets_an_error_is_answered_with_it_and_the_rest_still_apply(
        http_api: Api) -> None:
    node = http_api.post("route", {"session_id": "s2", "input_tokens": 100}).json()["node"]
    resp = http_api.post("events", {"events": [
        {"op": "request_finished", "session_id": "nobody", "node": 0, "input_tokens": 100},
        {"op": "request_finished", "session_id": "s2", "node": node, "input_tokens": 100}]})
    assert resp.status_code == 200, resp.text
    first, second = resp.json()["acks"]
    assert first["accepted"] is False and first["error"] == "UnknownSessionError"
    assert "nobody" in first["detail"]
    assert second == {"accepted": True, "timed_out": False}
    assert resp.json()["accepted"] == 1 and resp.json()["not_accepted"] == 1
    state = http_api.post("session_state", {"session_id": "s2"}).json()
    assert not state["in_flight"] and state["context_tokens"] == 100


@pytest.mark.parametrize(("events", "loc", "kind"), [
    ([{"op": "hint", "session_id": "ok", "hint": {"kind": "user_typing"}},
      {"op": "request_finished", "session_id": "ok", "node": "x", "input_tokens": 5}],
     "events.1.node", "int_type"),
    ([{"op": "route", "session_id": "ok", "input_tokens": 5}], "events.0.op", "literal_error"),
    ([{"session_id": "ok"}], "events.0.op", "missing"),
    ([{"op": "session_closed", "session_id": "../x"}], "events.0.session_id",
     "string_pattern_mismatch"),
    ([{"op": "session_closed", "session_id": "a", "extra": 1}], "events.0.extra",
     "extra_forbidden"),
    ([], "events", "too_short"),
    ([{"op": "session_closed", "session_id": f"s{i}"} for i in range(9)], "events",
     "too_long"),
])
def test_an_invalid_batch_is_refused_whole_naming_the_item_and_field(
        http_api: Api, events: list[dict[str, Any]], loc: str, kind: str) -> None:
    http_api.post("route", {"session_id": "ok", "input_tokens": 100})
    before = http_api.service.stats.events
    resp = http_api.post("events", {"events": events})
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert body["error"] == "InvalidRequestError"
    assert (loc, kind) in [(e["loc"], e["type"]) for e in body["errors"]], body
    assert loc in body["detail"]
    assert http_api.service.stats.events == before  # nothing applied
    assert http_api.service.has_session("acme", "ok")


def test_a_batch_body_is_bounded_by_large_body_bytes(http_api: Api) -> None:
    events = [{"op": "request_started", "session_id": "big", "token_ids": list(range(1000, 2000))}]
    body = json.dumps({"events": events})
    assert len(body) > LIMITS.large_body_bytes
    resp = httpx.post(f"{http_api.url}/v1/events", content=body, timeout=10,
                      headers={"Authorization": f"Bearer {ACME}",
                               "Content-Type": "application/json"})
    assert resp.status_code == 413
    assert "large_body_bytes" in resp.json()["detail"]
    assert not http_api.service.has_session("acme", "big")


def test_a_batch_naming_another_tenant_is_refused_with_nothing_applied(http_api: Api
                                                                       ) -> None:
    http_api.post("route", {"session_id": "t", "input_tokens": 100})
    resp = http_api.post("events", {"events": [
        {"op": "session_closed", "session_id": "t"},
        {"op": "session_closed", "session_id": "t", "tenant": "globex"}]})
    assert resp.status_code == 403 and resp.json()["error"] == "WrongTenantError"
    assert http_api.service.has_session("acme", "t")
    assert http_api.post("events", {"events": [{"op": "session_closed", "session_id": "t"}]},
                         token=None).status_code == 401
    assert http_api.service.has_session("acme", "t")
    # a tenant's batch acts for that tenant only: globex has no session "t"
    ack = http_api.post("events", {"events": [{"op": "session_closed", "session_id": "t"}]},
                        token=GLOBEX).json()["acks"][0]
    assert ack["accepted"] is False and ack["error"] == "UnknownSessionError"
    assert http_api.service.has_session("acme", "t")


def test_batches_are_counted_in_the_metrics_and_described_in_openapi(http_api: Api) -> None:
    http_api.post("route", {"session_id": "m", "input_tokens": 100})
    assert http_api.post("events", {"events": [{"op": "session_closed",
                                                "session_id": "m"}]}).status_code == 200
    assert http_api.post("events", {"events": []}).status_code == 422
    text = httpx.get(f"{http_api.url}/metrics").text
    assert 'kvprefetch_http_requests_total{op="events",status="200"} 1.0' in text
    assert 'kvprefetch_http_requests_total{op="events",status="422"} 1.0' in text
    doc = httpx.get(f"{http_api.url}/openapi.json").json()
    post = doc["paths"]["/v1/events"]["post"]
    ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    batch = doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert batch["properties"]["events"]["maxItems"] == LIMITS.max_batch_events
    ops = set(batch["properties"]["events"]["items"]["discriminator"]["mapping"])
    assert ops == {"request_started", "request_finished", "hint", "session_closed"}
    answer = post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert answer.endswith("/EventsAnswer")
    assert {"401", "403", "413", "422"} <= set(post["responses"])
    assert "409" not in post["responses"]  # no request ids in a batch
    assert "large_body_bytes" in post["responses"]["413"]["description"]
