"""Idempotent routes across restarts: a route the scheduler applied and journalled but
whose answer the caller never got (a timeout or a 503 while the scheduler restarted) is
answered on retry with its request id, applied once, and can be cancelled, which releases
what it held. Real uvicorn servers on loopback in front of real schedulers with journals
(the same through a Ray scheduler actor that Ray restarts: tests/live/test_ray.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvprefetch.controlplane.base import api  # noqa: E402
from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.base.errors import (  # noqa: E402
    InvalidRequestError,
    JournalUnavailableError,
    RequestIdConflictError,
)
from kvprefetch.controlplane.live.client import Client  # noqa: E402
from kvprefetch.controlplane.live.connect import connect  # noqa: E402
from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig  # noqa: E402
from kvprefetch.controlplane.live.tenants import TenantQuotaError  # noqa: E402

pytestmark = pytest.mark.servers

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 8 * GIB}})
TOKEN = "t0ken-for-tests"


class AnswerLost(SchedulerService):
    """A scheduler that applies and journals each route, then does not answer it until
    :attr:`release` is set: from the caller's side, one that died mid-call while it
    restarted. :attr:`applied` holds the answers it computed."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.release = threading.Event()
        self.applied: list[api.RouteAnswer] = []

    def route(self, call: api.RouteQuery | dict[str, Any]) -> api.RouteAnswer:
        answer = super().route(call)
        self.applied.append(answer)
        self.release.wait(10)
        return answer


def _config(tmp_path: Path, **kw: Any) -> ServiceConfig:
    return ServiceConfig(fleet=FLEET, journal_path=str(tmp_path / "journal.jsonl"),
                         tenants=("acme",), **kw)


def _serve(svc: SchedulerService, call_timeout_s: float = 2.0) -> HttpServer:
    return HttpServer(create_app(svc, bearer_token=TOKEN, call_timeout_s=call_timeout_s)).start()


def _client(server: HttpServer) -> Client:
    return connect(server.url, token=TOKEN, tenant="acme", timeout_s=5.0)


def _records(tmp_path: Path, **match: Any) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


@pytest.fixture
def first(tmp_path: Path) -> Iterator[tuple[AnswerLost, HttpServer]]:
    svc = AnswerLost(_config(tmp_path, max_live_sessions_per_tenant=1)).start()
    server = _serve(svc, call_timeout_s=0.3)
    try:
        yield svc, server
    finally:
        svc.release.set()
        server.close()
        svc.close()


def test_a_route_lost_in_a_restart_is_answered_on_retry_once_and_cancelled(
        tmp_path: Path, first: tuple[AnswerLost, HttpServer]) -> None:
    svc, server = first
    with _client(server) as c:
        lost = c.route("s1", input_tokens=4_000)
    # The caller was told the route failed, but the scheduler applied it.
    assert lost.timed_out and lost.node is None and lost.request_id
    assert len(svc.applied) == 1
    applied = svc.applied[0]
    # The scheduler restarts from its journal.
    svc.release.set()
    server.close()
    svc.close()
    cfg = _config(tmp_path, max_live_sessions_per_tenant=1)
    with SchedulerService(cfg) as again, _serve(again) as server2, _client(server2) as c:
        # The lost route is live, in flight and holds the tenant's one live session.
        state = c.session_state("s1")
        assert state.in_flight and state.turns == 1
        with pytest.raises(TenantQuotaError):
            c.route("s2", input_tokens=100)
        # A retry with the route's id answers what the scheduler decided and applies
        # nothing again.
        retry = c.route("s1", input_tokens=4_000, request_id=lost.request_id)
        assert not retry.timed_out
        assert (retry.node, retry.node_name, retry.estimated_ttft_s, retry.request_id) == (
            applied.node, applied.node_name, applied.estimated_ttft_s, lost.request_id)
        assert again.stats.events == 0 and again.stats.routes == 0
        assert c.session_state("s1").turns == 1
        assert len(_records(tmp_path, kind="request_started", session="acme/s1")) == 1
        # The same id for another body or session is refused, with nothing applied.
        with pytest.raises(RequestIdConflictError, match="another body"):
            c.route("s1", input_tokens=5_000, request_id=lost.request_id)
        with pytest.raises(RequestIdConflictError, match="another session"):
            c.route("s9", input_tokens=4_000, request_id=lost.request_id)
        assert again.stats.events == 0 and not again.has_session("acme", "s9")
        # The caller gives the request up: the cancel releases the session and its quota.
        cancelled = c.cancel_route("s1", lost.request_id or "")
        assert cancelled == api.RouteCancelled(request_id=lost.request_id or "",
                                               outcome="cancelled")
        assert not again.has_session("acme", "s1")
        assert c.route("s2", input_tokens=100).node is not None
        # Idempotent, and the id is spent.
        assert c.cancel_route("s1", lost.request_id or "").outcome == "cancelled"
        with pytest.raises(RequestIdConflictError, match="cancelled"):
            c.route("s1", input_tokens=4_000, request_id=lost.request_id)
        assert not again.has_session("acme", "s1")
    # The cancel survives the next restart too.
    with SchedulerService(cfg) as third, _serve(third) as server3, _client(server3) as c:
        assert not third.has_session("acme", "s1") and third.has_session("acme", "s2")
        assert c.cancel_route("s1", lost.request_id or "").outcome == "cancelled"
        with pytest.raises(RequestIdConflictError):
            c.route("s1", input_tokens=4_000, request_id=lost.request_id)
        assert third.summary()["routes_remembered"] == 2


