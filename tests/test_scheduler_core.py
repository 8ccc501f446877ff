"""SchedulerCore on its own, with a fake fleet view (pure logic)."""

from __future__ import annotations

from controlplane.base.config import GIB, fleet_from_dict
from controlplane.base.types import EventKind, SessionEvent, Trace, TraceRequest, TraceSession
from controlplane.core.policies import POLICIES
from controlplane.core.scheduler import MAX_REPLANS, LoadTicket, SchedulerCore
from predictors.oracle import OraclePredictor
from predictors.registry import load


class FakeFleet:
    """Idle nodes with empty HBM and a Valkey-speed remote store."""

    def queue_wait_s(self, node: int, now_s: float) -> float:
        return 0.0

    def link_backlog_s(self, node: int, now_s: float) -> float:
        return 0.0

    def hbm_tokens(self, node: int, session_id: str) -> int:
        return 0

    def remote_source(self, session_id: str) -> tuple[float, float]:
        return 1 / 5e9, 0.0005


def _events(core: SchedulerCore, sid: str, t: float, node: int, ctx: int,
            stop: str = "tool_use") -> None:
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, sid, t, input_tokens=ctx))
    core.request_finished(SessionEvent(EventKind.REQUEST_FINISHED, sid, t + 1.0,
                                       input_tokens=ctx, stop_reason=stop, node=node),
                          ctx)


def _fleet() -> object:
    # 8B: 128 KiB per token; the DRAM tier holds two 40k-token sessions (~4.9 GiB each).
    return fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 10 * GIB},
                            "planner": {"min_confidence": 0.0}})


def test_write_through_evicts_and_the_sweep_plans_a_prefetch_back() -> None:
    fleet = _fleet()
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    for i, sid in enumerate(["a", "b", "c"]):
        _events(core, sid, 10.0 * i, node=0, ctx=40_000)
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


def test_forget_drops_session_and_predictor_state() -> None:
    core = SchedulerCore(_fleet(), POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    _events(core, "a", 0.0, node=1, ctx=1000)
    assert core.session_home("a") == 1
    assert core.predictor.forecast("a", 5.0) is not None
    core.forget("a")
    core.forget("a")  # idempotent
    assert core.session_home("a") is None
    assert core.predictor.forecast("a", 5.0) is None


def test_demand_load_reserves_room_and_routes_home() -> None:
    core = SchedulerCore(_fleet(), POLICIES["ondemand"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    _events(core, "a", 0.0, node=1, ctx=40_000)
    core.dram[1].clear()  # the node restarted: only the remote copy is left
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "a", 30.0))
    decision = core.route("a", 41_000, 40_000, 30.0)
    assert decision.node in (0, 1)
    ticket = core.demand_load("a", decision.node, 40_000, 30.0)
    assert ticket is not None and not ticket.prefetch
    assert ticket.nbytes == 40_000 * core.bpt
    assert core.demand_load("a", decision.node, 40_000, 30.0) is None  # already under way
    entry = core.dram[decision.node].get("a")
    assert entry is not None and entry.pinned and entry.ready_at_s > 30.0
    core.transfer_done("a", decision.node, 31.0, demand=True)
    assert core.use_local("a", decision.node, 40_000, 31.0) == 40_000


def test_oracle_orders_finish_just_in_time() -> None:
    sess = TraceSession("s", 0.0, (
        TraceRequest("s", 0, 0.0, 40_000, 10, 0, None, "tool_use", 1.0),
        TraceRequest("s", 1, 0.0, 41_000, 10, 40_000, 120.0, "tool_use", 1.0),
    ))
    trace = Trace("t", (sess,), "test")
    core = SchedulerCore(_fleet(), POLICIES["oracle"], OraclePredictor(trace), FakeFleet())  # type: ignore[arg-type]
    _events(core, "s", 0.0, node=0, ctx=40_010)
    core.dram[0].clear()
    core.replan("s", 1.0)
    (order,) = core.drain_orders()
    ttlb = 0.0005 + 40_010 * core.bpt / 5e9
    assert order.deadline_s == 1.0 + 120.0
    assert abs(order.start_at_s + ttlb - order.deadline_s) < 1e-6


def test_an_uncertain_prefetch_never_evicts_resident_kv() -> None:
    core = SchedulerCore(_fleet(), POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    for i, sid in enumerate(["a", "b", "c"]):
        _events(core, sid, 10.0 * i, node=0, ctx=40_000)
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


def test_recency_floor_applies_to_heuristic_forecasts_only() -> None:
    from controlplane.base.config import PlannerConfig
    from controlplane.base.types import ArrivalForecast
    from controlplane.core.planner import predicted_use_s

    cfg = PlannerConfig()
    # Finished at t=0, idle for 100 s; its median gap is 30 s.
    heuristic = ArrivalForecast("s", 0.0, (10.0, 30.0, 90.0), 0.9, 3600.0, 0.5)
    learned = ArrivalForecast("s", 0.0, (110.0, 130.0, 190.0), 0.9, 3600.0, 0.5,
                              conditioned=True)
    certain = ArrivalForecast("s", 0.0, (30.0, 30.0, 30.0), 1.0, 3600.0, 1.0)
    # A heuristic may not pull an idle session ahead of its silence: now + idle time.
    assert predicted_use_s(heuristic, cfg, 100.0) == 200.0
    # A conditioned forecast already weighs the silence: its own median stands.
    assert predicted_use_s(learned, cfg, 100.0) == 130.0
    assert predicted_use_s(certain, cfg, 10.0) == 30.0
