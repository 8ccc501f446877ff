"""Trace transformations for named scenarios."""

from __future__ import annotations

from dataclasses import replace

from controlplane.base.errors import ConfigError
from controlplane.base.types import Trace, TraceRequest, TraceSession

SCENARIOS: tuple[str, ...] = ("default", "cold-start")
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


def apply_scenario(trace: Trace, name: str) -> tuple[Trace, float | None]:
    if name == "default":
        return trace, None
    if name == "cold-start":
        return cold_start(trace)
    raise ConfigError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
