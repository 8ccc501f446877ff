"""A live fleet in process: agents move real bytes into the right node's tier, engines read
them, Valkey and S3 outages degrade to S3 and to recompute. (The same plain classes run as
Ray actors in test_ray.py.)"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from kvptest.live_fleet import build_local_fleet, remote_config

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.keys import payload, position_keys
from kvprefetch.controlplane.base.wire import TransferOrder

pytestmark = pytest.mark.servers
GIB = 1 << 30
MIB = 1 << 20
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def _seed(agent: PrefetchAgent, keys: list[str], nbytes: int = 64 * 1024) -> None:
    res = agent.store.put([(k, payload(k, nbytes)) for k in keys])
    assert all(r.ok for r in res)


def _agent(tmp: Path, valkey: EmbeddedValkey | None, s3: EmbeddedS3 | None,
           node: int = 0) -> PrefetchAgent:
    return PrefetchAgent(AgentConfig(
        node=node, dram=LocalTierConfig(path=str(tmp / f"dram{node}"), capacity_bytes=64 * MIB),
        remote=remote_config(valkey, s3, uuid.uuid4().hex[:8])))


def test_agent_executes_orders_idempotently_and_reports(
        tmp_path: Path, valkey_server: EmbeddedValkey, s3_server: EmbeddedS3) -> None:
    reports = []
    with _agent(tmp_path, valkey_server, s3_server) as agent:
        agent.set_reporter(reports.append)
        keys = position_keys("t", "s", 5 * 4096, 4096)
        _seed(agent, keys)
        order = TransferOrder(1, "t/s", 0, tuple(keys), 5 * 4096, 1, True, 0.0)
        agent.execute(order)
        agent.execute(order)  # the same id again: runs once
        report = agent.wait(1, timeout_s=10)
        assert report is not None and report.complete and report.keys_moved == 5
        assert report.bytes_moved == 5 * 64 * 1024 and report.ttlb_wall_s > 0
        assert sorted(agent.inventory()) == sorted(keys)
        time.sleep(0.1)
        assert len(reports) == 1
        # an order for a key that is nowhere: incomplete, reported, not raised
        agent.execute(TransferOrder(2, "t/x", 0, ("t/x/0",), 1, 1, True, 0.0))
        missing = agent.wait(2, timeout_s=10)
        assert missing is not None and not missing.complete and missing.keys_missed == 1
        # evict advice by session prefix leaves other sessions alone
        _seed(agent, ["t/other/0"])
        agent.execute(TransferOrder(3, "t/other", 0, ("t/other/0",), 1, 1, True, 0.0))
        assert agent.wait(3, timeout_s=10).complete  # type: ignore[union-attr]
        assert agent.evict(prefixes=("t/s/",)) == 5
        assert agent.inventory() == ("t/other/0",)


def test_valkey_down_agents_fall_back_to_s3(tmp_path: Path, s3_server: EmbeddedS3) -> None:
    with EmbeddedValkey() as valkey, _agent(tmp_path, valkey, s3_server) as agent:
        keys = position_keys("t", "v", 3 * 4096, 4096)
        _seed(agent, keys)  # write-through: in S3 and in Valkey
        valkey.kill()
        agent.execute(TransferOrder(1, "t/v", 0, tuple(keys), 3 * 4096, 1, False, 0.0))
        report = agent.wait(1, timeout_s=20)
        assert report is not None and report.complete, report
        assert sorted(agent.inventory()) == sorted(keys)


def test_prefetch_lands_on_the_predicted_node_and_the_engine_reads_it(
        tmp_path: Path, valkey_server: EmbeddedValkey, s3_server: EmbeddedS3) -> None:
    fleet = build_local_fleet(FLEET, valkey_server, s3_server, compression=200.0,
                              policy="predictive", tier_bytes=64 * MIB, predictor="hinted")
    try:
        svc = fleet.service
        node, first = fleet.serve("t", "s", 0, 60_000, 0, 100)
        assert first.written_bytes > 0
        # make the node forget it (books and tier), as pressure would
        fleet.agents[node].evict(prefixes=("t/s/",))
        svc.core.dram[node].remove("t/s")
        assert not any(k.startswith("t/s/") for k in fleet.agents[node].inventory())
        # the gateway says a tool runs for ~20 s: the scheduler prefetches to s's home
        svc.hint({"tenant": "t", "session_id": "s",
                  "hint": {"kind": "tool_running", "eta_s": 20.0}})
        deadline = time.time() + 10
        while time.time() < deadline and svc.stats.orders_done == 0:
            time.sleep(0.02)
        assert svc.stats.orders_done >= 1 and svc.stats.prefetch_bytes > 0
        other = 1 - node
        assert any(k.startswith("t/s/") for k in fleet.agents[node].inventory())
        assert not any(k.startswith("t/s/") for k in fleet.agents[other].inventory())
        node2, second = fleet.serve("t", "s", 1, 60_200, 60_100, 50)
        assert node2 == node
        assert second.local_tokens >= 57_344 and second.read_bytes > 0  # read, not recomputed
        assert svc.stats.lateness_s and svc.stats.lateness_s[-1] <= 0  # it was in time
    finally:
        fleet.close()


def test_remote_store_down_requests_complete_by_recompute(tmp_path: Path) -> None:
    valkey, s3 = EmbeddedValkey().start(), EmbeddedS3().start()
    fleet = build_local_fleet(FLEET, valkey, s3, compression=200.0, policy="ondemand",
                              tier_bytes=64 * MIB)
    try:
        node, _ = fleet.serve("t", "r", 0, 30_000, 0, 100)
        fleet.agents[node].evict(prefixes=("t/r/",))  # not local any more
        valkey.stop()
        s3.stop()
        _, res = fleet.serve("t", "r", 1, 30_200, 30_100, 50)
        assert res.error == "" and res.local_tokens == 0  # recomputed, still served
        assert res.first_token_wall_s > res.arrival_wall_s
    finally:
        fleet.close()
        valkey.stop()
        s3.stop()
