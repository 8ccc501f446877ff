"""A shard's quota of a node's DRAM tier follows what the node's agent reports:
the configured tier divided among the shards, lowered to the real capacity; what no longer
fits is evicted and the agent told. Shards may instead share the tier: each books all of
it, and what the tier evicts leaves its owner's books. A real agent (its tier on /dev/shm,
real Valkey behind it); the service in process, with 1 and 2 shards.

Hand-computed: the 8B model's KV is 128 KiB per token, so 8,192 tokens are 1 GiB; the
agent's 8 MiB tier at kv_scale 1/1024 is 8 GiB of booked bytes."""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvptest.live_fleet import remote_config

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent
from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.keys import payload, position_keys
from kvprefetch.controlplane.base.shards import ShardRing, split_tier_evictions
from kvprefetch.controlplane.base.wire import TransferOrder
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.metrics import PrometheusMetrics
from kvprefetch.controlplane.live.service import SchedulerService

MIB = 1 << 20
GIB_TOKENS = 8192
FLEET = fleet_from_dict({"nodes": 1, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


class EvictPort:
    """The node's agent as the service sees it: keeps the eviction advice."""

    def __init__(self) -> None:
        self.evicted: list[str] = []

    def execute(self, order: TransferOrder) -> None: ...

    def cancel(self, session_id: str, order_id: int) -> None: ...

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None:
        self.evicted.extend(prefixes)


@pytest.fixture
def agent(valkey_server: EmbeddedValkey) -> Iterator[PrefetchAgent]:
    tier = Path("/dev/shm") / f"kvp-quota-{uuid.uuid4().hex[:8]}"
    a = PrefetchAgent(AgentConfig(
        node=0, node_name="node-0", remote=remote_config(valkey_server, None, tier.name),
        dram=LocalTierConfig(path=str(tier), capacity_bytes=8 * MIB), kv_scale=1 / 1024))
    a.start()
    try:
        yield a
    finally:
        a.close()
        shutil.rmtree(tier, ignore_errors=True)


def _service(shard: int, shards: int) -> tuple[SchedulerService, EvictPort]:
    port = EvictPort()
    cfg = ServiceConfig(fleet=FLEET, policy="local-lru", predictor="last-gap",
                        chunk_tokens=4096).for_shard(shard, shards)
    svc = SchedulerService(cfg, agents={0: port})
    svc.start()
    return svc, port


def _serve(svc: SchedulerService, session: str, gib: int) -> None:
    tokens = gib * GIB_TOKENS
    assert svc.route({"tenant": "t", "session_id": session, "input_tokens": tokens}).node == 0
    svc.request_finished({"tenant": "t", "session_id": session, "node": 0,
                          "input_tokens": tokens, "output_tokens": 0})


def test_the_tier_quota_follows_the_agents_capacity_and_evicts_what_no_longer_fits(
        agent: PrefetchAgent) -> None:
    svc, port = _service(0, 1)
    svc.metrics = metrics = PrometheusMetrics()
    try:
        svc.agent_hello(agent.hello())
        for i in range(6):  # 6 x 2 GiB written through: 12 of the configured 16 GiB
            _serve(svc, f"s{i}", 2)
        before = svc.summary()
        assert before["tier_quota_bytes"] == {"node-0": 16 * GIB}
        assert svc.core.dram[0].used_bytes == 12 * GIB
        status = agent.status()
        assert status.booked_capacity_bytes == 8 * GIB
        svc.node_status(status)
        after = svc.summary()
        assert after["tier_quota_bytes"] == {"node-0": 8 * GIB}
        assert after["quota_changes"] == 1
        # 4 GiB over: the two least recently used sessions go, and the agent is told.
        assert svc.core.dram[0].used_bytes == 8 * GIB
        assert sorted(port.evicted) == ["t/s0/", "t/s1/"]
        # The same report again moves nothing; one of another incarnation is not its.
        svc.node_status(status)
        svc.node_status(dataclasses.replace(status, incarnation="gone", kv_scale=1 / 256))
        assert svc.summary()["quota_changes"] == 1
        # The configured tier stays the ceiling: a larger real tier does not raise it.
        svc.node_status(dataclasses.replace(status, kv_scale=1 / 4096))
        assert svc.summary()["tier_quota_bytes"] == {"node-0": 16 * GIB}
        assert b'kvprefetch_node_tier_quota_bytes{node="node-0"} 1.7179869184e+010' \
            in metrics.render()
    finally:
        svc.close()


def test_two_shards_split_the_reported_capacity_and_never_promise_more_together(
        agent: PrefetchAgent) -> None:
    ring = ShardRing(2)
    shards = [_service(k, 2) for k in range(2)]
    try:
        status = agent.status()
        for k, (svc, _) in enumerate(shards):
            assert svc.summary()["tier_quota_bytes"] == {"node-0": 8 * GIB}  # static 1/2
            sids = [s for s in (f"x{i}" for i in range(40)) if ring.owner("t", s) == k][:3]
            for sid in sids:  # 3 x 2 GiB in each shard's 8 GiB quota
                _serve(svc, sid, 2)
            svc.node_status(status)
        quotas = [svc.summary()["tier_quota_bytes"]["node-0"] for svc, _ in shards]
        assert quotas == [4 * GIB, 4 * GIB]
        assert sum(quotas) <= status.booked_capacity_bytes
        # Each shard evicted its own least recently used session to fit 4 GiB.
        for svc, port in shards:
            assert svc.core.dram[0].used_bytes == 4 * GIB
            assert len(port.evicted) == 1
    finally:
        for svc, _ in shards:
            svc.close()


def test_shards_sharing_the_tier_book_all_of_it_and_drop_what_the_tier_evicts(
        agent: PrefetchAgent) -> None:
    """``shard_tier: shared``: each shard books the node's whole reported tier; when their
    writes overfill it, the tier evicts by its own order (LRU) and each evicted session
    leaves its owner's books."""
    ring = ShardRing(2)
    shards = []
    for k in range(2):
        cfg = ServiceConfig(fleet=FLEET, policy="local-lru", predictor="last-gap",
                            chunk_tokens=4096, shard_tier="shared").for_shard(k, 2)
        svc = SchedulerService(cfg, agents={0: EvictPort()})
        svc.start()
        svc.agent_hello(agent.hello())
        shards.append(svc)
    try:
        status = agent.status()
        owned = {k: [s for s in (f"y{i}" for i in range(40)) if ring.owner("t", s) == k][:3]
                 for k in range(2)}
        for svc in shards:
            svc.node_status(status)
            assert svc.summary()["tier_quota_bytes"] == {"node-0": 8 * GIB}  # not 4 GiB
        # Shard 0's three 2 GiB sessions are written first, then shard 1's: 12 GiB booked
        # in all, 8 MiB of real tier (8 GiB booked) for them.
        chunk = 4096 * FLEET.model.kv_bytes_per_token // 1024
        for k in range(2):
            for sid in owned[k]:
                _serve(shards[k], sid, 2)
                keys = position_keys("t", sid, 2 * GIB_TOKENS, 4096)
                agent.write_local([(key, payload(key, chunk)) for key in keys])
        evicted = agent.take_evictions(1.0)
        assert evicted is not None and evicted.node == 0
        gone = set(evicted.sessions)
        # The least recently written went: shard 0's first sessions.
        assert f"t/{owned[0][0]}" in gone and f"t/{owned[1][-1]}" not in gone
        for sid in gone:
            keys = position_keys("t", sid.split("/")[1], 2 * GIB_TOKENS, 4096)
            assert not all(agent.has(keys))
        for shard, part in split_tier_evictions(evicted, ring).items():
            shards[shard].tier_evicted(part)
        for k, svc in enumerate(shards):
            held = {e.session_id for e in svc.core.dram[0]}
            mine = {f"t/{sid}" for sid in owned[k]}
            assert held == mine - gone, (k, held, gone)
            assert svc.summary()["tier_evictions"] == len(mine & gone)
        # A report of another incarnation changes nothing.
        shards[1].tier_evicted(dataclasses.replace(evicted, incarnation="gone",
                                                   sessions=(f"t/{owned[1][-1]}",)))
        assert f"t/{owned[1][-1]}" in {e.session_id for e in shards[1].core.dram[0]}
    finally:
        for svc in shards:
            svc.close()