def test_the_http_api_takes_request_ids_and_cancels(tmp_path: Path) -> None:
    with SchedulerService(_config(tmp_path)) as svc, _serve(svc) as server:
        auth = {"Authorization": f"Bearer {TOKEN}"}

        def post(op: str, body: dict[str, Any]) -> Any:
            return httpx.post(f"{server.url}/v1/{op}", json={"tenant": "acme", **body},
                              headers=auth, timeout=5)

        body = {"session_id": "s1", "input_tokens": 1_000, "request_id": "req-1"}
        one = post("route", body)
        assert one.status_code == 200 and one.json()["request_id"] == "req-1"
        assert post("route", body).json() == one.json()
        conflict = post("route", {**body, "input_tokens": 2_000})
        assert conflict.status_code == 409
        assert conflict.json()["error"] == "RequestIdConflictError"
        bad = post("route", {**body, "request_id": "no spaces"})
        assert bad.status_code == 422 and "request_id" in bad.text
        assert post("cancel_route", {"session_id": "s1", "request_id": "nope"}).json() == {
            "request_id": "nope", "outcome": "unknown"}
        done = post("cancel_route", {"session_id": "s1", "request_id": "req-1"})
        assert done.status_code == 200 and done.json()["outcome"] == "cancelled"
        assert not svc.has_session("acme", "s1")
        doc = httpx.get(f"{server.url}/openapi.json", timeout=5).json()
        assert "/v1/cancel_route" in doc["paths"]
        assert "request_id" in json.dumps(doc["paths"]["/v1/route"])


def test_the_client_reuses_its_id_and_a_later_turn_cancelled_ends_as_aborted(
        tmp_path: Path) -> None:
    with SchedulerService(_config(tmp_path)) as svc:
        c = connect(service=svc, tenant="acme")
        first = c.route("s1", input_tokens=1_000)
        assert first.request_id and len(first.request_id) == 32  # hex digits
        int(first.request_id, 16)
        assert c.route("s1", input_tokens=1_000).request_id != first.request_id
        c.request_finished("s1", node=first.node or 0, input_tokens=1_000, output_tokens=50,
                           context_tokens=1_050)
        # The first route's request ended: its id is forgotten, nothing to undo.
        assert c.cancel_route("s1", first.request_id).outcome == "unknown"
        turn = c.route("s1", input_tokens=1_200, request_id="turn-2")
        assert c.session_state("s1").in_flight
        assert c.cancel_route("s1", "turn-2").outcome == "cancelled"
        state = c.session_state("s1")
        assert not state.in_flight and state.turns == 2 and state.context_tokens == 1_050
        finished = _records(tmp_path, kind="request_finished", session="acme/s1")
        assert finished[-1]["stop"] == "aborted" and finished[-1]["node"] == turn.node
        with pytest.raises(InvalidRequestError):
            c.cancel_route("s1", "")


