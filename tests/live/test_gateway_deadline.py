"""The gateway's bounded wait for the scheduler: a stalled scheduler (a real service whose
lock another thread holds) adds at most ``route_deadline_s`` to a request's first token;
the request runs on the least-loaded node, is counted, and the late route is applied by
the scheduler once, never sent again. The engine is the in-process stand-in of
test_vllm_gateway.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from test_vllm_gateway import UPSTREAMS, _fake_engine

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.gateway import Gateway, GatewayConfig, serve_in_thread
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
DEADLINE_S = 0.05
STALL_S = 1.0
#: The event loop's own slack on a shared 2-core machine (scheduling, not waiting).
SLACK_S = 0.04


def _first_token_s(client: httpx.Client, session: str) -> tuple[float, str]:
    """Seconds to the first streamed chunk of one chat turn, and the node that ran it."""
    began = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", headers={"X-Session-ID": session},
                       json={"model": "tiny", "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status_code == 200
        for _ in r.iter_bytes():
            if first is None:
                first = time.perf_counter() - began
    assert first is not None
    return first, r.headers["X-KVP-Node"]


@pytest.mark.servers  # the gateway on uvicorn, loopback
def test_a_stalled_scheduler_adds_at_most_the_deadline_to_a_request() -> None:
    with SchedulerService(ServiceConfig(fleet=FLEET)).start() as svc:
        client = connect(service=svc)
        seen: list[tuple[str, dict[str, Any]]] = []
        gateway = Gateway(GatewayConfig(upstreams=UPSTREAMS, route_deadline_s=DEADLINE_S),
                          scheduler=client,
                          transport=httpx.ASGITransport(app=_fake_engine(seen)))
        release = threading.Event()
        held = threading.Event()

        def stall() -> None:
            with svc._lock:  # the scheduler busy: every call waits for the lock
                held.set()
                release.wait(STALL_S)

        with serve_in_thread(gateway) as url, httpx.Client(base_url=url, timeout=10) as http:
            free = [_first_token_s(http, f"warm-{i}")[0] for i in range(3)]
            staller = threading.Thread(target=stall)
            staller.start()
            assert held.wait(5)
            stalled, node = _first_token_s(http, "stalled")
            release.set()
            staller.join()
            time.sleep(0.2)  # the late route lands
        # At most the deadline added to the slowest unstalled first token (plus the loop's
        # slack): the request did not wait for the scheduler.
        assert stalled <= max(free) + DEADLINE_S + SLACK_S, (free, stalled)
        metric = gateway.registry.get_sample_value
        assert metric("kvprefetch_gateway_route_deadline_total") == 1
        assert metric("kvprefetch_gateway_routed_total", {"by": "load"}) == 1
        assert metric("kvprefetch_gateway_routed_total", {"by": "scheduler"}) == 3
        assert node in {"0", "1"}
        # The late route reached the scheduler once and was not sent again: one turn.
        assert client.session_state("stalled").turns == 1
        client.close()


def test_the_deadline_is_a_validated_knob() -> None:
    from pydantic import ValidationError

    assert GatewayConfig(upstreams=UPSTREAMS).route_deadline_s == 0.005
    with pytest.raises(ValidationError, match="route_deadline_s"):
        GatewayConfig(upstreams=UPSTREAMS, route_deadline_s=0)


def test_routes_past_the_deadline_spread_over_idle_nodes() -> None:
    """A stalled scheduler's requests are not all sent to node 0: among idle nodes each
    session goes to the node its name hashes to, so distinct sessions spread over the
    fleet while a session's turns keep to one node (its prefix cached there)."""
    import asyncio

    upstreams = [f"http://node{i}" for i in range(4)]
    fleet = fleet_from_dict({"nodes": 4, "node": {"hbm_kv_bytes": 4 * GIB,
                                                  "dram_tier_bytes": 16 * GIB}})
    with SchedulerService(ServiceConfig(fleet=fleet)).start() as svc:
        client = connect(service=svc)
        gateway = Gateway(GatewayConfig(upstreams=upstreams, route_deadline_s=0.01,
                                        nodes_refresh_s=0), scheduler=client)
        sessions = [f"stalled-{i}" for i in range(16)]

        async def route_all() -> list[tuple[str, int, str]]:
            routed = []
            for session in sessions + sessions:  # every session twice, the fleet idle
                r = await gateway.route(session, [1, 2, 3])
                routed.append((session, r.node, r.by))
            return routed

        with svc._lock:  # the scheduler busy: every route misses its deadline
            routed = asyncio.run(route_all())
        client.close()
    assert {by for _, _, by in routed} == {"load"}
    nodes = [node for _, node, _ in routed]
    # 16 sessions over 4 idle nodes: every node gets some, none gets most.
    assert set(nodes) == {0, 1, 2, 3}, nodes
    assert max(nodes.count(n) for n in range(4)) <= len(nodes) // 2, nodes
    # A session's second turn goes where its first went.
    first = dict((s, n) for s, n, _ in routed[:len(sessions)])
    assert all(first[s] == n for s, n, _ in routed[len(sessions):]), routed
    assert gateway.registry.get_sample_value(
        "kvprefetch_gateway_route_deadline_total") == 2 * len(sessions)


def test_ties_without_a_session_take_the_idle_nodes_in_turn() -> None:
    """The tokenize call, which has no session yet, spreads over idle nodes in turn; a
    node with a request in flight is passed over while others are idle."""
    gateway = Gateway(GatewayConfig(upstreams=[f"http://node{i}" for i in range(3)],
                                    nodes_refresh_s=0))
    assert [gateway.least_loaded() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    gateway._enter(1)
    picks = {gateway.least_loaded() for _ in range(4)}
    picks |= {gateway.least_loaded(f"s{i}") for i in range(16)}
    assert picks == {0, 2}
