"""Routing a request home and demand-loading its KV, through SchedulerCore with a fake fleet
view (pure logic)."""

from __future__ import annotations

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import DEMAND_PRIORITY
from kvprefetch.predictors.registry import load


def test_demand_load_reserves_room_and_routes_home() -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["ondemand"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    finish_turn(core, "a", 0.0, node=1, ctx=40_000)
    core.dram[1].clear()  # the node restarted: only the remote copy is left
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "a", 30.0))
    routed = core.route_request("a", 41_000, 40_000, 30.0)
    node = routed.node
    assert node in (0, 1)
    assert routed.loads == ()  # ondemand loads when the GPU picks the request up
    ticket = core.gpu_start("a", node, 40_000, 30.0).demand_load()
    assert ticket is not None and not ticket.prefetch
    assert ticket.nbytes == 40_000 * core.bpt and ticket.priority == DEMAND_PRIORITY
    assert core.gpu_start("a", node, 40_000, 30.0).loads == ()  # already under way
    entry = core.dram[node].get("a")
    assert entry is not None and entry.pinned and entry.ready_at_s > 30.0
    core.transfer_done("a", node, 31.0, demand=True)
    assert core.use_local("a", node, 40_000, 31.0) == 40_000
