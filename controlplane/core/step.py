"""What one call of the scheduling core decided: the contract between the core and its drivers.

Every event method of :class:`~kvprefetch.controlplane.core.scheduler.SchedulerCore` returns one
:class:`StepOutput` (as vLLM's scheduler returns one ``SchedulerOutput`` per step). A driver
(the simulator on a virtual clock, the live service on the wall clock) *carries it out* and
decides nothing of its own:

* ``route``: the node chosen for the request (only from ``route_request``);
* ``cancels``: transfers of the session to other nodes to stop (their books are already
  dropped);
* ``promote``: the transfer already heading to the chosen node is now a demand load (its
  request waits for it): move it ahead of prefetches on the node's link;
* ``loads``: transfers to start now, demand loads and prefetches alike, each with the
  priority the planner gave it;
* ``orders``: prefetches armed for later: at each order's ``start_at_s`` the driver calls
  :meth:`~kvprefetch.controlplane.core.scheduler.SchedulerCore.start_prefetch`;
* ``evictions``: sessions dropped from a node's local-tier books (advise the node's agent to
  delete them); an entry dropped and re-admitted within the same call is not listed;
* ``trims``: sessions cut back to a prefix in a node's books (suffix eviction, policies
  with ``suffix_eviction``): advise the agent to delete the chunks past ``keep_tokens``;
* ``prefetch_ready_s``: for lateness metrics, when a prefetch of the routed session became
  usable on the chosen node (``inf`` while it is still arriving), or None.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprefetch.controlplane.base.records import quick_init
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.router import RouteDecision

#: Priority of demand loads: a request is waiting for them, so they go before prefetches
#: (whose priority is the planner's expected stall avoided per GiB, always lower).
DEMAND_PRIORITY = 100.0
#: Priority of the load of a request still waiting in a node's queue (due at its estimated
#: GPU start): after the loads a GPU is blocked on, before any prefetch.
QUEUED_PRIORITY = 50.0


@quick_init
@dataclass(frozen=True, slots=True)
class LoadTicket:
    """Move ``nbytes`` of ``session_id``'s KV into ``node``'s local tier, where the core has
    reserved room for ``tokens`` tokens. ``prefetch`` is False for demand loads."""

    session_id: str
    node: int
    tokens: int
    nbytes: int
    prefetch: bool
    deadline_s: float
    #: Higher first on the node's link; demand loads are :data:`DEMAND_PRIORITY`.
    priority: float = DEMAND_PRIORITY


@quick_init
@dataclass(frozen=True, slots=True)
class Placement:
    """One session's KV on one node: what a cancel or an eviction refers to."""

    session_id: str
    node: int


@dataclass(frozen=True, slots=True)
class Trim:
    """``session_id``'s KV on ``node`` keeps its first ``keep_tokens`` tokens (the prefix a
    returning request reuses); the rest was evicted."""

    session_id: str
    node: int
    keep_tokens: int


@quick_init
@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one core call decided; see the module docstring. Empty: :meth:`empty`."""

    route: RouteDecision | None = None
    promote: bool = False
    prefetch_ready_s: float | None = None
    cancels: tuple[Placement, ...] = ()
    loads: tuple[LoadTicket, ...] = ()
    orders: tuple[PrefetchOrder, ...] = ()
    evictions: tuple[Placement, ...] = ()
    trims: tuple[Trim, ...] = ()

    @classmethod
    def empty(cls) -> StepOutput:
        return _EMPTY

    @property
    def node(self) -> int:
        """The routed node (only for the output of ``route_request``)."""
        if self.route is None:
            raise ValueError("this step routed no request")
        return self.route.node

    def demand_load(self, session_id: str | None = None) -> LoadTicket | None:
        """The demand load among ``loads`` for ``session_id`` (default: any). A step starts
        at most one for the request it is about, and may start the timed loads of requests
        waiting in a queue (see :meth:`SchedulerCore.gpu_start`)."""
        return next((t for t in self.loads if not t.prefetch
                     and (session_id is None or t.session_id == session_id)), None)


_EMPTY = StepOutput()
