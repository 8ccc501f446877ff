"""The engine's HBM in the scheduler's books: an agent's :class:`HbmReport` (vLLM's KV
events, mapped to sessions) moves the node's HBM mirror, which routing counts as local;
under an engine profile with demote-on-evict (``vllm-lmcache-lazy``) a session HBM evicts
is booked into the node's DRAM tier, where the engine writes it then; a full listing
replaces the mirror; a sharded deployment hands each shard its own sessions."""

from __future__ import annotations

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.shards import ShardRing, split_hbm_report
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import HbmReport
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
CTX = 1100


def _service(**kw: object) -> SchedulerService:
    return SchedulerService(ServiceConfig(fleet=FLEET, **kw)).start()  # type: ignore[arg-type]


def _finish_in_hbm(svc: SchedulerService, sid: str) -> int:
    """A turn of ``sid`` whose engine reports the context in HBM before it finishes."""
    c = connect(service=svc, tenant="acme")
    node = c.route(sid, input_tokens=1000, reused_tokens=0).node
    assert node is not None
    wire = SessionKey("acme", sid).wire
    svc.hbm_changed(HbmReport(node, "", ((wire, CTX),)))
    c.request_finished(sid, node=node, input_tokens=1000, output_tokens=100)
    return node


def test_an_hbm_eviction_under_lazy_offload_books_the_dram_copy() -> None:
    with _service(engine="vllm-lmcache-lazy") as svc:
        assert svc.policy.demote_on_evict
        node = _finish_in_hbm(svc, "s1")
        wire = SessionKey("acme", "s1").wire
        core = svc.driver.core
        assert svc.fleet.hbm_tokens(node, wire) == CTX
        assert core.dram_tokens(node, wire) == 0  # HBM holds it: nothing written yet
        assert core.local_tokens(node, wire) == CTX
        svc.hbm_changed(HbmReport(node, "", ((wire, 0),)))
        assert svc.fleet.hbm_tokens(node, wire) == 0
        assert core.dram_tokens(node, wire) == CTX  # written to L1 as HBM evicted it
        assert svc.summary()["hbm_evictions"] == 1


def test_an_hbm_eviction_on_a_write_through_engine_only_moves_the_mirror() -> None:
    with _service(engine="vllm-lmcache") as svc:
        assert not svc.policy.demote_on_evict
        node = _finish_in_hbm(svc, "s1")
        wire = SessionKey("acme", "s1").wire
        core = svc.driver.core
        assert core.dram_tokens(node, wire) == CTX  # written through at the finish
        svc.hbm_changed(HbmReport(node, "", ((wire, 0),)))
        assert svc.fleet.hbm_tokens(node, wire) == 0
        assert core.dram_tokens(node, wire) == CTX


def test_hbm_counted_in_whole_blocks_holds_the_context_up_to_its_partial_block() -> None:
    """vLLM caches whole blocks only: 8 blocks of 128 (1,024 tokens) of an 1,100-token
    context are all of it HBM keeps, so under lazy offload nothing is written at the
    finish; 7 blocks are not."""
    with _service(engine="vllm-lmcache-lazy") as svc:
        c = connect(service=svc, tenant="acme")
        core = svc.driver.core
        for sid, blocks in (("whole", 8), ("short", 7)):
            node = c.route(sid, input_tokens=1000, reused_tokens=0).node
            assert node is not None
            wire = SessionKey("acme", sid).wire
            svc.hbm_changed(HbmReport(node, "", ((wire, blocks * 128),), block_tokens=128))
            c.request_finished(sid, node=node, input_tokens=1000, output_tokens=100)
            assert core.dram_tokens(node, wire) == (0 if blocks == 8 else CTX), sid


def test_a_full_listing_replaces_the_mirror_and_another_incarnation_is_ignored() -> None:
    with _service() as svc:
        node = _finish_in_hbm(svc, "s1")
        a, b = SessionKey("acme", "s1").wire, SessionKey("acme", "s2").wire
        svc.hbm_changed(HbmReport(node, "", ((b, 512),), full=True))
        assert svc.fleet.nodes[node].hbm == {b: 512}
        assert svc.summary()["hbm_resyncs"] == 1
        svc.fleet.nodes[node].incarnation = "now"
        svc.hbm_changed(HbmReport(node, "before", ((a, 64),), full=True))
        assert svc.fleet.nodes[node].hbm == {b: 512}


def test_each_shard_gets_its_sessions_and_every_shard_a_listing() -> None:
    ring = ShardRing(4)
    sids = [SessionKey("t", f"s{i}").wire for i in range(40)]
    report = HbmReport(1, "inc", tuple((s, 16) for s in sids))
    parts = split_hbm_report(report, ring)
    assert sorted(s for p in parts.values() for s, _ in p.sessions) == sorted(sids)
    for shard, part in parts.items():
        for s, _ in part.sessions:
            key = SessionKey.parse(s)
            assert ring.owner(key.tenant, key.session_id) == shard
    listing = split_hbm_report(HbmReport(1, "inc", (), full=True), ring)
    assert sorted(listing) == [0, 1, 2, 3] and all(p.full for p in listing.values())
