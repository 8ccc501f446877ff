"""Fakes shared by the scheduling-core tests: a fleet view with idle nodes, one turn of a
session, a two-node fleet whose DRAM tier holds two 40k-token sessions, and the session's
home node as the core holds it."""

from __future__ import annotations

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.core.scheduler import IdleFleet, SchedulerCore
from kvprefetch.controlplane.core.step import StepOutput

#: Idle nodes with empty HBM and a Valkey-speed remote store.
FakeFleet = IdleFleet


def finish_turn(core: SchedulerCore, sid: str, t: float, node: int, ctx: int,
                stop: str = "tool_use") -> StepOutput:
    """One request of ``sid`` on ``node``; returns the output of its finish."""
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, sid, t, input_tokens=ctx))
    return core.request_finished(SessionEvent(EventKind.REQUEST_FINISHED, sid, t + 1.0,
                                       input_tokens=ctx, stop_reason=stop, node=node),
                          ctx)


def session_home(core: SchedulerCore, sid: str) -> int | None:
    """The node the core routes the session to first (where its KV was last written);
    None for a session it does not hold or whose home left."""
    s = core._sessions.get(sid)
    return s.home if s is not None else None


def two_node_fleet() -> object:
    # 8B: 128 KiB per token; the DRAM tier holds two 40k-token sessions (~4.9 GiB each).
    return fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 10 * GIB},
                            "planner": {"min_confidence": 0.0}})
