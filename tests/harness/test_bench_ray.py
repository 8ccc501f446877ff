"""``kvprefetch bench control-plane --modes ray-1,ray-1-sync`` run tiny: one scheduler actor
on a local Ray runtime through the Python client, with fire-and-forget events batched
(``ray-1``) and without (``ray-1-sync``); every event measured arrives, and a batched event
the scheduler refuses is counted, not dropped."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvprefetch.controlplane.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.servers]


def test_bench_control_plane_ray_1_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
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
        # The shard actor's CPU while measuring, and this process's (the generator's).
        assert set(m["cpu_s"]) == {"shard-0", "generator"}
        assert m["cpu_s"]["shard-0"] > 0 and m["cpu_s"]["generator"] > 0
        assert m["events_per_shard_cpu_s"] == pytest.approx(400 / m["cpu_s"]["shard-0"])
    assert "ray-1: cores busy while measuring: shard-0 " in capsys.readouterr().out
    batching = modes["ray-1"]["batching"]
    # Every request_finished was queued (100 populating + 200 measured) and answered.
    assert batching["queued"] == 300 and batching["refused"] == 0
    assert batching["with_route"] + batching["batches"] >= 1
    assert modes["ray-1-sync"]["batching"] == {}


def test_bench_control_plane_http_from_a_separate_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--modes http,http-batch,http-actor,http-threaded``: the API as serve runs it (in
    its own process or the scheduler actor's), the load from a child process at each
    caller count (``http-batch``: the finishes in batches); every event arrives, each
    count has its row, and the server side's CPU per event is reported."""
    out = tmp_path / "cp.json"
    assert main(["bench", "control-plane", "--modes",
                 "http,http-batch,http-actor,http-threaded",
                 "--sessions",
                 "40", "--events", "200", "--callers", "1,8", "--json", str(out),
                 "--no-progress"]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["callers"] == [1, 8]
    for name in ("http", "http-batch", "http-actor", "http-threaded"):
        m = result["modes"][name]
        assert set(m["cpu_s"]) == {"shard-0", "serve-process"}
        assert m["server_events"] == 80 + 400 and m["server_cpu_ms_per_event"] > 0
        assert f"{name}: server CPU per event " in table
        assert set(m["callers"]) == {"1", "8"}
        assert m["events"] == 400 and m["lost_events"] == 0
        for level in m["callers"].values():
            assert level["events"] == 200 and level["lost_events"] == 0
            assert 0 < level["route_p50_ms"] <= level["route_p99_ms"]
            assert level["events_per_s"] > 0 and level["generator_cores"] >= 0
        assert m["events_per_s"] == m["callers"]["8"]["events_per_s"]  # the last count's
        assert f"{name} x8 " in table
    # http-batch's finishes went in batches (from 8 callers, fewer calls than finishes:
    # their routes are answered together), http's one each.
    for level in result["modes"]["http-batch"]["callers"].values():
        assert 1 <= level["event_batches"] <= level["events"] // 2
    eight = result["modes"]["http-batch"]["callers"]["8"]
    assert eight["event_batches"] < eight["events"] // 2
    assert all(level["event_batches"] == 0
               for level in result["modes"]["http"]["callers"].values())
    # Only the async path queues events and coalesces routes.
    assert result["modes"]["http"]["batching"]["queued"] > 0
    assert result["modes"]["http-threaded"]["batching"] == {}


@contextmanager
def _batching_client(namespace: str, max_events: int, flush_interval_s: float
                     ) -> Iterator[Any]:
    """One scheduler actor (no agents) on a fresh local Ray runtime, and a batching Python
    client of it; the actor closed and Ray shut down after."""
    import ray

    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.live.client import EventBatching
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.ray_app import start_shards

    ray.init(namespace=namespace, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        (handle,) = start_shards(ServiceConfig(fleet=default_fleet("8b", 2)), 1,
                                 namespace=namespace, with_agents=False)
        client = connect("auto", namespace=namespace, timeout_s=30.0,
                         batching=EventBatching(max_events=max_events,
                                                flush_interval_s=flush_interval_s))
        yield client
        client.close()
        ray.get(handle.close.remote(), timeout=10)
    finally:
        ray.shutdown()


def test_a_refused_batched_event_is_counted_not_dropped() -> None:
    with _batching_client("kvprefetch-test-batching", 4, 0.01) as client:
        batcher = client.scheduler.batcher
        # Finished without ever starting: the scheduler refuses it.
        ack = client.request_finished("never-started", node=0, input_tokens=10)
        assert ack.accepted  # queued: its fate is known later
        assert client.route("s1", input_tokens=100).node is not None
        assert client.request_finished("s1", node=0, input_tokens=100).accepted
        batcher.flush(wait=True)
        assert batcher.stats.queued == 2 and batcher.stats.refused == 1


def test_gateway_threads_sharing_a_client_keep_each_session_s_events_in_order() -> None:
    """Two threads route and finish their own sessions through one batching client: a
    route of one thread never overtakes the queued finish (of the same session) another
    thread's route carries. Overtaken, the route would find its session still running
    and record no request_started: the scheduler would count fewer events than 2 per
    turn."""
    with _batching_client("kvprefetch-test-lanes", 64, 0.002) as client:
        # Every other call paused between taking the queued events and sending them (as
        # the GIL may pause a thread there): the other thread must not get its own route
        # out meanwhile.
        transport = client.scheduler
        real = transport._handle
        calls = itertools.count()

        class _Slow:
            def __getattr__(self, name: str) -> object:
                return getattr(real, name)

            class route_many_after:  # the actor method's name
                @staticmethod
                def remote(*args: object) -> object:
                    if next(calls) % 2:
                        time.sleep(0.006)
                    return real.route_many_after.remote(*args)

        transport._handle = _Slow()
        turns = 100
        errors: list[BaseException] = []

        def lane(j: int) -> None:
            try:
                for k in range(turns):
                    sids = [f"lane{j}-s{i}" for i in range(4)]
                    answers = client.route_many([{"session_id": sid, "input_tokens": 100 + k}
                                                 for sid in sids])
                    for sid, ans in zip(sids, answers, strict=True):
                        assert ans.node is not None
                        client.request_finished(sid, node=ans.node, input_tokens=100 + k)
                    time.sleep(0.001 * (1 + j))  # the finishes wait queued a while
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=lane, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        client.scheduler.batcher.flush(wait=True)
        summary = client.scheduler.summary()
        assert summary["routes"] == 2 * 4 * turns
        assert summary["events"] == 2 * summary["routes"], summary["events"]
        assert client.scheduler.batcher.stats.refused == 0