def test_route_memory_is_bounded_and_compaction_keeps_what_it_remembers(
        tmp_path: Path) -> None:
    cfg = _config(tmp_path, route_memory_per_tenant=2)
    with SchedulerService(cfg) as svc:
        c = connect(service=svc, tenant="acme")
        for i in range(3):  # in flight: each can still be retried
            c.route(f"s{i}", input_tokens=100, request_id=f"r{i}")
        c.session_closed("s0")
        assert svc.summary()["routes_remembered"] == 2
        assert svc.summary()["routes_forgotten"] == 1
        assert c.cancel_route("s0", "r0").outcome == "unknown"  # forgotten
        assert svc.compact_journal()
    assert {r["kvprefetch_route"] for r in _records(tmp_path) if "kvprefetch_route" in r} == {
        "r1", "r2"}
    with SchedulerService(cfg) as again:
        c = connect(service=again, tenant="acme")
        assert again.summary()["routes_remembered"] == 2
        assert c.route("s2", input_tokens=100, request_id="r2").node is not None
        assert again.stats.events == 0  # answered from memory, the session not reopened


def test_a_route_record_that_cannot_be_written_is_answered_on_retry(tmp_path: Path) -> None:
    with SchedulerService(_config(tmp_path)) as svc:
        c = connect(service=svc, tenant="acme")
        writer = svc.journal.writer
        assert writer is not None
        real = writer.write_route

        def full_disk(record: Any) -> None:
            raise JournalUnavailableError("the scheduler's journal cannot be written")

        writer.write_route = full_disk  # type: ignore[method-assign]
        with pytest.raises(JournalUnavailableError):
            svc.route(api.RouteQuery(tenant="acme", session_id="s1", input_tokens=100,
                                     request_id="r1"))
        writer.write_route = real  # type: ignore[method-assign]
        retry = c.route("s1", input_tokens=100, request_id="r1")
        assert retry.node is not None and svc.stats.events == 1
        assert len(_records(tmp_path, kvprefetch_route="r1")) == 1



def test_a_route_is_forgotten_when_its_request_ends_and_replay_agrees(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with SchedulerService(cfg) as svc:
        c = connect(service=svc, tenant="acme")
        done = c.route("s1", input_tokens=100, request_id="done")
        c.request_finished("s1", node=done.node or 0, input_tokens=100, output_tokens=10,
                           context_tokens=110)
        c.route("s2", input_tokens=100, request_id="closed")
        c.session_closed("s2")
        c.route("s3", input_tokens=100, request_id="gone")
        assert c.cancel_route("s3", "gone").outcome == "cancelled"  # closes s3, remembered
        live = c.route("s4", input_tokens=100, request_id="live")
        assert svc.summary()["routes_remembered"] == 2
        # The caller had the finished route's answer: the id routes the next turn afresh.
        assert c.route("s1", input_tokens=200, request_id="done").node is not None
        assert c.session_state("s1").turns == 2
    with SchedulerService(cfg) as again:
        c = connect(service=again, tenant="acme")
        # Replay remembers what the live scheduler did: the in-flight routes (s1's second
        # turn and s4's) and the cancel, not the ones whose requests ended.
        assert sorted(again.driver.routes) == [("acme", "done"), ("acme", "gone"),
                                               ("acme", "live")]
        assert c.route("s4", input_tokens=100, request_id="live") == live
        with pytest.raises(RequestIdConflictError, match="cancelled"):
            c.route("s3", input_tokens=100, request_id="gone")
        assert c.cancel_route("s2", "closed").outcome == "unknown"
        assert again.stats.events == 0
        assert again.compact_journal()
    with SchedulerService(cfg) as third:
        assert sorted(third.driver.routes) == [("acme", "done"), ("acme", "gone"),
                                               ("acme", "live")]
