"""``kvprefetch bench control-plane --modes ray-1,ray-1-sync`` run tiny: one scheduler actor
on a local Ray runtime through the Python client, with fire-and-forget events batched
(``ray-1``) and without (``ray-1-sync``); every event measured arrives, and a batched event
the scheduler refuses is counted, not dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.servers]


def test_bench_control_plane_ray_1_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    assert main(["bench", "control-plane", "--modes", "ray-1,ray-1-sync", "--sessions", "100",
                 "--events", "400", "--json", str(out), "--no-progress"]) == 0
    modes = json.loads(out.read_text())["modes"]
    for name in ("ray-1", "ray-1-sync"):
        m = modes[name]
        assert m["events"] == 400 and m["lost_events"] == 0
        assert m["events_per_s"] > 0 and 0 < m["route_p50_ms"] <= m["route_p99_ms"]
        assert m["bytes_per_session"] is None  # the actor's memory is not traced from here
        assert m["plan_p99_ms"] is not None  # the actor's control loop ran and was timed
    batching = modes["ray-1"]["batching"]
    # Every request_finished was queued (100 populating + 200 measured) and answered.
    assert batching["queued"] == 300 and batching["refused"] == 0
    assert batching["with_route"] + batching["batches"] >= 1
    assert modes["ray-1-sync"]["batching"] == {}


def test_a_refused_batched_event_is_counted_not_dropped() -> None:
    import ray

    from controlplane.base.config import default_fleet
    from controlplane.live.client import EventBatching, connect
    from controlplane.live.config import ServiceConfig
    from controlplane.live.ray_app import start_scheduler

    namespace = "kvprefetch-test-batching"
    ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        handle = start_scheduler(ServiceConfig(fleet=default_fleet("8b", 2)),
                                 namespace=namespace, with_agents=False)
        client = connect("auto", namespace=namespace, timeout_s=10.0,
                         batching=EventBatching(max_events=4, flush_interval_s=0.01))
        batcher = client.scheduler.batcher  # type: ignore[attr-defined]
        # Finished without ever starting: the scheduler refuses it.
        ack = client.request_finished("never-started", node=0, input_tokens=10)
        assert ack.accepted  # queued: its fate is known later
        assert client.route("s1", input_tokens=100).node is not None
        assert client.request_finished("s1", node=0, input_tokens=100).accepted
        batcher.flush(wait=True)
        assert batcher.stats.queued == 2 and batcher.stats.refused == 1
        client.close()
        ray.get(handle.close.remote(), timeout=10)
    finally:
        ray.shutdown()
