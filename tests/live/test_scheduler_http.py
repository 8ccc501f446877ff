"""The HTTP API served in the scheduler actor's own process (controlplane/live/
scheduler_http.py, ``http.front_end: scheduler``) on a real local Ray runtime: the same
endpoints, auth and metrics as the front end in serve's process, events applied before
the next route, a finish on no node not accepted, the API back on its port when Ray
restarts the actor, and one shard only."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.live.scheduler_http import HttpFrontEnd
from kvprefetch.controlplane.live.tenants import TenantAuth

pytestmark = [pytest.mark.slow, pytest.mark.servers]

TOKEN = "a-shared-token-of-32-characters!"
NAMESPACE = "kvprefetch-test-scheduler-http"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    """(the API's URL, the scheduler actor serving it)."""
    import ray

    from kvprefetch.agents.embedded import free_port
    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.ray_app import start_shards

    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        cfg = ServiceConfig(fleet=default_fleet("8b", 2))
        front = HttpFrontEnd(port=free_port("127.0.0.1"),
                             auth=TenantAuth(shared_token=TOKEN))
        (handle,) = start_shards(cfg, 1, namespace=NAMESPACE, with_agents=False, http=front)
        url = ray.get(handle.http_url.remote(), timeout=30)
        assert url == f"http://127.0.0.1:{front.port}"
        yield url, handle
        ray.get(handle.close.remote(), timeout=10)
        ray.kill(handle, no_restart=True)
    finally:
        ray.shutdown()


def _http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30,
                        headers={"Authorization": f"Bearer {TOKEN}"})


def test_the_api_in_the_actor_routes_and_applies_events_before_the_next_route(
        served: tuple[str, Any]) -> None:
    url, _ = served
    with _http(url) as http:
        first = http.post("/v1/route", json={"session_id": "s", "input_tokens": 800})
        assert first.status_code == 200 and first.json()["node"] in (0, 1)
        ack = http.post("/v1/request_finished",
                        json={"session_id": "s", "node": first.json()["node"],
                              "input_tokens": 800, "output_tokens": 200}).json()
        assert ack["accepted"] is True
        assert http.post("/v1/route", json={"session_id": "s",
                                            "input_tokens": 1100}).status_code == 200
        state = http.post("/v1/session_state", json={"session_id": "s"}).json()
        # A finish on no node is answered not accepted, as from serve's front end.
        none = http.post("/v1/request_finished",
                         json={"session_id": "s", "node": None, "input_tokens": 100}).json()
    assert state["turns"] == 2 and state["context_tokens"] == 1000
    assert none["accepted"] is False


def test_auth_health_and_metrics_are_the_api_s(served: tuple[str, Any]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as anonymous:
        refused = anonymous.post("/v1/route", json={"session_id": "x", "input_tokens": 1})
        assert refused.status_code == 401
        assert anonymous.get("/healthz").json() == {"status": "ok"}
        metrics = anonymous.get("/metrics").text
    # The scheduler's own metrics and the API's call counts, from one process.
    assert "kvprefetch_events_total" in metrics
    assert 'kvprefetch_http_requests_total{op="route",status="401"}' in metrics


def test_the_api_comes_back_on_its_port_when_ray_restarts_the_actor(
        served: tuple[str, Any]) -> None:
    import ray

    url, handle = served
    epoch = ray.get(handle.epoch.remote(), timeout=30)
    ray.kill(handle, no_restart=False)
    deadline = time.monotonic() + 60
    new_epoch = epoch
    while new_epoch == epoch and time.monotonic() < deadline:  # a new incarnation
        try:
            new_epoch = ray.get(handle.epoch.remote(), timeout=30)
        except ray.exceptions.RayActorError:  # dead or restarting: not yet
            time.sleep(0.2)
    assert new_epoch != epoch
    answer = None
    with _http(url) as http:
        while time.monotonic() < deadline:
            try:
                answer = http.post("/v1/route", json={"session_id": "after-restart",
                                                      "input_tokens": 100})
                if answer.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    assert answer is not None and answer.status_code == 200, answer
    assert ray.get(handle.http_url.remote(), timeout=30) == url


def test_one_shard_only() -> None:
    with pytest.raises(ConfigError, match=r"service\.shards is 2"):
        HttpFrontEnd().check(2)
