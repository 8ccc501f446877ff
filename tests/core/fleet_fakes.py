"""Fakes shared by the scheduling-core tests: a fleet view with idle nodes, one turn of a
session, and a two-node fleet whose DRAM tier holds two 40k-token sessions."""

from __future__ import annotations

from controlplane.base.config import GIB, fleet_from_dict
from controlplane.base.types import EventKind, SessionEvent
from controlplane.core.scheduler import SchedulerCore
from controlplane.core.step import StepOutput


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


def finish_turn(core: SchedulerCore, sid: str, t: float, node: int, ctx: int,
                stop: str = "tool_use") -> StepOutput:
    """One request of ``sid`` on ``node``; returns the output of its finish."""
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, sid, t, input_tokens=ctx))
    return core.request_finished(SessionEvent(EventKind.REQUEST_FINISHED, sid, t + 1.0,
                                       input_tokens=ctx, stop_reason=stop, node=node),
                          ctx)


def two_node_fleet() -> object:
    # 8B: 128 KiB per token; the DRAM tier holds two 40k-token sessions (~4.9 GiB each).
    return fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 10 * GIB},
                            "planner": {"min_confidence": 0.0}})
