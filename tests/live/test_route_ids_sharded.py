"""Route request ids across scheduler shards: one id names one session's route whichever
shards own the sessions it is sent for, over the HTTP front on two shards on a local Ray
runtime; and the claims that make it so (pure)."""

from __future__ import annotations

import pytest

from kvprefetch.controlplane.base.errors import RequestIdConflictError
from kvprefetch.controlplane.live.routes.claims import (
    CLAIM_HOLD_S,
    ClaimHolder,
    RequestIdClaims,
    request_id_shard,
)


def test_an_id_is_claimed_by_one_session_until_its_holder_is_found_forgotten() -> None:
    claims = RequestIdClaims(per_tenant=3)
    assert claims.claim("t", "r1", "a", now_s=0.0) is None
    assert claims.claim("t", "r1", "a", now_s=1.0) is None  # the same session: a retry
    assert claims.claim("t", "r1", "b", now_s=2.0) == ClaimHolder("a", young=True)
    assert claims.claim("u", "r1", "b", now_s=2.0) is None  # ids are per tenant
    late = 1.0 + CLAIM_HOLD_S + 1
    assert claims.claim("t", "r1", "b", now_s=late) == ClaimHolder("a", young=False)
    # passed over only from the holder the caller found forgotten
    assert claims.claim("t", "r1", "b", now_s=late, replacing="c") == ClaimHolder("a", False)
    assert claims.claim("t", "r1", "b", now_s=late, replacing="a") is None
    assert claims.claim("t", "r1", "a", now_s=late) == ClaimHolder("b", young=True)
    for i in range(3):  # the least recently used go past per_tenant
        assert claims.claim("t", f"x{i}", "s", now_s=late) is None
    assert claims.claim("t", "r1", "a", now_s=late) is None and len(claims) == 4


def test_ids_spread_over_the_shards() -> None:
    owners = [request_id_shard("t", f"req-{i}", 4) for i in range(400)]
    assert {owners.count(s) for s in range(4)} <= set(range(70, 131))
    assert request_id_shard("t", "req-1", 1) == 0


@pytest.mark.slow
@pytest.mark.servers
def test_a_request_id_reused_for_other_sessions_on_two_shards_gets_409_every_time() -> None:
    import httpx
    import ray

    from kvprefetch.controlplane.base import api
    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.base.shards import ShardRing
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.http_api import HttpServer, create_app
    from kvprefetch.controlplane.live.ray_app import start_shards

    namespace = "kvprefetch-test-route-ids"
    ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        handles = start_shards(ServiceConfig(fleet=default_fleet("8b", 2)), 2,
                               namespace=namespace, with_agents=False)
        client = connect("auto", namespace=namespace, timeout_s=10.0)
        ring = ShardRing(2)
        with HttpServer(create_app(client, bearer_token=None, call_timeout_s=10)) as srv, \
                httpx.Client(timeout=20) as http:
            def route(sid: str) -> httpx.Response:
                return http.post(f"{srv.url}/v1/route", json={
                    "session_id": sid, "input_tokens": 500, "request_id": "req-shared"})

            first = route("s-first")
            others = [route(f"s-other-{i}") for i in range(20)]
            again = route("s-first")
            batch = client.scheduler.route_many([  # type: ignore[attr-defined]
                api.RouteQuery(session_id="s-batch", input_tokens=500, request_id="req-shared"),
                api.RouteQuery(session_id="s-batch", input_tokens=500)])
        owners = {ring.owner("default", f"s-other-{i}") for i in range(20)}
        applied = sum(ray.get(h.has_session.remote("default", f"s-other-{i}"))
                      for h in handles for i in range(20))
        client.close()
        ray.get([h.close.remote() for h in handles], timeout=10)
    finally:
        ray.shutdown()
    assert owners == {0, 1}
    assert first.status_code == 200, first.text
    assert [r.status_code for r in others] == [409] * 20, [r.text for r in others]
    assert again.status_code == 200 and again.json() == first.json(), again.text
    assert applied == 0  # nothing of the refused routes was applied on either shard
    assert isinstance(batch[0], RequestIdConflictError) and batch[0].http_status == 409
    assert getattr(batch[1], "node", None) is not None
