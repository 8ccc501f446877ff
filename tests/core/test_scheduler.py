"""SchedulerCore's session book-keeping, with a fake fleet view (pure logic)."""

from __future__ import annotations

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from controlplane.core.policies import POLICIES
from controlplane.core.scheduler import SchedulerCore
from predictors.registry import load


def test_forget_drops_session_and_predictor_state() -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    finish_turn(core, "a", 0.0, node=1, ctx=1000)
    assert core.session_home("a") == 1
    assert core.predictor.forecast("a", 5.0) is not None
    core.forget("a")
    core.forget("a")  # idempotent
    assert core.session_home("a") is None
    assert core.predictor.forecast("a", 5.0) is None
