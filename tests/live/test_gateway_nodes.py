"""Live nodes reach the gateway: it follows the scheduler's node registry
(:mod:`kvprefetch.controlplane.live.node_registry`) without a restart.

In process: the scheduler service with a node slot out of the fleet at start, a gateway
in front of stand-in engines (one ASGI app; the host header tells which node's engine was
called) whose only configured upstream is node 0's. Node 1's agent says hello naming its
engine's URL: the gateway routes to it; node 0 is lost: it receives nothing more, its
sessions included; node 1's agent comes back with a new address: the gateway forwards
there. On Ray (``ray.cluster_utils.Cluster``, as tests/live/test_node_join.py): a raylet
that joins gets an agent, which names its engine, and the gateway sends it requests; a
raylet removed is reported lost by the node watcher and gets none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import pytest
from kvptest.ray_cluster import MIB, add_gpu_node, gpu_cluster, wait_for
from test_vllm_gateway import _fake_engine

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.wire import AgentHello
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.gateway import Gateway, GatewayConfig, build_app
from kvprefetch.controlplane.live.node_registry import (
    NodeEntry,
    NodeListing,
    UpstreamDirectory,
)
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return False


@asynccontextmanager
async def _asking(gateway: Gateway, seen: list[tuple[str, dict[str, Any]]],
                  prompt: list[int] | None = None
                  ) -> AsyncIterator[Callable[[str], Awaitable[str]]]:
    """The gateway started, and ``ask(session)``: one completion through it, answered 200,
    returning the host of the engine that served it (the last one ``seen``)."""
    app = build_app(gateway)
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as client:
            async def ask(session: str) -> str:
                r = await client.post("/v1/completions",
                                      json={"model": "m", "prompt": prompt or [1, 2, 3]},
                                      headers={"X-Session-ID": session})
                assert r.status_code == 200, r.text
                return seen[-1][0]

            yield ask
    finally:
        await gateway.close()


# -- the directory (pure) ----------------------------------------------------------------

def test_the_directory_follows_joins_losses_and_new_addresses() -> None:
    d = UpstreamDirectory(["http://a:8000"])
    assert d.routable() == (0,) and d.url(0) == "http://a:8000" and d.url(1) is None

    def listing(*entries: tuple[int, bool, str]) -> NodeListing:
        return NodeListing(nodes=[NodeEntry(node=n, name=f"n{n}", in_fleet=up, engine_url=u)
                                  for n, up, u in entries])

    d.apply(listing((0, True, ""), (1, False, "")))  # node 0 keeps its configured URL
    assert d.routable() == (0,)
    d.apply(listing((0, True, ""), (1, True, "http://b:8000")))  # node 1 joined
    assert d.routable() == (0, 1) and d.url(1) == "http://b:8000"
    d.apply(listing((0, False, ""), (1, True, "http://c:8000")))  # 0 lost, 1 moved
    assert d.routable() == (1,) and d.url(0) is None and d.url(1) == "http://c:8000"
    d.apply(listing((0, True, ""), (1, True, "http://c:8000"), (2, True, "")))
    assert d.routable() == (0, 1)  # node 2 is in the fleet, but nobody says where


def test_a_node_newly_routed_to_waits_for_its_engine() -> None:
    d = UpstreamDirectory(["http://a:8000"])
    joined = NodeListing(nodes=[NodeEntry(node=0, name="a", in_fleet=True),
                                NodeEntry(node=1, name="b", in_fleet=True,
                                          engine_url="http://b:8000")])
    assert d.pending(joined) == [(1, "http://b:8000")]  # node 0 is routed to already
    d.apply(joined, unready={1})  # its engine does not answer yet
    assert d.routable() == (0,) and d.states() == {0: True}
    assert d.pending(joined) == [(1, "http://b:8000")]  # asked again next time
    d.apply(joined)
    assert d.routable() == (0, 1) and d.pending(joined) == []
    assert d.states() == {0: True, 1: True}
    moved = NodeListing(nodes=[NodeEntry(node=0, name="a", in_fleet=False),
                               NodeEntry(node=1, name="b", in_fleet=True,
                                         engine_url="http://c:8000")])
    assert d.pending(moved) == [(1, "http://c:8000")]  # a new address is asked too
    d.apply(moved, unready={1})
    assert d.routable() == () and d.states() == {0: False, 1: False}
    # a request routed to a node just before it went out still reaches its engine
    assert d.url(0) is None and d.last_url(0) == "http://a:8000"
    assert d.last_url(1) == "http://b:8000" and d.last_url(2) is None


def test_a_listing_that_fails_leaves_the_last_one() -> None:
    d = UpstreamDirectory(["http://a", "http://b"])
    d.apply(NodeListing(nodes=[NodeEntry(node=0, name="a", in_fleet=False),
                               NodeEntry(node=1, name="b", in_fleet=True)]))

    def down() -> NodeListing:
        raise ConnectionError("scheduler down")

    assert d.refresh(down) is False and d.failures == 1 and d.routable() == (1,)


# -- the gateway in front of the scheduler's registry ---------------------------------------

@contextmanager
def _node0_up(engines: Any) -> Iterator[tuple[SchedulerService, Gateway]]:
    """A scheduler service with node 1's slot out of the fleet and node 0's agent greeted
    (its engine at ``http://node0``), and a gateway configured with node 0 alone that
    reads the service's node registry every 50 ms, in front of the ASGI app ``engines``."""
    cfg = ServiceConfig(fleet=FLEET, initial_nodes=1, node_names=("gpu-0", "gpu-1"))
    with SchedulerService(cfg).start() as svc:
        svc.agent_hello(AgentHello(0, "agent-0", "gpu-0", engine_url="http://node0"))
        yield svc, Gateway(GatewayConfig(upstreams=["http://node0"], tenant="t",
                                         nodes_refresh_s=0.05, route_deadline_s=2.0),
                           scheduler=connect(service=svc, tenant="t"),
                           transport=httpx.ASGITransport(app=engines))


def test_a_node_that_joins_gets_requests_and_a_lost_one_none() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    with _node0_up(_fake_engine(seen)) as (svc, gateway):

        async def scenario() -> None:
            async with _asking(gateway, seen) as ask:
                assert await ask("a") == "node0"
                # node 1's agent says hello: it joins, and names its engine
                svc.agent_hello(AgentHello(1, "agent-1", "gpu-1", engine_url="http://node1"))
                assert await asyncio.to_thread(
                    _until, lambda: gateway.nodes.routable() == (0, 1))
                # node 0 is lost: nothing more goes there, session a included
                svc.node_left(0)
                assert await asyncio.to_thread(_until, lambda: gateway.nodes.routable() == (1,))
                before = len(seen)
                hosts = [await ask(s) for s in ("a", "b", "c", "d")]
                assert hosts == ["node1"] * 4 and len(seen) == before + 4
                # node 1's agent comes back elsewhere (a rescheduled pod)
                svc.agent_hello(AgentHello(1, "agent-1b", "gpu-1", engine_url="http://node1b"))
                assert await asyncio.to_thread(
                    _until, lambda: gateway.nodes.url(1) == "http://node1b")
                assert await ask("e") == "node1b"

        asyncio.run(scenario())
        listing = svc.nodes()
        assert [(e.name, e.in_fleet, e.engine_url) for e in listing.nodes] == [
            ("gpu-0", False, "http://node0"), ("gpu-1", True, "http://node1b")]
        assert svc.summary()["nodes_lost"] == 1
        # routed by the scheduler, never by load: the registry and the routes agree
        assert gateway.metrics.routed.labels("load")._value.get() == 0


def _loading(app: Any, hosts: set[str]) -> Any:
    """``app``, but ``GET /health`` answers 503 for the engines named in ``hosts`` (still
    loading) and 200 for the others."""
    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/health":
            host = dict(scope["headers"]).get(b"host", b"").decode()
            await send({"type": "http.response.start", "status": 503 if host in hosts else 200,
                        "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await app(scope, receive, send)

    return asgi


def test_a_joined_node_gets_requests_once_its_engine_answers() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    loading = {"node1"}
    with _node0_up(_loading(_fake_engine(seen), loading)) as (svc, gateway):

        def routable() -> dict[str, float]:
            return {s.labels["node"]: s.value for m in gateway.registry.collect()
                    if m.name == "kvprefetch_gateway_node_routable" for s in m.samples}

        async def scenario() -> None:
            async with _asking(gateway, seen) as ask:
                # node 1 joins while its engine loads: the scheduler routes new sessions
                # there, the gateway does not
                svc.agent_hello(AgentHello(1, "agent-1", "gpu-1", engine_url="http://node1"))
                listings = gateway.nodes.listings
                assert await asyncio.to_thread(
                    _until, lambda: gateway.nodes.listings >= listings + 3)
                assert gateway.nodes.routable() == (0,)
                assert routable() == {"0": 1.0}
                assert {await ask(f"s{i}") for i in range(4)} == {"node0"}
                loading.clear()  # its engine answers
                assert await asyncio.to_thread(
                    _until, lambda: gateway.nodes.routable() == (0, 1))
                assert routable() == {"0": 1.0, "1": 1.0}
                # sessions that arrive together spread over both
                before = len(seen)
                await asyncio.gather(*(ask(f"new-{i}") for i in range(8)))
                hosts = {host for host, _ in seen[before:]}
                assert "node1" in hosts, hosts

        asyncio.run(scenario())


def test_nodes_refresh_s_0_keeps_the_configured_upstreams() -> None:
    cfg = ServiceConfig(fleet=FLEET, initial_nodes=1)
    with SchedulerService(cfg).start() as svc:
        svc.agent_hello(AgentHello(0, "agent-0", "gpu-0", engine_url="http://elsewhere"))
        gateway = Gateway(GatewayConfig(upstreams=["http://node0", "http://node1"],
                                        nodes_refresh_s=0),
                          scheduler=connect(service=svc, tenant="t"))

        async def started() -> tuple[tuple[int, ...], str | None]:
            await gateway.start()
            try:
                await asyncio.sleep(0.2)
                return gateway.nodes.routable(), gateway.nodes.url(0)
            finally:
                await gateway.close()

        assert asyncio.run(started()) == ((0, 1), "http://node0")
        assert gateway.nodes.listings == 0


@pytest.mark.parametrize("token", [None, "secret"])
def test_the_http_api_serves_the_registry(token: str | None) -> None:
    from fastapi.testclient import TestClient

    from kvprefetch.controlplane.live.http_api import create_app

    cfg = ServiceConfig(fleet=FLEET, initial_nodes=1)
    with SchedulerService(cfg).start() as svc:
        svc.agent_hello(AgentHello(0, "agent-0", "gpu-0", engine_url="http://10.0.0.1:8000"))
        app = create_app(svc, bearer_token=token)
        with TestClient(app) as http:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            r = http.get("/nodes", headers=headers)
            assert r.status_code == 200, r.text
            nodes = NodeListing.model_validate(r.json()).nodes
            assert [(e.node, e.in_fleet, e.engine_url) for e in nodes] == [
                (0, True, "http://10.0.0.1:8000"), (1, False, "")]
            if token:
                assert http.get("/nodes").status_code == 401
        # the client over HTTP, as a gateway in front of `kvprefetch serve` reads it
        from kvprefetch.controlplane.live.http_api import HttpServer

        with HttpServer(create_app(svc, bearer_token=token)) as srv, \
                connect(srv.url, token=token, tenant="t") as client:
            assert client.nodes().nodes == nodes


# -- on Ray: raylets that join and go ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.servers
def test_on_ray_a_raylet_that_joins_gets_requests_and_a_removed_one_none(
        valkey_server: Any, s3_server: Any, tmp_path: Any) -> None:
    ray = pytest.importorskip("ray")
    from kvptest.live_fleet import remote_config

    from kvprefetch.agents.agent import AgentConfig
    from kvprefetch.agents.stores.local import LocalTierConfig
    from kvprefetch.controlplane.live.ray_app import (
        NodeCandidate,
        Placement,
        deploy,
        ray_node_candidates,
    )

    remote = remote_config(valkey_server, s3_server, f"gwn-{time.time_ns()}")

    def agent(slot: int, candidate: NodeCandidate | None = None) -> AgentConfig:
        return AgentConfig(node=slot, node_name=f"gpu-{slot}", remote=remote,
                           dram=LocalTierConfig(path=str(tmp_path / f"tier-{slot}"),
                                                capacity_bytes=16 * MIB),
                           engine_url=f"http://node{slot}", status_interval_s=0)

    seen: list[tuple[str, dict[str, Any]]] = []
    with gpu_cluster() as (cluster, first):
        svc = ServiceConfig(fleet=FLEET, initial_nodes=1, node_names=("gpu-0", "gpu-1"))
        # the scheduler stays on the head, as `kvprefetch serve` places it: removing a
        # GPU node must not take the scheduler with it
        dep = deploy(svc, [agent(0)], [Placement(node_id=first.node_id)],
                     scheduler_placement=Placement(node_id=cluster.head_node.node_id))
        try:
            dep.watch_nodes(lambda: ray_node_candidates(resource="gpu_node"), agent,
                            interval_s=0.5)
            gateway = Gateway(GatewayConfig(upstreams=["http://node0"], tenant="t",
                                            nodes_refresh_s=0.2, route_deadline_s=2.0),
                              scheduler=connect(cluster.address, timeout_s=10, tenant="t"),
                              transport=httpx.ASGITransport(app=_fake_engine(seen)))

            async def scenario() -> None:
                async with _asking(gateway, seen, prompt=[1, 2]) as ask:
                    assert await ask("a") == "node0"
                    add_gpu_node(cluster)
                    assert await asyncio.to_thread(
                        wait_for, lambda: gateway.nodes.routable() == (0, 1), 60), \
                        ray.get(dep.scheduler.nodes.remote())
                    # the joined node gets requests: new sessions that arrive
                    # together spread over both (each one routed adds to its node's
                    # queue until it finishes)
                    before = len(seen)
                    await asyncio.gather(*(ask(f"new-{i}") for i in range(8)))
                    hosts = {host for host, _ in seen[before:]}
                    assert "node1" in hosts, hosts
                    cluster.remove_node(first)
                    assert await asyncio.to_thread(
                        wait_for, lambda: gateway.nodes.routable() == (1,), 60), \
                        ray.get(dep.scheduler.nodes.remote())
                    before = len(seen)
                    hosts_after = [await ask(s) for s in ("a", "new-0", "b", "c")]
                    assert hosts_after == ["node1"] * 4 and len(seen) == before + 4

            asyncio.run(scenario())
            assert dep.watcher is not None and dep.watcher.lost == 1
            summary = ray.get(dep.scheduler.summary.remote())
            assert summary["nodes_joined"] == 1 and summary["nodes_lost"] == 1
            assert gateway.metrics.routed.labels("load")._value.get() == 0
        finally:
            dep.shutdown()


class _Refusing(httpx.AsyncBaseTransport):
    """``inner``, but the engines named in ``hosts`` refuse the connection (gone)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, hosts: set[str]) -> None:
        self.inner = inner
        self.hosts = hosts
        self.refused = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.hosts:
            self.refused += 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_engine_refuses_the_connection_runs_on_another_node(
        stream: bool) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    transport = _Refusing(httpx.ASGITransport(app=_fake_engine(seen)), {"node1"})
    # no node listing: node 1 stays routable though its engine is gone
    gateway = Gateway(GatewayConfig(upstreams=["http://node0", "http://node1"],
                                    nodes_refresh_s=0), transport=transport)
    app = build_app(gateway)

    async def scenario() -> list[httpx.Response]:
        await gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway") as client:
                answers = []
                for i in range(8):
                    if stream:
                        body = {"model": "m", "stream": True,
                                "messages": [{"role": "user", "content": "hi"}]}
                        r = await client.post("/v1/chat/completions", json=body,
                                              headers={"X-Session-ID": f"s{i}"})
                    else:
                        r = await client.post("/v1/completions", json={
                            "model": "m", "prompt": [1, 2, 3]},
                            headers={"X-Session-ID": f"s{i}"})
                    answers.append(r)
                return answers
        finally:
            await gateway.close()

    answers = asyncio.run(scenario())
    assert [r.status_code for r in answers] == [200] * 8
    assert {r.headers["x-kvp-node"] for r in answers} == {"0"}
    assert {host for host, _ in seen} == {"node0"} and len(seen) == 8
    # some sessions were routed to node 1 (their name hashes there) and went to node 0
    assert transport.refused >= 1
    assert gateway.metrics.failovers._value.get() == transport.refused
    assert gateway.metrics.in_flight.labels("1")._value.get() == 0
    assert gateway.metrics.in_flight.labels("0")._value.get() == 0


def test_a_request_fails_when_every_engine_refuses() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    transport = _Refusing(httpx.ASGITransport(app=_fake_engine(seen)), {"node0", "node1"})
    gateway = Gateway(GatewayConfig(upstreams=["http://node0", "http://node1"],
                                    nodes_refresh_s=0), transport=transport)
    app = build_app(gateway)

    async def scenario() -> httpx.Response:
        await gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway") as client:
                return await client.post("/v1/completions",
                                         json={"model": "m", "prompt": [1, 2, 3]})
        finally:
            await gateway.close()

    answer = asyncio.run(scenario())
    assert answer.status_code == 502 and "refused" in answer.text
    assert transport.refused == 2 and seen == []


def test_a_stream_the_caller_never_read_is_released_once() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    gateway = Gateway(GatewayConfig(upstreams=["http://node0"], nodes_refresh_s=0),
                      transport=httpx.ASGITransport(app=_fake_engine(seen)))

    async def scenario() -> tuple[float, float, bool]:
        await gateway.start()
        try:
            body = {"model": "m", "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}
            node, response = await gateway.open_stream("chat/completions", 0, body)
            in_flight = gateway.metrics.in_flight.labels("0")._value.get()
            # the caller went before the first event: the response's background releases
            await gateway.release(node, response)
            await gateway.release(node, response)  # the stream's own end: nothing more
            return in_flight, gateway.metrics.in_flight.labels("0")._value.get(), \
                response.is_closed
        finally:
            await gateway.close()

    assert asyncio.run(scenario()) == (1.0, 0.0, True)
