"""Per-tenant shares enforced by the scheduling core: a tenant over its share of a
node's local tier loses its own sessions first, never another tenant's, and KV it cannot
make room for among its own is not kept; a tenant's prefetches start no faster than its
share of the node's NIC. The other tenant is unaffected. Hand-computed numbers: the 8B
model's KV is 128 KiB per token, so 8,192 tokens are exactly 1 GiB."""

from __future__ import annotations

import pytest
from fleet_fakes import FakeFleet

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.quotas import TenantQuota
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.predictors.registry import load

GIB_TOKENS = 8192  # 1 GiB of 8B KV


def _core(policy: str, quotas: dict[str, TenantQuota] | None) -> SchedulerCore:
    fleet = fleet_from_dict({"nodes": 1, "node": {"dram_tier_bytes": 10 * GIB,
                                                  "nic_gbps": 100}})
    return SchedulerCore(fleet, POLICIES[policy], load("last-gap"), FakeFleet(),  # type: ignore[arg-type]
                         tenant_quotas=quotas)


def _finish(core: SchedulerCore, tenant: str, sid: str, t: float, gib: int) -> StepOutput:
    """One request of ``tenant/sid`` on node 0 that leaves ``gib`` GiB of context."""
    wire, ctx = f"{tenant}/{sid}", gib * GIB_TOKENS
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, wire, t, input_tokens=ctx,
                                      tenant=tenant))
    return core.request_finished(SessionEvent(EventKind.REQUEST_FINISHED, wire, t + 1.0,
                                              input_tokens=ctx, node=0, tenant=tenant), ctx)


