"""The control plane on real Ray: placement on a two-raylet cluster, and fault tolerance
(agent killed mid-transfer, scheduler restarted) on a local runtime."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from kvptest.live_fleet import remote_config  # noqa: E402
from raycluster import two_raylets  # noqa: E402

from kvprefetch.agents.agent import AgentConfig  # noqa: E402
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey  # noqa: E402
from kvprefetch.agents.stores.local import LocalTierConfig  # noqa: E402
from kvprefetch.agents.transfer import TransferConfig  # noqa: E402
from kvprefetch.controlplane.base.actors import NAMESPACE, node_resource  # noqa: E402
from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.base.keys import payload, position_keys  # noqa: E402
from kvprefetch.controlplane.live.config import ServiceConfig  # noqa: E402
from kvprefetch.controlplane.live.connect import connect  # noqa: E402
from kvprefetch.controlplane.live.ray_app import Placement, deploy, local_placements  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.servers]
GIB = 1 << 30
MIB = 1 << 20
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
CHUNK = 4096
#: The chunks seeded here hold 256 KiB for 4,096 tokens, 64 bytes a token, against the 8B
#: model's 128 KiB: the agents' 128 MiB tiers are 256 GiB of booked bytes.
KV_SCALE = 1 / 2048


_TIER_DIRS: list[Path] = []


@pytest.fixture(autouse=True)
def _remove_tiers() -> Iterator[None]:
    yield
    while _TIER_DIRS:
        shutil.rmtree(_TIER_DIRS.pop(), ignore_errors=True)


def _configs(tmp: Path, valkey: EmbeddedValkey, s3: EmbeddedS3, *, journal: Path | None = None,
             limit_mib_s: float | None = None, time_compression: float = 100.0,
             kv_scale: float = KV_SCALE, status_interval_s: float = 5.0,
             tier_bytes: int = 128 * MIB) -> tuple[ServiceConfig, list[AgentConfig], Any]:
    prefix = uuid.uuid4().hex[:8]
    _TIER_DIRS.extend(Path("/dev/shm") / f"kvp-ray-{prefix}-{i}" for i in range(FLEET.nodes))
    remote = remote_config(valkey, s3, prefix)
    agents = [AgentConfig(node=i, node_name=f"gpu-{i}", remote=remote,
                          dram=LocalTierConfig(path=str(Path("/dev/shm") / f"kvp-ray-{prefix}-{i}"),
                                               capacity_bytes=tier_bytes),
                          transfer=TransferConfig(concurrency=2, bandwidth_limit_mib_s=limit_mib_s,
                                                  burst_bytes=256 * 1024),
                          kv_scale=kv_scale, status_interval_s=status_interval_s)
              for i in range(FLEET.nodes)]
    svc = ServiceConfig(fleet=FLEET, predictor="hinted", time_compression=time_compression,
                        chunk_tokens=CHUNK, journal_path=str(journal) if journal else None,
                        order_timeout_s=60)
    return svc, agents, remote


def _seed(remote: Any, tenant: str, sid: str, tokens: int, nbytes: int) -> list[str]:
    store = remote.build()
    store.start()
    try:
        keys = position_keys(tenant, sid, tokens, CHUNK)
        assert all(r.ok for r in store.put([(k, payload(k, nbytes)) for k in keys]))
        return keys
    finally:
        store.close()


def _prefetch_to(client: Any, dep: Any, node: int, tenant: str, sid: str, tokens: int,
                 eta_s: float = 30.0) -> None:
    """A finished turn on ``node`` (whose tier then loses it), then a hint: the scheduler
    must prefetch the session back to ``node``."""
    client.route(sid, input_tokens=tokens, tenant=tenant)
    client.request_finished(sid, node=node, input_tokens=tokens, tenant=tenant)
    ray.get(dep.agents[node].greet.remote())  # its inventory lacks the session: books drop it
    time.sleep(0.3)
    client.hint(sid, "tool_running", eta_s=eta_s, tenant=tenant)


def _wait(pred: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if pred():
                return True
        except Exception:  # an actor restarting answers with an error for a while
            pass
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[EmbeddedValkey, EmbeddedS3]]:
    with EmbeddedValkey() as v, EmbeddedS3() as s:
        yield v, s


def test_two_raylets_one_agent_per_node_and_prefetch_lands_on_b(
        tmp_path: Path, servers: tuple[EmbeddedValkey, EmbeddedS3]) -> None:
    valkey, s3 = servers
    with two_raylets(({"gpu_node": 1}, {"gpu_node": 1})) as address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        try:
            from kvprefetch.controlplane.live.ray_app import gpu_node_placements

            nodes = sorted(ray.nodes(), key=lambda n: n["NodeManagerAddress"])
            placements = [Placement(node_id=n["NodeID"]) for n in nodes]
            assert len(gpu_node_placements(resource="gpu_node")) == 2
            svc, agents, remote = _configs(tmp_path, valkey, s3)
            dep = deploy(svc, agents, placements)
            try:
                where = ray.get([a.where.remote() for a in dep.agents])
                assert [w["node_id"] for w in where] == [n["NodeID"] for n in nodes]
                assert [w["ip"] for w in where] == ["127.0.0.2", "127.0.0.3"]
                keys = _seed(remote, "t", "sb", 3 * CHUNK, 256 * 1024)
                client = connect(address, timeout_s=10)
                _prefetch_to(client, dep, 1, "t", "sb", 3 * CHUNK)
                assert _wait(lambda: all(ray.get(dep.agents[1].has.remote(keys))))
                assert not any(ray.get(dep.agents[0].has.remote(keys)))
                tier_b = Path(where[1]["tier_path"])
                assert len(list(tier_b.glob("*.kvp"))) == len(keys)
                assert not list(Path(where[0]["tier_path"]).glob("*.kvp"))
            finally:
                dep.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, object_store_memory=80 * MIB, include_dashboard=False,
             namespace=NAMESPACE, log_to_driver=False,
             resources={node_resource(i): 1.0 for i in range(FLEET.nodes)})
    try:
        yield
    finally:
        ray.shutdown()


def test_agent_killed_mid_transfer_is_restarted_and_the_scheduler_replans(
        tmp_path: Path, servers: tuple[EmbeddedValkey, EmbeddedS3], local_ray: None) -> None:
    valkey, s3 = servers
    svc, agents, remote = _configs(tmp_path, valkey, s3, limit_mib_s=4.0, time_compression=1.0)
    dep = deploy(svc, agents, local_placements(FLEET.nodes))
    try:
        keys = _seed(remote, "t", "k", 12 * CHUNK, 1 * MIB)  # 12 MiB at 4 MiB/s: ~3 s
        client = connect("auto", timeout_s=10)
        pid_before = ray.get(dep.agents[0].where.remote())["pid"]
        # The service clock runs at wall speed here: a hinted ETA's law is conditioned on
        # the silence, so at 100x the agent's restart (seconds of wall time) would outlast
        # the hint (the session is then taken not to come back: nothing to re-plan). The
        # prefetch starts a little before the 30 s ETA.
        _prefetch_to(client, dep, 0, "t", "k", 12 * CHUNK)
        assert _wait(lambda: ray.get(dep.agents[0].status.remote()).orders_in_flight > 0, 45)
        time.sleep(0.8)  # some chunks are in, some on the wire
        ray.kill(dep.agents[0], no_restart=False)
        assert _wait(lambda: ray.get(dep.agents[0].where.remote(), timeout=5)["pid"]
                     != pid_before, 60)
        # the new incarnation greeted the scheduler: the lost order is re-planned and done
        ok = _wait(lambda: all(ray.get(dep.agents[0].has.remote(keys))), 60)
        summary = ray.get(dep.scheduler.summary.remote())
        assert ok, ({k: v for k, v in summary.items() if k not in ("ttlb_s", "lateness_s")},
                    ray.get(dep.agents[0].status.remote()))
        assert summary["orders_lost"] >= 1 and summary["orders_done"] >= 1
        tier = Path(agents[0].dram.path)
        assert not list(tier.glob(".tmp-*"))  # no partial object left, none published
        from kvprefetch.agents.stores.format import decode_object

        published = list(tier.glob("*.kvp"))
        assert len(published) == len(keys)
        for f in published:  # every published chunk is whole and verifies
            decode_object(f.read_bytes())
    finally:
        dep.shutdown()


def test_scheduler_restart_resumes_from_the_journal(
        tmp_path: Path, servers: tuple[EmbeddedValkey, EmbeddedS3], local_ray: None) -> None:
    valkey, s3 = servers
    svc, agents, _ = _configs(tmp_path, valkey, s3, journal=tmp_path / "journal.jsonl")
    dep = deploy(svc, agents, local_placements(FLEET.nodes))
    try:
        client = connect("auto", timeout_s=10)
        for i in range(20):
            ans = client.route(f"s{i}", input_tokens=1000, tenant="acme")
            client.request_finished(f"s{i}", node=ans.node or 0, input_tokens=1000,
                                    output_tokens=10, tenant="acme")
        client.hint("s3", "user_typing", tenant="acme")
        ray.kill(dep.scheduler, no_restart=False)
        assert _wait(lambda: _alive(dep.scheduler), 60)
        assert _wait(lambda: all(ray.get(dep.scheduler.has_session.remote("acme", f"s{i}"))
                                 for i in range(20)), 30)
        assert client.hint("s7", "tool_running", eta_s=3.0, tenant="acme").accepted
        summary = ray.get(dep.scheduler.summary.remote())
        assert summary["sessions"] == 20
    finally:
        dep.shutdown()


def test_a_route_retried_after_the_scheduler_actor_restarts_is_answered_once(
        tmp_path: Path, local_ray: None) -> None:
    from kvprefetch.controlplane.live.ray_app import start_shards

    cfg = ServiceConfig(fleet=FLEET, journal_path=str(tmp_path / "journal.jsonl"))
    (actor,) = start_shards(cfg, 1, with_agents=False)
    try:
        with connect("auto", tenant="acme", timeout_s=30) as c:
            first = c.route("s1", input_tokens=4_000, request_id="r1")
            assert first.node is not None
            # The scheduler actor dies (its answer could have been lost with it); Ray
            # restarts it from the journal, and the new incarnation answers the retry.
            epoch = ray.get(actor.epoch.remote(), timeout=30)
            ray.kill(actor, no_restart=False)
            assert _wait(lambda: ray.get(actor.epoch.remote(), timeout=5) != epoch, 60)
            assert c.route("s1", input_tokens=4_000, request_id="r1") == first
            summary = ray.get(actor.summary.remote(), timeout=30)
            assert summary["events"] == 0 and summary["routes_remembered"] == 1
            assert c.cancel_route("s1", "r1").outcome == "cancelled"
            assert not ray.get(actor.has_session.remote("acme", "s1"), timeout=30)
    finally:
        ray.kill(actor, no_restart=True)


def _alive(handle: Any) -> bool:
    try:
        return bool(ray.get(handle.ping.remote(), timeout=5))
    except Exception:
        return False


def test_two_scheduler_shards_share_the_agents(
        tmp_path: Path, servers: tuple[EmbeddedValkey, EmbeddedS3], local_ray: None) -> None:
    """Each node's agent takes orders from both shards and reports each to the shard that
    issued it: sessions owned by either shard are prefetched, and each shard books its own
    orders done. Each agent's status reaches both shards on its timer: a tier of 8 GiB
    booked (128 MiB at kv_scale 1/64) gives each shard 4 GiB of the node, not the
    configured 8 GiB (16 GiB / 2)."""
    from kvprefetch.controlplane.base.shards import ShardRing
    from kvprefetch.controlplane.live.sharded import ShardedTransport

    valkey, s3 = servers
    svc, agents, remote = _configs(tmp_path, valkey, s3, kv_scale=1 / 64,
                                   status_interval_s=0.5)
    dep = deploy(svc, agents, local_placements(FLEET.nodes), shards=2)
    try:
        ring = ShardRing(2)
        sids = [next(f"sh{k}-{i}" for i in range(100) if ring.owner("t", f"sh{k}-{i}") == k)
                for k in (0, 1)]
        keys = {sid: _seed(remote, "t", sid, 3 * CHUNK, 256 * 1024) for sid in sids}
        client = connect("auto", timeout_s=10)
        assert isinstance(client.scheduler, ShardedTransport)
        for sid in sids:
            _prefetch_to(client, dep, 1, "t", sid, 3 * CHUNK)
        for sid in sids:
            assert _wait(lambda sid=sid: all(ray.get(dep.agents[1].has.remote(keys[sid]))))
        done = [ray.get(h.summary.remote())["orders_done"] for h in dep.schedulers]
        assert all(n >= 1 for n in done), done
        assert ray.get(dep.agents[1].status.remote()).stale_orders == 0

        def quotas() -> list[dict[str, int]]:
            return [ray.get(h.summary.remote())["tier_quota_bytes"] for h in dep.schedulers]

        assert _wait(lambda: quotas() == [{"node-0": 4 * GIB, "node-1": 4 * GIB}] * 2), quotas()
    finally:
        dep.shutdown()


def test_shards_sharing_a_tier_drop_what_it_evicts_from_their_books(
        tmp_path: Path, servers: tuple[EmbeddedValkey, EmbeddedS3], local_ray: None) -> None:
    """``shard_tier: shared``: both shards book node 1's whole tier (24 MiB at kv_scale
    1/256: 6 GiB, four 1.5 GiB sessions); eight sessions written there (four per shard)
    overfill it, and the agent actor tells each owner what its tier evicted."""
    from kvprefetch.controlplane.base.shards import ShardRing

    valkey, s3 = servers
    svc, agents, _ = _configs(tmp_path, valkey, s3, kv_scale=1 / 256, status_interval_s=0.5,
                              tier_bytes=24 * MIB)
    svc = svc.model_copy(update={"shard_tier": "shared"})
    dep = deploy(svc, agents, local_placements(FLEET.nodes), shards=2)
    try:
        ring = ShardRing(2)
        client = connect("auto", timeout_s=10)

        def summaries() -> list[dict[str, Any]]:
            return [ray.get(h.summary.remote()) for h in dep.schedulers]

        assert _wait(lambda: [s["tier_quota_bytes"]["node-1"] for s in summaries()]
                     == [6 * GIB] * 2), summaries()
        sids = [[s for s in (f"w{i}" for i in range(60)) if ring.owner("t", s) == k][:4]
                for k in (0, 1)]
        for sid in sids[0] + sids[1]:  # shard 0's first, the least recently written
            client.route(sid, input_tokens=3 * CHUNK, tenant="t")
            client.request_finished(sid, node=1, input_tokens=3 * CHUNK, tenant="t")
            keys = position_keys("t", sid, 3 * CHUNK, CHUNK)
            ray.get(dep.agents[1].write_local.remote([(k, payload(k, 2 * MIB)) for k in keys]))
        assert _wait(lambda: sum(s["tier_evictions"] for s in summaries()) >= 3), summaries()
        first = position_keys("t", sids[0][0], 3 * CHUNK, CHUNK)
        assert not all(ray.get(dep.agents[1].has.remote(first)))
        assert summaries()[0]["tier_evictions"] >= 1
        assert ray.get(dep.agents[1].status.remote()).used_bytes <= 24 * MIB
    finally:
        dep.shutdown()
