"""What the core call under way has decided so far: :class:`StepDraft`.

One draft per core, shared by reference with every collaborator that decides something
(a load, a cancel, an armed order, an eviction, a trim); the core closes it once at the end
of each event method (:meth:`StepDraft.close`) into the one
:class:`~kvprefetch.controlplane.core.step.StepOutput` the driver carries out, and the
draft starts empty again. Closing reads the books once more, so that what was undone
within the call is not reported: an entry dropped and re-admitted is no eviction, a cut
that was dropped or refilled is no trim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.router import RouteDecision
from kvprefetch.controlplane.core.step import LoadTicket, Placement, StepOutput, Trim
from kvprefetch.controlplane.core.tiers import Tier

__all__ = ["StepDraft"]


@dataclass(slots=True)
class StepDraft:
    """The decisions of the call under way, in the order they were taken."""

    loads: list[LoadTicket] = field(default_factory=list)
    cancels: list[Placement] = field(default_factory=list)
    orders: list[PrefetchOrder] = field(default_factory=list)
    dropped: list[Placement] = field(default_factory=list)
    #: (session, node) -> the tokens its entry was cut back to (suffix eviction).
    trims: dict[tuple[str, int], int] = field(default_factory=dict)

    def close(self, tiers: Sequence[Tier], route_decision: RouteDecision | None, *,
              promote: bool, prefetch_ready_s: float | None) -> StepOutput:
        """The call's decisions as one record (``tiers``: the books as they stand now);
        the draft is empty afterwards."""
        if not (self.loads or self.cancels or self.orders or self.dropped or self.trims):
            # Nothing decided but the route (most calls): the step record is reused.
            if route_decision is None and prefetch_ready_s is None:
                return StepOutput.empty()
            return StepOutput(route_decision, promote, prefetch_ready_s, (), (), (), (), ())
        loads, cancels, orders = tuple(self.loads), tuple(self.cancels), tuple(self.orders)
        dropped, cuts = self.dropped, self.trims
        self.loads, self.cancels, self.orders, self.dropped, self.trims = [], [], [], [], {}
        evictions: list[Placement] = []
        for p in dropped:  # dropped and re-admitted within the call: not an eviction
            if tiers[p.node].get(p.session_id) is None and p not in evictions:
                evictions.append(p)
        trims: list[Trim] = []
        loading = {(t.session_id, t.node) for t in loads}
        for (sid, node), keep in cuts.items():
            # Cut and then dropped, or refilled within the call: not a trim.
            e = tiers[node].get(sid)
            if e is not None and e.tokens == keep and (sid, node) not in loading:
                trims.append(Trim(sid, node, keep))
        if not (route_decision or loads or cancels or orders or evictions or trims
                or prefetch_ready_s is not None):
            return StepOutput.empty()
        return StepOutput(route_decision, promote, prefetch_ready_s, cancels, loads, orders,
                          tuple(evictions), tuple(trims))
