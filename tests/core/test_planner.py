"""Planning prefetches: just-in-time start times and the recency floor of forecasts (pure
logic)."""

from __future__ import annotations

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.predictors.oracle import OraclePredictor


def test_oracle_orders_finish_just_in_time() -> None:
    sess = TraceSession("s", 0.0, (
        TraceRequest("s", 0, 0.0, 40_000, 10, 0, None, "tool_use", 1.0),
        TraceRequest("s", 1, 0.0, 41_000, 10, 40_000, 120.0, "tool_use", 1.0),
    ))
    trace = Trace("t", (sess,), "test")
    core = SchedulerCore(two_node_fleet(), POLICIES["perfect"], OraclePredictor(trace), FakeFleet())  # type: ignore[arg-type]
    finish_turn(core, "s", 0.0, node=0, ctx=40_010)
    (order,) = core.forget_local(0, {"s"}, 1.0).orders  # the node lost it: plan it back
    ttlb = 0.0005 + 40_010 * core.bpt / 5e9
    assert order.deadline_s == 1.0 + 120.0
    assert abs(order.start_at_s + ttlb - order.deadline_s) < 1e-6


def test_recency_floor_applies_to_heuristic_forecasts_only() -> None:
    from kvprefetch.controlplane.base.config import PlannerConfig
    from kvprefetch.controlplane.base.types import ArrivalForecast
    from kvprefetch.controlplane.core.planner import predicted_use_s

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


def test_min_p_return_gates_unconditioned_forecasts_only() -> None:
    """Unlikely to return within the horizon: a heuristic's session ranks as never used; a
    conditioned forecast keeps its median, so the tier can still tell two such sessions
    apart (gated, both would tie at inf)."""
    from kvprefetch.controlplane.base.config import PlannerConfig
    from kvprefetch.controlplane.base.types import ArrivalForecast
    from kvprefetch.controlplane.core.planner import predicted_use_s

    cfg = PlannerConfig(min_p_return=0.3)
    heuristic = ArrivalForecast("s", 0.0, (10.0, 30.0, 90.0), 0.1, 3600.0, 0.5)
    soon = ArrivalForecast("s", 0.0, (110.0, 130.0, 190.0), 0.1, 3600.0, 0.5,
                           conditioned=True)
    later = ArrivalForecast("t", 0.0, (110.0, 400.0, 900.0), 0.1, 3600.0, 0.5,
                            conditioned=True)
    assert predicted_use_s(heuristic, cfg, 100.0) == float("inf")
    assert predicted_use_s(soon, cfg, 100.0) == 130.0
    assert predicted_use_s(later, cfg, 100.0) == 400.0
    assert predicted_use_s(None, cfg, 100.0) == float("inf")
