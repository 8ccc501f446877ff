"""What the scheduling core reads of the physical fleet: :class:`FleetView`.

The simulator implements it over its modelled nodes, links and remote store; the live
service over the agents' and engines' reports. The core calls it on every routing decision
and prefetch plan (several times per event), so every method must be cheap and free of
side effects. Units: seconds, tokens, seconds per byte.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["FleetView", "IdleFleet"]


class FleetView(Protocol):
    """What the core needs to know about the physical fleet (the simulator's state, or the
    live agents' reports). Called on every routing decision and plan: keep it cheap."""

    def queue_wait_s(self, node: int, now_s: float) -> float: ...

    def link_backlog_s(self, node: int, now_s: float) -> float: ...

    def hbm_tokens(self, node: int, session_id: str) -> int: ...

    def remote_source(self, session_id: str) -> tuple[float, float]:
        """(seconds per byte, first-byte latency) of the session's remote copy."""
        ...


class IdleFleet:
    """A :class:`FleetView` of idle GPUs and links, empty HBM and a Valkey-speed remote
    store (5 GB/s, 0.5 ms): for measuring the control plane's own cost (``kvprefetch bench
    control-plane``) and for the core's tests."""

    def queue_wait_s(self, node: int, now_s: float) -> float:
        return 0.0

    def link_backlog_s(self, node: int, now_s: float) -> float:
        return 0.0

    def hbm_tokens(self, node: int, session_id: str) -> int:
        return 0

    def remote_source(self, session_id: str) -> tuple[float, float]:
        return 1 / 5e9, 0.0005
