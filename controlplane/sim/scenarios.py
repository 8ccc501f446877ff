"""Trace transformations for named scenarios."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession

SCENARIOS: tuple[str, ...] = ("default", "cold-start", "scale-out")
#: Quiet time between the two passes of the cold-start scenario (seconds).
COLD_START_PAUSE_S = 600.0


def cold_start(trace: Trace) -> tuple[Trace, float]:
    """The classic remote-cache test: send every session's full context once, clear all
    node-local tiers, then send every context again in the same order.

    Returns the new trace and the time at which the simulator clears the tiers. Each
    session becomes two open-loop requests of its largest context; the second one reuses
    all of the first (it is "returning").
    """
    sessions = []
    first_pass_end = 0.0
    for s in trace.sessions:
        biggest = max(s.requests, key=lambda r: (r.input_tokens, r.turn))
        first_pass_end = max(first_pass_end, s.start_s + (biggest.api_time_s or 0.0))
        sessions.append((s, biggest))
    clear_at = first_pass_end + COLD_START_PAUSE_S
    span = clear_at + COLD_START_PAUSE_S
    out = []
    for s, r in sessions:
        first = TraceRequest(s.session_id, 0, 0.0, r.input_tokens, r.output_tokens, 0, None,
                             r.stop_reason, r.api_time_s)
        second = replace(first, turn=1, offset_s=span, reused_tokens=r.input_tokens)
        out.append(replace(s, requests=(first, second)))
    out_sessions: tuple[TraceSession, ...] = tuple(out)
    return replace(trace, name=f"{trace.name} (cold-start)", sessions=out_sessions), clear_at


def scale_out(trace: Trace) -> float:
    """When the last node joins a fleet that started without it: at the median session
    start, so that half the sessions began on the smaller fleet and half the traffic
    comes after the join. The trace is unchanged."""
    starts = sorted(s.start_s for s in trace.sessions)
    return starts[len(starts) // 2] if starts else 0.0


@dataclass(frozen=True, slots=True)
class FleetEvents:
    """What happens to the fleet during a scenario's replay (seconds on the replay clock):
    every node's local tiers cleared (cold start), the last node joining (scale-out)."""

    clear_tiers_at_s: float | None = None
    join_at_s: float | None = None


def apply_scenario(trace: Trace, name: str) -> tuple[Trace, FleetEvents]:
    """The trace a named scenario replays and what happens to the fleet meanwhile."""
    if name == "default":
        return trace, FleetEvents()
    if name == "cold-start":
        out, clear_at = cold_start(trace)
        return out, FleetEvents(clear_tiers_at_s=clear_at)
    if name == "scale-out":
        return trace, FleetEvents(join_at_s=scale_out(trace))
    raise ConfigError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
