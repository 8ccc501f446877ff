"""The HTTP API in front of a scheduler actor as ``kvprefetch serve`` runs it (a real local
Ray runtime, the app on uvicorn, :func:`~kvprefetch.controlplane.live.http_api.ray_client`):
the actor's answers are awaited on the event loop, concurrent routes share actor calls,
events are queued and answered at once, and a session's finish still reaches the
scheduler before its next route."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.servers]


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[str, Any]]:
    """(the API's URL, its client's Ray transport)."""
    import ray

    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.http_api import HttpServer, create_app, ray_client
    from kvprefetch.controlplane.live.ray_app import start_shards

    namespace = "kvprefetch-test-http-ray"
    ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        cfg = ServiceConfig(fleet=default_fleet("8b", 2))
        (handle,) = start_shards(cfg, 1, namespace=namespace, with_agents=False)
        client = ray_client("auto", namespace, timeout_s=30.0)
        with HttpServer(create_app(client, chunk_tokens=cfg.chunk_tokens)) as server:
            yield server.url, client.scheduler
        client.close()
        ray.get(handle.close.remote(), timeout=10)
    finally:
        ray.shutdown()


def test_concurrent_routes_share_actor_calls_and_all_are_answered(api: tuple[str, Any]
                                                                   ) -> None:
    url, transport = api
    before_calls, before_routes = transport.coalesced.calls, transport.coalesced.routes

    async def calls() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            return await asyncio.gather(*(
                http.post("/v1/route", json={"session_id": f"c-{i}", "input_tokens": 500})
                for i in range(64)))

    answers = asyncio.run(calls())
    assert all(r.status_code == 200 for r in answers)
    assert all(r.json()["node"] in (0, 1) for r in answers)
    routes = transport.coalesced.routes - before_routes
    sent = transport.coalesced.calls - before_calls
    assert routes == 64
    # Arriving together, they went in fewer actor calls than routes (one each would be
    # the thread-per-call path).
    assert 1 <= sent < routes


def test_events_answer_at_once_and_reach_the_scheduler_before_the_next_route(
        api: tuple[str, Any]) -> None:
    url, transport = api
    queued = transport.batcher.stats.queued
    with httpx.Client(base_url=url, timeout=30) as http:
        first = http.post("/v1/route", json={"session_id": "s", "input_tokens": 800}).json()
        ack = http.post("/v1/request_finished",
                        json={"session_id": "s", "node": first["node"], "input_tokens": 800,
                              "output_tokens": 200}).json()
        assert ack["accepted"] is True
        assert transport.batcher.stats.queued == queued + 1  # queued, not a call of its own
        second = http.post("/v1/route", json={"session_id": "s", "input_tokens": 1100})
        assert second.status_code == 200
        state = http.post("/v1/session_state", json={"session_id": "s"}).json()
    # The finish went ahead of the second route: the context grew, a second turn runs.
    assert state["turns"] == 2 and state["in_flight"] is True
    assert state["context_tokens"] == 1000


def test_a_finish_on_no_node_is_not_accepted_although_events_are_queued(
        api: tuple[str, Any]) -> None:
    url, transport = api
    queued = transport.batcher.stats.queued
    with httpx.Client(base_url=url, timeout=30) as http:
        http.post("/v1/route", json={"session_id": "n", "input_tokens": 100})
        ack = http.post("/v1/request_finished",
                        json={"session_id": "n", "node": None, "input_tokens": 100}).json()
    assert ack["accepted"] is False
    assert transport.batcher.stats.queued == queued  # nothing queued for it


def test_a_batch_of_events_is_queued_and_reaches_the_scheduler_before_the_next_route(
        api: tuple[str, Any]) -> None:
    url, transport = api
    queued = transport.batcher.stats.queued
    with httpx.Client(base_url=url, timeout=30) as http:
        nodes = [http.post("/v1/route", json={"session_id": f"b-{i}", "input_tokens": 800}
                           ).json()["node"] for i in range(3)]
        batch = [{"op": "request_finished", "session_id": f"b-{i}", "node": node,
                  "input_tokens": 800, "output_tokens": 200} for i, node in enumerate(nodes)]
        batch.append({"op": "request_finished", "session_id": "b-0", "node": None,
                      "input_tokens": 800})
        answer = http.post("/v1/events", json={"events": batch}).json()
        assert answer["accepted"] == 3 and answer["not_accepted"] == 1
        assert [a["accepted"] for a in answer["acks"]] == [True, True, True, False]
        # queued, one each (the finish on no node is not), not calls of their own
        assert transport.batcher.stats.queued == queued + 3
        assert http.post("/v1/route", json={"session_id": "b-1", "input_tokens": 1100}
                         ).status_code == 200
        state = http.post("/v1/session_state", json={"session_id": "b-1"}).json()
    assert state["turns"] == 2 and state["context_tokens"] == 1000
