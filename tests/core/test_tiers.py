"""The DRAM tier under SchedulerCore: write-through eviction, and prefetches that may not
evict resident KV (pure logic, a fake fleet view)."""

from __future__ import annotations

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from controlplane.core.policies import POLICIES
from controlplane.core.scheduler import MAX_REPLANS, LoadTicket, SchedulerCore
from predictors.registry import load


def test_write_through_evicts_and_the_sweep_plans_a_prefetch_back() -> None:
    fleet = two_node_fleet()
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    for i, sid in enumerate(["a", "b", "c"]):
        finish_turn(core, sid, 10.0 * i, node=0, ctx=40_000)
    held = {e.session_id for e in core.dram[0]}
    assert len(held) == 2 and core.dram[0].used_bytes <= core.dram[0].capacity_bytes
    (evicted,) = {"a", "b", "c"} - held
    # Its eviction armed an order to bring it back; the sweep does not arm a second one.
    assert [o.session_id for o in core.drain_orders()] == [evicted]
    core.sweep(100.0)
    assert core.drain_orders() == []
    core.replan(evicted, 100.0)
    orders = core.drain_orders()
    assert orders and orders[0].session_id == evicted and orders[0].node == 0
    assert orders[0].start_at_s >= 100.0


def test_an_uncertain_prefetch_never_evicts_resident_kv() -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    for i, sid in enumerate(["a", "b", "c"]):
        finish_turn(core, sid, 10.0 * i, node=0, ctx=40_000)
    held = {e.session_id for e in core.dram[0]}
    (evicted,) = {"a", "b", "c"} - held

    def start() -> LoadTicket | None:
        """Start the armed order at its time (following re-plans as its forecast moves)."""
        orders = core.drain_orders()
        for _ in range(MAX_REPLANS + 2):
            (order,) = orders
            ticket = core.start_prefetch(order, order.start_at_s)
            orders = core.drain_orders()  # a re-plan arms a new order
            if ticket is not None or not orders:
                return ticket
        raise AssertionError("the order never started")

    # The tier is full of sessions that may be used first: the order is dropped, not served
    # by evicting one of them.
    assert start() is None
    assert {e.session_id for e in core.dram[0]} == held
    assert core.stats.prefetches_dropped == 1
    # With free room, the same prefetch goes ahead.
    core.dram[0].remove(sorted(held)[0])
    core.replan(evicted, 60.0)
    ticket = start()
    assert ticket is not None and ticket.prefetch and ticket.session_id == evicted
