"""SchedulerCore's session book-keeping, with a fake fleet view (pure logic)."""

from __future__ import annotations

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from controlplane.base.types import EventKind, SessionEvent
from controlplane.core.policies import POLICIES
from controlplane.core.scheduler import SchedulerCore
from controlplane.core.step import StepOutput
from predictors.registry import load


def test_forget_drops_session_and_predictor_state() -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    finish_turn(core, "a", 0.0, node=1, ctx=1000)
    assert core.session_home("a") == 1
    assert core.predictor.forecast("a", 5.0) is not None
    closed = SessionEvent(EventKind.SESSION_CLOSED, "a", 5.0)
    core.close(closed)
    assert core.close(closed) == StepOutput.empty()  # idempotent
    assert core.session_home("a") is None
    assert core.predictor.forecast("a", 5.0) is None


def test_the_step_output_carries_the_planners_priority_and_reports_only_real_evictions(
) -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["oracle"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    # Writing the same session through twice replaces its entry: not an eviction.
    finish_turn(core, "a", 0.0, node=0, ctx=40_000)
    assert finish_turn(core, "a", 10.0, node=0, ctx=40_100).evictions == ()
    finish_turn(core, "b", 20.0, node=0, ctx=40_000)
    out = finish_turn(core, "c", 30.0, node=0, ctx=40_000)
    (gone,) = out.evictions
    assert core.dram[0].get(gone.session_id) is None and gone.node == 0
    # A prefetch load keeps the priority its order was planned with (room made first).
    for entry in list(core.dram[0]):
        core.dram[0].remove(entry.session_id)
    (order,) = core.transfer_failed(gone.session_id, 0, 40.0).orders
    out = core.start_prefetch(order, order.start_at_s)
    while out.orders:  # its forecast moved later: follow the re-plans
        order = out.orders[0]
        out = core.start_prefetch(order, order.start_at_s)
    (ticket,) = out.loads
    assert ticket.prefetch and ticket.priority == order.priority > 0
