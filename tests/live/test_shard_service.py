"""A scheduler shard in process: its configuration holds its quota of each node, and it
refuses a session another shard owns."""

from __future__ import annotations

import pytest

from kvprefetch.controlplane.base.config import default_fleet
from kvprefetch.controlplane.base.errors import WrongShardError
from kvprefetch.controlplane.base.shards import ShardRing
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.service import SchedulerService

SESSIONS = [(f"t{i % 3}", f"session-{i}") for i in range(200)]


def test_a_shard_config_holds_its_quota_of_each_node() -> None:
    whole = ServiceConfig(fleet=default_fleet("8b", 4), journal_path="/j/journal.jsonl",
                          max_live_sessions_per_tenant=10, tenant_max_live_sessions={"a": 3})
    part = whole.for_shard(2, 4)
    assert (part.shard, part.shards) == (2, 4)
    node, whole_node = part.fleet.node, whole.fleet.node
    assert node.dram_tier_bytes == whole_node.dram_tier_bytes // 4
    assert node.hbm_kv_bytes == whole_node.hbm_kv_bytes  # the engine's: not divided
    assert part.fleet.planner.waste_allowance_gib == pytest.approx(
        whole.fleet.planner.waste_allowance_gib / 4)
    assert node.nic_gbps == pytest.approx(whole_node.nic_gbps / 4)
    assert part.fleet.remote.valkey_gbyte_s_per_node == pytest.approx(
        whole.fleet.remote.valkey_gbyte_s_per_node / 4)
    assert part.fleet.nodes == 4 and part.policy == whole.policy
    assert part.journal_path == "/j/journal.jsonl.shard2of4"
    assert part.max_live_sessions_per_tenant == 3 and part.tenant_max_live_sessions == {"a": 1}
    assert whole.for_shard(0, 1).fleet == whole.fleet
    # Shards that share each node's tier book the whole of it; the links stay divided.
    shared = whole.model_copy(update={"shard_tier": "shared"}).for_shard(2, 4)
    assert shared.fleet.node.dram_tier_bytes == whole_node.dram_tier_bytes
    assert shared.fleet.node.nic_gbps == pytest.approx(whole_node.nic_gbps / 4)
    with pytest.raises(ValueError, match="not one of 2 shards"):
        ServiceConfig(shard=2, shards=2)


def test_a_shard_refuses_a_session_it_does_not_own_and_serves_its_own() -> None:
    ring = ShardRing(2)
    mine = next(s for _, s in SESSIONS if ring.owner("default", s) == 1)
    other = next(s for _, s in SESSIONS if ring.owner("default", s) == 0)
    svc = SchedulerService(ServiceConfig(fleet=default_fleet("8b", 2)).for_shard(1, 2)).start()
    try:
        assert svc.epoch % 2 == 1
        assert ring.owner("default", mine) == 1
        assert svc.route({"session_id": mine, "input_tokens": 1000}).node is not None
        with pytest.raises(WrongShardError, match="belongs to shard 0 of 2"):
            svc.route({"session_id": other, "input_tokens": 1000})
        assert not svc.has_session("default", other)  # nothing was recorded
        assert svc.summary()["shard"] == 1
    finally:
        svc.close()
