"""The DRAM tier under SchedulerCore: write-through eviction, and prefetches that may not
evict resident KV (pure logic, a fake fleet view)."""

from __future__ import annotations

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from controlplane.base.config import GIB, fleet_from_dict
from controlplane.core.planner import PrefetchOrder
from controlplane.core.policies import POLICIES
from controlplane.core.scheduler import MAX_REPLANS, SchedulerCore
from controlplane.core.step import LoadTicket
from predictors.registry import load


def test_write_through_evicts_and_the_sweep_plans_a_prefetch_back() -> None:
    fleet = two_node_fleet()
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    outs = [finish_turn(core, sid, 10.0 * i, node=0, ctx=40_000)
            for i, sid in enumerate(["a", "b", "c"])]
    held = {e.session_id for e in core.dram[0]}
    assert len(held) == 2 and core.dram[0].used_bytes <= core.dram[0].capacity_bytes
    (evicted,) = {"a", "b", "c"} - held
    # The eviction is reported, and armed an order to bring it back; the sweep does not
    # arm a second one.
    assert [(e.session_id, e.node) for out in outs for e in out.evictions] == [(evicted, 0)]
    assert [o.session_id for out in outs for o in out.orders] == [evicted]
    assert core.sweep(100.0).orders == ()
    orders = core.transfer_failed(evicted, 0, 100.0).orders  # an order lost: plan again
    assert orders and orders[0].session_id == evicted and orders[0].node == 0
    assert orders[0].start_at_s >= 100.0


def test_an_uncertain_prefetch_never_evicts_resident_kv() -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    armed = [o for i, sid in enumerate(["a", "b", "c"])
             for o in finish_turn(core, sid, 10.0 * i, node=0, ctx=40_000).orders]
    held = {e.session_id for e in core.dram[0]}
    (evicted,) = {"a", "b", "c"} - held

    def start(orders: list[PrefetchOrder]) -> LoadTicket | None:
        """Start the armed order at its time (following re-plans as its forecast moves)."""
        for _ in range(MAX_REPLANS + 2):
            (order,) = orders
            out = core.start_prefetch(order, order.start_at_s)
            orders = list(out.orders)  # a re-plan arms a new order
            if out.loads or not orders:
                return out.loads[0] if out.loads else None
        raise AssertionError("the order never started")

    # The tier is full of sessions that may be used first: the order is dropped, not served
    # by evicting one of them.
    assert start(armed) is None
    assert {e.session_id for e in core.dram[0]} == held
    assert core.stats.prefetches_dropped == 1
    # With free room, the same prefetch goes ahead.
    core.dram[0].remove(sorted(held)[0])
    ticket = start(list(core.transfer_failed(evicted, 0, 60.0).orders))
    assert ticket is not None and ticket.prefetch and ticket.session_id == evicted


def test_the_value_rule_prefetches_into_free_room_without_a_confidence_threshold() -> None:
    # last-gap's forecasts are below planner.min_confidence (0.7): `predictive` never
    # prefetches them; `predictive-value` weighs the forecast instead of gating on it.
    fleet = fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 10 * GIB}})
    core = SchedulerCore(fleet, POLICIES["predictive-value"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    for t in (0.0, 20.0, 40.0):  # a steady 19 s gap after tool calls
        finish_turn(core, "a", t, node=0, ctx=30_000)
    core.dram[0].remove("a")  # pressure took it
    (order,) = core.transfer_failed("a", 0, 42.0).orders
    assert order.start_at_s < order.deadline_s <= 41.0 + 19.0 + 1e-6
    out = core.start_prefetch(order, order.start_at_s)
    while out.orders:
        order = out.orders[0]
        out = core.start_prefetch(order, order.start_at_s)
    (ticket,) = out.loads
    assert ticket.prefetch and ticket.session_id == "a" and ticket.node == 0
