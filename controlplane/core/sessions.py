"""The scheduling core's per-session state: :class:`SessionState` in a :class:`Sessions` map.

One record per live session (created by its first event, dropped when it closes), shared
by reference between :class:`~kvprefetch.controlplane.core.scheduler.SchedulerCore` and its
collaborators, which read and update it on every event of the session. Times are seconds
on the driver's clock, sizes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.step import LoadTicket

__all__ = ["SessionState", "Sessions"]


@dataclass(slots=True)
class SessionState:
    """What the core knows of one live session."""

    #: The node its KV was last written on (where routing prefers it); None until served,
    #: or after that node left.
    home: int | None = None
    #: Tokens of its context held by the remote store (0 under policies without one).
    remote_tokens: int = 0
    #: Requests of the session between arrival and finish.
    in_flight: int = 0
    last_finish_s: float = 0.0
    #: The prefetch order armed for it (at most one), and when a prefetch that started
    #: expects it to be used (its entry is kept until then).
    pending: PrefetchOrder | None = None
    planned_use_s: float | None = None
    #: Times its armed order was re-armed because its forecast moved later.
    replans: int = 0
    #: Prefetches started in the current idle period.
    prefetches: int = 0
    #: Transfers of its KV under way, by node.
    inflight_nodes: dict[int, LoadTicket] = field(default_factory=dict)
    #: The node whose transfer the request in flight waits for (set when it is routed).
    awaiting_node: int | None = None
    #: The timed load of the request waiting in a node's queue, not started yet, and the
    #: node's queue drift when it was armed (see :mod:`kvprefetch.controlplane.core.loads`).
    queued: PrefetchOrder | None = None
    queued_drift_s: float = 0.0
    #: When the GPU was expected to pick the request in flight up, as estimated at its
    #: routing, and the node's queue drift then (``ADAPTIVE`` load starts only).
    expected_start_s: float | None = None
    routed_drift_s: float = 0.0


class Sessions(dict[str, SessionState]):
    """Live sessions by wire name; ``remote``: the policy keeps contexts in a remote store."""

    def __init__(self, *, remote: bool) -> None:
        super().__init__()
        self.remote = remote

    def remote_tokens(self, sid: str) -> int:
        """Tokens of the session's context the remote store holds (0 without one)."""
        s = self.get(sid)
        return s.remote_tokens if s is not None and self.remote else 0

    def of(self, sid: str) -> SessionState:
        """The session's state, created empty at its first event."""
        s = self.get(sid)
        if s is None:
            s = self[sid] = SessionState()
        return s