def _held(core: SchedulerCore) -> dict[str, int]:
    return {e.session_id: e.nbytes // GIB for e in core.dram[0]}


def test_a_tenant_at_its_tier_share_evicts_its_own_sessions_never_another_tenants() -> None:
    # acme may hold 40% of the 10 GiB tier: 4 GiB. globex has no quota.
    core = _core("local-lru", {"acme": TenantQuota(local_tier_share=0.4)})
    _finish(core, "globex", "g1", 0.0, 3)
    _finish(core, "globex", "g2", 10.0, 3)
    _finish(core, "acme", "a1", 20.0, 2)
    _finish(core, "acme", "a2", 30.0, 2)
    assert core.dram[0].used_bytes == 10 * GIB  # full: acme at its 4 GiB
    # acme writes 1 GiB more: 4 + 1 - 4 = 1 GiB over its share. Its least recently used
    # session (a1, 2 GiB) goes, which also frees the tier's room; globex's g1, the least
    # recently used entry of the whole tier, stays.
    out = _finish(core, "acme", "a3", 40.0, 1)
    assert [(e.session_id, e.node) for e in out.evictions] == [("acme/a1", 0)]
    assert _held(core) == {"globex/g1": 3, "globex/g2": 3, "acme/a2": 2, "acme/a3": 1}
    # 5 GiB alone is over acme's 4 GiB: not kept locally, and nothing is evicted for it.
    out = _finish(core, "acme", "a4", 50.0, 5)
    assert out.evictions == ()
    assert _held(core) == {"globex/g1": 3, "globex/g2": 3, "acme/a2": 2, "acme/a3": 1}
    assert core.shares is not None
    st = core.shares.stats["acme"]
    assert (st.tier_evictions, st.tier_refusals, st.prefetch_deferrals) == (1, 1, 0)
    assert core.shares.tier_bytes(core.dram) == {("acme", 0): 3 * GIB}
    # globex, unlimited, still evicts by the policy's order across tenants (LRU: g1 first).
    out = _finish(core, "globex", "g3", 60.0, 2)
    assert [e.session_id for e in out.evictions] == ["globex/g1"]
    assert "globex" not in core.shares.stats


def test_without_the_share_the_same_traffic_evicts_the_other_tenant() -> None:
    core = _core("local-lru", None)
    assert core.shares is None
    for tenant, sid, t, gib in [("globex", "g1", 0.0, 3), ("globex", "g2", 10.0, 3),
                                ("acme", "a1", 20.0, 2), ("acme", "a2", 30.0, 2)]:
        _finish(core, tenant, sid, t, gib)
    out = _finish(core, "acme", "a3", 40.0, 1)
    assert [e.session_id for e in out.evictions] == ["globex/g1"]
    # 8 GiB held, 2 free: acme's 5 GiB takes globex's g2 (3 GiB) too.
    out = _finish(core, "acme", "a4", 50.0, 5)
    assert [e.session_id for e in out.evictions] == ["globex/g2"]


def test_a_tenant_over_its_share_is_not_prefetched_while_the_other_is() -> None:
    # A node restart warms every idle session into free room (prefetches). acme may hold
    # 2 GiB of the 10 GiB tier (share 0.2); it has three 1 GiB sessions, globex two.
    core = _core("predictive", {"acme": TenantQuota(local_tier_share=0.2)})
    for i, (tenant, sid) in enumerate([("acme", "a1"), ("acme", "a2"), ("acme", "a3"),
                                       ("globex", "g1"), ("globex", "g2")]):
        _finish(core, tenant, sid, 10.0 * i, 1)
    out = core.clear_local(100.0)
    warmed = sorted(t.session_id for t in out.loads)
    assert sum(s.startswith("acme/") for s in warmed) == 2  # its 2 GiB, no more
    assert [s for s in warmed if s.startswith("globex/")] == ["globex/g1", "globex/g2"]
    assert core.shares is not None and core.shares.stats["acme"].tier_refusals == 1
    assert core.shares.tier_bytes(core.dram) == {("acme", 0): 2 * GIB}


def test_a_tenants_prefetches_start_no_faster_than_its_bandwidth_share() -> None:
    # acme's share: 10% of a 100 Gb/s NIC = 1.25e9 B/s, so a 1 GiB prefetch holds it for
    # 2**30 / 1.25e9 = 0.858993459 s. globex is not limited.
    core = _core("predictive", {"acme": TenantQuota(prefetch_bandwidth_share=0.1)})
    for i, (tenant, sid) in enumerate([("acme", "a1"), ("acme", "a2"),
                                       ("globex", "g1"), ("globex", "g2")]):
        _finish(core, tenant, sid, 10.0 * i, 1)
    shares = core.shares
    assert shares is not None

    def warm(t: float) -> list[str]:
        out = core.clear_local(t)
        for ticket in out.loads:  # landed at once: a later restart may drop them
            core.transfer_done(ticket.session_id, 0, t, demand=False)
        return sorted(ticket.session_id for ticket in out.loads)

    first = warm(100.0)
    assert [s for s in first if s.startswith("globex/")] == ["globex/g1", "globex/g2"]
    assert sum(s.startswith("acme/") for s in first) == 1  # the second waits
    assert shares.busy_until_s("acme", 0) == pytest.approx(100.0 + GIB / 1.25e9)
    assert shares.stats["acme"].prefetch_deferrals == 1
    # 0.5 s later acme's share is still in use: neither starts; globex's both do.
    again = warm(100.5)
    assert again == ["globex/g1", "globex/g2"]
    assert shares.stats["acme"].prefetch_deferrals == 3
    # At 101.0 (> 100.859) one more 1 GiB may start, which holds the share to 101.859.
    third = warm(101.0)
    assert sum(s.startswith("acme/") for s in third) == 1
    assert shares.busy_until_s("acme", 0) == pytest.approx(101.0 + GIB / 1.25e9)


def test_quotas_are_validated() -> None:
    with pytest.raises(ValueError, match=r"local_tier_share must be in \(0, 1\]"):
        TenantQuota(local_tier_share=0.0)
    with pytest.raises(ValueError, match=r"prefetch_bandwidth_share must be in \(0, 1\]"):
        TenantQuota(prefetch_bandwidth_share=1.5)


def test_a_node_tier_whose_capacity_shrinks_evicts_in_the_policys_order_to_fit() -> None:
    # An agent reported a smaller tier (or a shard's quota moved): 10 GiB -> 6 GiB.
    core = _core("local-lru", None)
    for sid, t, gib in [("g1", 0.0, 3), ("g2", 10.0, 3), ("a1", 20.0, 2), ("a2", 30.0, 2)]:
        _finish(core, "acme", sid, t, gib)
    assert core.dram[0].used_bytes == 10 * GIB
    out = core.set_tier_capacity(0, 6 * GIB, 40.0)
    # 4 GiB over: the least recently used go first, g1 then g2 (3 + 3 GiB).
    assert [e.session_id for e in out.evictions] == ["acme/g1", "acme/g2"]
    assert _held(core) == {"acme/a1": 2, "acme/a2": 2}
    assert core.dram[0].capacity_bytes == 6 * GIB
    # Within the smaller tier a new 3 GiB context evicts a1 (2 free + 2 freed >= 3).
    out = _finish(core, "acme", "a3", 50.0, 3)
    assert [e.session_id for e in out.evictions] == ["acme/a1"]
    assert core.dram[0].used_bytes <= 6 * GIB
    # Back to 10 GiB: nothing moves, and 4 GiB more fit without an eviction.
    assert core.set_tier_capacity(0, 10 * GIB, 60.0).evictions == ()
    out = _finish(core, "acme", "a4", 70.0, 4)
    assert out.evictions == ()
    assert _held(core) == {"acme/a2": 2, "acme/a3": 3, "acme/a4": 4}
    # No tier at all: every session goes; a negative capacity is refused.
    out = core.set_tier_capacity(0, 0, 80.0)
    assert sorted(e.session_id for e in out.evictions) == ["acme/a2", "acme/a3", "acme/a4"]
    assert core.dram[0].used_bytes == 0
    with pytest.raises(ValueError, match="capacity_bytes"):
        core.set_tier_capacity(0, -1, 90.0)
