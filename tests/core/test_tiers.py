"""The DRAM tier under SchedulerCore: write-through eviction, and prefetches that may not
evict resident KV (pure logic, a fake fleet view)."""

from __future__ import annotations

import itertools

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from kvprefetch.controlplane.core.bets import LEAD_BINS, BetRecord
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.scheduler import MAX_REPLANS, SchedulerCore
from kvprefetch.controlplane.core.step import LoadTicket
from kvprefetch.predictors.registry import load

#: Half the two-node fleet's DRAM tier (10 GiB at 128 KiB per token): two such sessions
#: fill it exactly, so a third evicts one whole (no prefix is left to keep).
HALF = 40_960


def test_write_through_evicts_and_the_sweep_plans_a_prefetch_back() -> None:
    fleet = two_node_fleet()
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    outs = [finish_turn(core, sid, 10.0 * i, node=0, ctx=HALF)
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
             for o in finish_turn(core, sid, 10.0 * i, node=0, ctx=HALF).orders]
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
    # With free room, the same prefetch goes ahead where such forecasts have beaten
    # recency so far.
    core.dram[0].remove(sorted(held)[0])
    for bucket in itertools.product((False, True), range(LEAD_BINS + 1)):
        core._prefetcher.bets.records[bucket] = BetRecord(wins=20)
    ticket = start(list(core.transfer_failed(evicted, 0, 60.0).orders))
    assert ticket is not None and ticket.prefetch and ticket.session_id == evicted
