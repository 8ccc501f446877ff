"""The DRAM tier under SchedulerCore: write-through eviction, and prefetches that may not
evict resident KV (pure logic, a fake fleet view)."""

from __future__ import annotations

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
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


def test_eviction_duel_follows_the_rule_whose_victims_come_back_later() -> None:
    from kvprefetch.controlplane.core.tiers import EvictionDuel

    duel = EvictionDuel(rate=0.5)
    assert not duel.predicted_use_leads  # LRU, the baselines' rule, until shown otherwise
    duel.record("a", "a")  # the rules agree: no duel
    duel.returned("a")
    assert duel.decided == 0
    duel.record("p1", "l1")  # predicted use would evict p1, LRU l1
    duel.returned("l1")  # LRU's victim came back first: predicted use was right
    assert duel.decided == 1 and duel.score == 0.5 and duel.predicted_use_leads
    duel.returned("p1")  # already decided: nothing more
    assert duel.decided == 1
    duel.record("p2", "l2")
    duel.record("p2", "l3")
    duel.returned("p2")  # predicted use's victim came back first: twice wrong
    assert duel.decided == 3 and duel.score == 0.5 * (0.5 * (0.5 - 1) - 1) + 0.0
    assert not duel.predicted_use_leads


def test_eviction_duel_keeps_a_bounded_number_of_open_duels() -> None:
    from kvprefetch.controlplane.core.tiers import EvictionDuel

    duel = EvictionDuel(max_pending=2)
    duel.record("a", "b")
    duel.record("c", "d")
    duel.record("e", "f")  # drops the oldest, a-b
    duel.returned("a")
    assert duel.decided == 0
    duel.returned("f")
    assert duel.decided == 1


def test_dueling_eviction_uses_the_leading_rule_and_records_disagreements() -> None:
    from kvprefetch.controlplane.core.tiers import (
        DuelingEviction,
        EvictionDuel,
        PredictedUseEviction,
        Tier,
        TierEntry,
    )

    # x was used last (LRU keeps it) but is predicted furthest (predicted use evicts it).
    uses = {"x": 500.0, "y": 20.0}
    strategy = DuelingEviction(PredictedUseEviction(lambda sids, now: [uses[s] for s in sids]),
                               EvictionDuel(rate=1.0))
    tier = Tier("t", 200, strategy)
    tier.put(TierEntry("y", 1, 100, last_use_s=1.0))
    tier.put(TierEntry("x", 1, 100, last_use_s=5.0))
    assert [e.key for e in tier.victims_for(100, 10.0)] == ["y"]  # LRU leads at first
    strategy.duel.returned("y")  # LRU's victim came back first
    assert [e.key for e in tier.victims_for(100, 11.0)] == ["x"]  # predicted use leads
