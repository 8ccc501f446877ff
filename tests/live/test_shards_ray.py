"""Scheduler shards on a local Ray runtime: the client finds every shard and sends each
session's calls to its owner; a batch of routes spans shards and answers in order; a
shard killed in the middle of ``kvprefetch bench control-plane`` is restarted by Ray,
resumes from its journal segment, and no event is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprefetch.controlplane.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.servers]


def test_sessions_go_to_their_owning_shard() -> None:
    import httpx
    import ray

    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.base.errors import WrongShardError
    from kvprefetch.controlplane.base.shards import ShardRing
    from kvprefetch.controlplane.live.client import RayTransport
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.http_api import HttpServer, create_app
    from kvprefetch.controlplane.live.ray_app import start_shards
    from kvprefetch.controlplane.live.sessions import SessionQuery
    from kvprefetch.controlplane.live.sharded import ShardedTransport

    namespace = "kvprefetch-test-shards"
    ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        handles = start_shards(ServiceConfig(fleet=default_fleet("8b", 2)), 2,
                               namespace=namespace, with_agents=False)
        client = connect("auto", namespace=namespace, timeout_s=10.0)
        transport = client.scheduler
        assert isinstance(transport, ShardedTransport)
        ring = ShardRing(2)
        sids = [f"s{i}" for i in range(24)]
        answers = client.route_many([{"session_id": s, "input_tokens": 1000 + i}
                                     for i, s in enumerate(sids)])
        assert len(answers) == 24 and all(a.node is not None for a in answers)
        owners = [ring.owner("default", s) for s in sids]
        assert set(owners) == {0, 1}
        for s, owner in zip(sids, owners, strict=True):
            held = [ray.get(h.has_session.remote("default", s)) for h in handles]
            assert held == [owner == 0, owner == 1]
            assert client.request_finished(s, node=0, input_tokens=1000).accepted
        summary = transport.summary()
        assert summary["shards"] == 2 and len(summary["per_shard"]) == 2
        assert transport.sessions() == 24
        # The HTTP front over the sharded client: one hop to the owner as well.
        with HttpServer(create_app(client, bearer_token=None)) as srv:
            for sid in ("http-a", "http-b", "http-c", "http-d"):
                r = httpx.post(f"{srv.url}/v1/route",
                               json={"session_id": sid, "input_tokens": 500}, timeout=10)
                assert r.status_code == 200 and r.json()["node"] is not None
                owner = ring.owner("default", sid)
                assert ray.get(handles[owner].has_session.remote("default", sid))
                assert not ray.get(handles[1 - owner].has_session.remote("default", sid))
        # A client that ignores the shards (shard 0 only) is refused, not half-served.
        stray = next(s for s, o in zip(sids, owners, strict=True) if o == 1)
        lone = RayTransport("auto", namespace, timeout_s=10.0)
        with pytest.raises(WrongShardError):
            lone.session_state(SessionQuery(session_id=stray))
        client.close()
        ray.get([h.close.remote() for h in handles], timeout=10)
    finally:
        ray.shutdown()


def test_bench_kills_a_shard_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    assert main(["bench", "control-plane", "--modes", "ray-2", "--sessions", "200",
                 "--events", "2000", "--concurrency", "16", "--speedup", "1",
                 "--kill-shard", "1", "--json", str(out), "--no-progress"]) == 0
    m = json.loads(out.read_text())["modes"]["ray-2"]
    assert m["shards"] == 2 and m["events"] == 2000
    assert m["lost_events"] == 0
    kill = m["kill"]
    assert kill["shard"] == 1
    assert kill["restart_s"] is not None and 0 < kill["restart_s"] < 30
    by_shard = kill["route_p99_ms_by_shard"]
    assert set(by_shard) == {"0", "1"}
    assert all(v["before"] > 0 and v["after"] > 0 for v in by_shard.values())
    # The client re-sent what the dead incarnation never answered, or had nothing queued.
    assert m["batching"]["refused"] == 0
    # The killed shard's CPU is not comparable across its restart; the other's is counted.
    assert m["cpu_s"]["shard-1"] is None and m["cpu_s"]["shard-0"] > 0
    assert m["events_per_shard_cpu_s"] is None
