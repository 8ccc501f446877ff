"""A node that joins after start gets an agent without a restart and is warmed.

In process (no servers, no Ray): the service takes a node slot out of the fleet until its
agent says hello, then joins it and warms it; the journal brings the join back on resume;
the node watcher's slot assignment on fake ``ray.nodes()`` lists. On Ray
(``ray.cluster_utils.Cluster``, real Valkey and S3): a raylet added to the cluster gets
node 1's agent from the watcher, which is warmed with real bytes and routed to."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvptest.live_fleet import RecordingPort
from kvptest.ray_cluster import add_gpu_node, gpu_cluster, wait_for

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.wire import AgentHello
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
MIB = 1 << 20
CHUNK = 4096
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def _service(ports: dict[int, RecordingPort], journal: Path | None = None,
             **kw: Any) -> SchedulerService:
    cfg = ServiceConfig(fleet=FLEET, predictor="hinted", time_compression=100.0,
                        chunk_tokens=CHUNK, initial_nodes=1,
                        journal_path=str(journal) if journal else None, **kw)
    return SchedulerService(cfg, agents=ports).start()


def _served_then_lost(svc: SchedulerService, sids: list[str], tokens: int = 3 * CHUNK) -> None:
    """Each session finishes a turn on node 0, whose agent then reports an empty tier:
    their KV is local nowhere (only in the remote store)."""
    for sid in sids:
        answer = svc.route({"tenant": "t", "session_id": sid, "input_tokens": tokens})
        assert answer.node == 0  # node 1 is out of the fleet
        svc.request_finished({"tenant": "t", "session_id": sid, "node": 0,
                              "input_tokens": tokens})
    svc.agent_hello(AgentHello(0, "agent-0", "gpu-0"))


def test_config_bounds_initial_nodes() -> None:
    with pytest.raises(ValueError, match="initial_nodes=3 is more than"):
        ServiceConfig(fleet=FLEET, initial_nodes=3)
    with pytest.raises(ValueError):
        ServiceConfig(fleet=FLEET, initial_nodes=0)
    assert ServiceConfig(fleet=FLEET).nodes_at_start == 2
    assert ServiceConfig(fleet=FLEET, initial_nodes=1).nodes_at_start == 1


def test_an_out_node_joins_on_its_agents_hello_and_is_warmed() -> None:
    ports = {0: RecordingPort(), 1: RecordingPort()}
    with _service(ports) as svc:
        assert svc.summary()["nodes_out"] == ["node-1"]
        _served_then_lost(svc, ["a", "b", "c"])
        assert not ports[1].orders
        svc.agent_hello(AgentHello(1, "agent-1", "gpu-1"))
        summary = svc.summary()
        assert summary["nodes_joined"] == 1 and summary["nodes_out"] == []
        warmed = {o.session_id for o in ports[1].orders}
        assert warmed == {"t/a", "t/b", "t/c"}
        assert all(o.prefetch and o.node == 1 for o in ports[1].orders)
        assert summary["orders_in_flight"] == {"node-0": 0, "gpu-1": 3}  # named by its agent
        svc.agent_hello(AgentHello(1, "agent-1", "gpu-1"))  # a second hello is no new join
        assert svc.summary()["nodes_joined"] == 1
    # A session warmed there moved home: its next turn goes to node 1 (alone on node 1's
    # link, its KV lands as soon as node 0 could load it from the store; behind other
    # warms, node 0 may answer sooner)
    ports = {0: RecordingPort(), 1: RecordingPort()}
    with _service(ports) as svc:
        _served_then_lost(svc, ["a"])
        svc.agent_hello(AgentHello(1, "agent-1", "gpu-1"))
        assert [o.session_id for o in ports[1].orders] == ["t/a"]
        assert svc.route({"tenant": "t", "session_id": "a", "input_tokens": 4 * CHUNK}).node == 1


def test_resume_brings_back_the_joins_its_events_prove(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    ports = {0: RecordingPort(), 1: RecordingPort()}
    with _service(ports, journal) as svc:
        _served_then_lost(svc, ["a"])
        svc.agent_hello(AgentHello(1, "agent-1", "gpu-1"))
        assert svc.route({"tenant": "t", "session_id": "a", "input_tokens": 4 * CHUNK}).node == 1
        svc.request_finished({"tenant": "t", "session_id": "a", "node": 1,
                              "input_tokens": 4 * CHUNK})
    with _service({0: RecordingPort(), 1: RecordingPort()}, journal) as again:
        summary = again.summary()
        assert summary["nodes_out"] == [] and summary["nodes_joined"] == 0  # replayed
        assert again.core.local_tokens(1, "t/a") > 0  # the books of node 1 are back
    # A join that no journalled event proves stays out until the agent greets again.
    other = tmp_path / "other.jsonl"
    with _service({0: RecordingPort(), 1: RecordingPort()}, other) as svc:
        _served_then_lost(svc, ["z"])
        svc.agent_hello(AgentHello(1, "agent-1", "gpu-1"))
    with _service({0: RecordingPort(), 1: RecordingPort()}, other) as again:
        assert again.summary()["nodes_out"] == ["node-1"]
        again.agent_hello(AgentHello(1, "agent-1b", "gpu-1"))
        assert again.summary()["nodes_out"] == [] and again.summary()["nodes_joined"] == 1


# ---------------------------------------------------------------------------- the watcher
def _ray_node(node_id: str, resources: dict[str, float], alive: bool = True) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": alive, "Resources": resources, "Labels": {},
            "NodeManagerAddress": f"10.0.0.{node_id[-1]}"}


def test_watcher_gives_new_nodes_the_free_slots_and_ignores_them_once_full(
        caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("ray")
    from kvprefetch.controlplane.live.ray_app import NodeWatcher, ray_node_candidates

    nodes = [_ray_node("n1", {"GPU": 1}), _ray_node("n0", {"CPU": 4})]
    started: list[tuple[int, str]] = []
    fail = {"n3"}

    def start(slot: int, c: Any) -> None:
        if c.placement.node_id in fail:
            fail.discard(c.placement.node_id)
            raise TimeoutError("not ready")
        started.append((slot, c.placement.node_id))

    w = NodeWatcher(lambda: ray_node_candidates(nodes, resource="GPU"), start, capacity=3,
                    placed={"n1": 0})
    assert w.poll() == []  # n0 has no GPU, n1 is placed
    nodes += [_ray_node("n2", {"GPU": 1}), _ray_node("n3", {"GPU": 1}),
              _ray_node("n4", {"GPU": 1}, alive=False)]
    assert w.poll() == [1]  # n3's start failed: retried next time, slot 2 still free
    assert w.start_failures == 1 and started == [(1, "n2")]
    assert w.poll() == [2] and started[-1] == (2, "n3")
    nodes.append(_ray_node("n5", {"GPU": 1}))
    nodes.append(_ray_node("n6", {"GPU": 1}))
    with caplog.at_level("WARNING"):
        assert w.poll() == [] and w.poll() == []
    full = [r for r in caplog.records if "no free node slot" in r.getMessage()]
    assert len(full) == 1 and "n5" in full[0].getMessage()  # logged once
    assert w.placed == {"n1": 0, "n2": 1, "n3": 2} and w.joined == 2


def _local_node_candidates(nodes: list[dict[str, Any]], capacity: int) -> list[Any]:
    """One machine, many logical nodes: slot ``i`` is there when an alive Ray node has its
    custom resource (``node_resource(i)``), and must get that slot."""
    from kvprefetch.controlplane.base.actors import node_resource
    from kvprefetch.controlplane.live.ray_app import NodeCandidate, Placement, matching_nodes

    found = []
    for i in range(capacity):
        hit = matching_nodes(nodes, resource=node_resource(i))
        if hit:
            found.append(NodeCandidate(Placement(resource=node_resource(i)), i, hit[0]))
    return found


def test_local_variant_takes_the_slot_its_resource_names() -> None:
    pytest.importorskip("ray")
    from kvprefetch.controlplane.base.actors import node_resource
    from kvprefetch.controlplane.live.ray_app import assign_slots

    nodes = [_ray_node("n1", {node_resource(0): 1, node_resource(2): 1}),
             _ray_node("n2", {node_resource(5): 1})]
    found = _local_node_candidates(nodes, capacity=3)
    assert [c.slot for c in found] == [0, 2]
    joins, refused = assign_slots(found, {node_resource(0): 0}, 3)
    assert [(slot, c.placement.resource) for slot, c in joins] == [(2, node_resource(2))]
    assert refused == []
    joins, refused = assign_slots(found, {"x": 2}, 3)  # its slot is taken
    assert [slot for slot, _ in joins] == [0] and [c.slot for c in refused] == [2]


def test_serve_config_leaves_slots_for_nodes_that_join() -> None:
    from pydantic import ValidationError

    from kvprefetch.controlplane.cli.serve_config import ServeConfig

    base: dict[str, Any] = {"stores": {"valkey": {"host": "127.0.0.1", "port": 6379}},
                            "agent": {"tier_capacity_bytes": 64 * MIB}}
    cfg = ServeConfig.model_validate({**base, "placement": {"max_nodes": 4}})
    assert cfg.placement.watch_interval_s == 5.0
    svc = cfg.service_config(["10.0.0.1", "10.0.0.2", "node-2", "node-3"], 2)
    assert svc.fleet.nodes == 4 and svc.nodes_at_start == 2
    assert cfg.service_config(["a"]).nodes_at_start == 1
    with pytest.raises(ValidationError, match="initial_nodes"):
        ServeConfig.model_validate({**base, "service": {"initial_nodes": 1}})


# ---------------------------------------------------------------------------- on Ray
@pytest.fixture
def tiers() -> Iterator[list[Path]]:
    dirs: list[Path] = []
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.servers
def test_a_raylet_that_joins_gets_an_agent_and_is_warmed(
        valkey_server: Any, s3_server: Any, tiers: list[Path]) -> None:
    ray = pytest.importorskip("ray")
    from kvptest.live_fleet import remote_config

    from kvprefetch.agents.agent import AgentConfig
    from kvprefetch.agents.stores.local import LocalTierConfig
    from kvprefetch.agents.transfer import TransferConfig
    from kvprefetch.controlplane.base.actors import agent_name
    from kvprefetch.controlplane.base.keys import payload, position_keys
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.ray_app import (
        NodeCandidate,
        Placement,
        deploy,
        ray_node_candidates,
    )

    prefix = uuid.uuid4().hex[:8]
    remote = remote_config(valkey_server, s3_server, prefix)

    def agent(slot: int, candidate: NodeCandidate | None = None) -> AgentConfig:
        tiers.append(Path("/dev/shm") / f"kvp-join-{prefix}-{slot}")
        return AgentConfig(node=slot, node_name=f"gpu-{slot}", remote=remote,
                           dram=LocalTierConfig(path=str(tiers[-1]), capacity_bytes=64 * MIB),
                           transfer=TransferConfig(concurrency=2),
                           kv_scale=1 / 2048)  # 256 KiB chunks of 4,096 tokens, 8B model

    sids = ["a", "b", "c"]
    store = remote.build()
    store.start()
    try:
        keys = {sid: position_keys("t", sid, 3 * CHUNK, CHUNK) for sid in sids}
        for ks in keys.values():
            assert all(r.ok for r in store.put([(k, payload(k, 256 * 1024)) for k in ks]))
    finally:
        store.close()

    t0 = time.monotonic()
    with gpu_cluster() as (cluster, first):
        # No prefetch before the join (the sessions' forecasts are below this confidence):
        # the sessions node 0 lost are adrift when node 1 joins.
        fleet = FLEET.model_copy(update={"planner": FLEET.planner.model_copy(
            update={"min_confidence": 0.7})})
        svc = ServiceConfig(fleet=fleet, predictor="hinted", time_compression=100.0,
                            chunk_tokens=CHUNK, initial_nodes=1, order_timeout_s=60)
        dep = deploy(svc, [agent(0)], [Placement(node_id=first.node_id)])
        try:
            dep.watch_nodes(lambda: ray_node_candidates(resource="gpu_node"), agent,
                            interval_s=0.5)
            client = connect(cluster.address, timeout_s=10)
            for sid in sids:  # served on node 0, whose tier then turns out empty
                assert client.route(sid, input_tokens=3 * CHUNK, tenant="t").node == 0
                client.request_finished(sid, node=0, input_tokens=3 * CHUNK, tenant="t")
            ray.get(dep.agents[0].greet.remote())
            assert wait_for(lambda: ray.get(dep.scheduler.summary.remote())["events"] == 6, 10)
            setup_s = time.monotonic() - t0

            joined = add_gpu_node(cluster)
            t_join = time.monotonic()
            assert wait_for(lambda: ray.get_actor(agent_name(1), namespace="kvprefetch"), 30), \
                "no agent for node 1"
            new_agent = ray.get_actor(agent_name(1), namespace="kvprefetch")
            where = ray.get(new_agent.where.remote(), timeout=30)
            assert where["node_id"] == joined.node_id and where["node"] == 1
            all_keys = [k for ks in keys.values() for k in ks]
            assert wait_for(lambda: all(ray.get(new_agent.has.remote(all_keys))), 30), \
                ray.get(dep.scheduler.summary.remote())
            warm_s = time.monotonic() - t_join
            summary = ray.get(dep.scheduler.summary.remote())
            assert summary["nodes_joined"] == 1 and summary["nodes_out"] == []
            assert summary["orders_done"] >= len(sids) and summary["prefetch_bytes"] >= \
                len(all_keys) * 256 * 1024
            assert not any(ray.get(dep.agents[0].has.remote(all_keys)))
            assert len(list(Path(where["tier_path"]).glob("*.kvp"))) == len(all_keys)
            answer = client.route("b", input_tokens=4 * CHUNK, tenant="t")
            assert answer.node == 1 and answer.node_name == "gpu-1" and answer.local_ready
            assert dep.watcher is not None and dep.watcher.joined == 1
            print(f"cluster + deploy + 3 sessions: {setup_s:.1f} s; raylet added -> agent "
                  f"up and warmed: {warm_s:.1f} s")
        finally:
            dep.shutdown()
            assert dep.watcher is not None and not dep.watcher.running


@pytest.mark.slow
@pytest.mark.servers
def test_an_agent_joins_once_its_engine_registered_with_lmcache(
        valkey_server: Any, s3_server: Any, tiers: list[Path]) -> None:
    """A raylet joins whose LMCache server has no engine yet (its vLLM still loads): its
    agent starts but says no hello, so the node stays out of the fleet (no route, no
    warm-up that LMCache would refuse); once an engine registers the model's KV layout
    (a real ``lmcache server``, an emulated engine worker) the agent says hello and the
    node joins."""
    ray = pytest.importorskip("ray")
    from kvptest.live_fleet import remote_config

    from kvprefetch.agents.agent import AgentConfig
    from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
    from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
    from kvprefetch.agents.lmcache.mp_client import KVLayout, LMCacheMPClient
    from kvprefetch.agents.lmcache.server import LMCacheServer
    from kvprefetch.agents.stores.local import LocalTierConfig
    from kvprefetch.controlplane.base.actors import agent_name
    from kvprefetch.controlplane.live.ray_app import (
        NodeCandidate,
        Placement,
        deploy,
        ray_node_candidates,
    )

    prefix = uuid.uuid4().hex[:8]
    remote = remote_config(valkey_server, s3_server, prefix)
    layout = KVLayout(model_name=f"kvp-join-{prefix}")
    lm_chunk = 256
    with LMCacheServer(l2_adapter=plugin_adapter_json(valkey=remote.valkey, s3=remote.s3),
                       chunk_size=lm_chunk, l1_size_gb=0.1,
                       transfer_mode="engine_driven") as server:
        def agent(slot: int, candidate: NodeCandidate | None = None) -> AgentConfig:
            if slot == 0:
                tiers.append(Path("/dev/shm") / f"kvp-join-{prefix}-0")
                return AgentConfig(node=0, node_name="gpu-0", remote=remote,
                                   dram=LocalTierConfig(path=str(tiers[-1]),
                                                        capacity_bytes=16 * MIB))
            return AgentConfig(node=slot, node_name=f"gpu-{slot}", backend="lmcache-mp",
                               remote=remote, status_interval_s=0,
                               lmcache=LMCacheBackendConfig(
                                   http_url=server.http_url, model_name=layout.model_name,
                                   chunk_size=lm_chunk,
                                   chunk_bytes=layout.chunk_bytes(lm_chunk)))

        with gpu_cluster() as (cluster, first):
            svc = ServiceConfig(fleet=FLEET, initial_nodes=1)
            dep = deploy(svc, [agent(0)], [Placement(node_id=first.node_id)])
            try:
                dep.watch_nodes(lambda: ray_node_candidates(resource="gpu_node"), agent,
                                interval_s=0.5)
                add_gpu_node(cluster)
                assert wait_for(lambda: ray.get_actor(agent_name(1), namespace="kvprefetch"),
                             60), "no agent for node 1"
                assert wait_for(lambda: dep.watcher is not None and dep.watcher.joined == 1, 60)
                time.sleep(3.0)  # the agent asks its server every second
                summary = ray.get(dep.scheduler.summary.remote())
                assert summary["nodes_joined"] == 0 and summary["nodes_out"] == ["node-1"]
                with LMCacheMPClient(server.host, server.port, layout, chunk_size=lm_chunk):
                    assert wait_for(lambda: ray.get(dep.scheduler.summary.remote())[
                        "nodes_joined"] == 1, 30), ray.get(dep.scheduler.summary.remote())
                summary = ray.get(dep.scheduler.summary.remote())
                assert summary["nodes_out"] == []
            finally:
                dep.shutdown()
