"""The simulator with the decisions split over scheduler shards (``kvprefetch sim
--shards N``): each session decided by the core it hashes to, each core planning with its
quota of every node, the physical fleet shared; one shard is the unsharded core."""

from __future__ import annotations

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.shards import ShardRing
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.sim.runner import SimOptions, run_policies
from kvprefetch.controlplane.sim.sharded_core import ShardedCore
from kvprefetch.controlplane.sim.simulator import Simulation, clamp_to_window
from kvprefetch.controlplane.traces import ArrivalOptions, bundled_trace_path, load_trace
from kvprefetch.predictors.registry import load

FLEET = fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 32 * GIB}})


def _trace():  # type: ignore[no-untyped-def]
    return clamp_to_window(
        load_trace(bundled_trace_path("claude-code"), limit_sessions=12,
                   arrivals=ArrivalOptions(session_rate_per_s=1 / 60), seed=0),
        FLEET.model.max_context_tokens)


def test_each_shard_decides_its_own_sessions_within_its_quota() -> None:
    trace = _trace()
    policy = POLICIES["predictive"]
    sim = Simulation(trace, FLEET, policy, load("default", trace=trace), shards=2)
    run = sim.run()
    core = sim.core
    assert isinstance(core, ShardedCore)
    ring = ShardRing(2)
    held_any = False
    for i, shard in enumerate(core.cores):
        assert all(t.capacity_bytes == 16 * GIB for t in shard.dram)
        held = {e.session_id for t in shard.dram for e in t}
        assert all(ring.owner("default", sid) == i for sid in held)
        held_any = held_any or bool(held)
    assert held_any
    owners = {ring.owner("default", s.session_id) for s in trace.sessions}
    assert owners == {0, 1}
    assert len(run.records) == trace.requests  # every request served


def test_one_shard_is_the_unsharded_core_and_the_report_names_the_shards() -> None:
    trace = _trace()
    policies = (POLICIES["ondemand"], POLICIES["predictive"])
    one = run_policies(trace, FLEET, policies, SimOptions()).to_dict()
    again = run_policies(trace, FLEET, policies, SimOptions(shards=1)).to_dict()
    two = run_policies(trace, FLEET, policies, SimOptions(shards=2)).to_dict()
    for r in (one, again, two):
        r["meta"].pop("wall_s")
    assert one == again and "shards" not in one["meta"]
    assert two["meta"]["shards"] == 2
    assert two["policies"] != one["policies"]  # half the room per shard: other decisions


def test_shards_that_share_the_tier_never_hold_more_than_it_together() -> None:
    """``--shared-tier``: each shard books the node's whole tier; after every call the
    node evicts least recently used first across the shards until their books fit."""
    trace = _trace()
    policy = POLICIES["predictive"]
    sim = Simulation(trace, FLEET, policy, load("default", trace=trace), shards=2,
                     shared_tier=True)
    core = sim.core
    assert isinstance(core, ShardedCore)
    fit = core._fit
    worst = [0]

    def checked(out, now_s):  # type: ignore[no-untyped-def]
        out = fit(out, now_s)
        for node in range(FLEET.nodes):
            together = sum(c.dram[node].used_bytes for c in core.cores)
            pinned = sum(e.nbytes for c in core.cores for e in c.dram[node] if e.pinned)
            worst[0] = max(worst[0], together - max(32 * GIB, pinned))
        return out

    core._fit = checked  # type: ignore[method-assign]
    run = sim.run()
    assert all(t.capacity_bytes == 32 * GIB for c in core.cores for t in c.dram)
    assert worst[0] <= 0  # never over the tier (unless arriving KV alone is)
    assert core.tier_evictions > 0  # the shards did overfill it, and it evicted
    assert len(run.records) == trace.requests
    with_quotas = run_policies(trace, FLEET, (policy,), SimOptions(shards=2)).to_dict()
    shared = run_policies(trace, FLEET, (policy,),
                          SimOptions(shards=2, shared_tier=True)).to_dict()
    assert shared["meta"]["shared_tier"] is True and "shared_tier" not in with_quotas["meta"]
    assert shared["policies"] != with_quotas["policies"]
