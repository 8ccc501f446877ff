"""Several scheduling cores as one, the way a sharded deployment runs them (for the
simulator: what does sharding cost in decisions?).

:class:`ShardedCore` holds ``N`` :class:`~controlplane.core.scheduler.SchedulerCore` s,
each planning with its quota of the fleet (:meth:`FleetConfig.shard_quota`: 1/N of every
node's DRAM tier, link and Valkey rate, and of the waste allowance) and its own copy of the
predictor, as ``N`` scheduler shards on Ray do. A session's events go to the core that owns
it (:class:`~controlplane.base.shards.ShardRing`); fleet-wide calls (the sweep, a node
leaving or joining, tiers cleared) go to every core and their decisions are joined. Every
core sees the same fleet (queues, HBM, links) through the one ``FleetView``: what the
agents' and engines' reports give each shard live.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from controlplane.base.config import FleetConfig
from controlplane.base.shards import ShardRing
from controlplane.base.types import DEFAULT_TENANT, SessionEvent
from controlplane.core.planner import PrefetchOrder
from controlplane.core.policies import PolicySpec
from controlplane.core.scheduler import CoreStats, FleetView, SchedulerCore, summed
from controlplane.core.step import StepOutput
from predictors.base import Predictor


def join_outputs(outs: Sequence[StepOutput]) -> StepOutput:
    """One step's decisions from several cores' (none of which routed a request)."""
    outs = [o for o in outs if o is not StepOutput.empty()]
    if len(outs) <= 1:
        return outs[0] if outs else StepOutput.empty()
    return StepOutput(
        cancels=tuple(c for o in outs for c in o.cancels),
        loads=tuple(t for o in outs for t in o.loads),
        orders=tuple(r for o in outs for r in o.orders),
        evictions=tuple(e for o in outs for e in o.evictions),
        trims=tuple(t for o in outs for t in o.trims))


class ShardedCore:
    """``shards`` cores behind the calls the simulator makes (module docstring)."""

    def __init__(self, fleet: FleetConfig, policy: PolicySpec, predictor: Predictor,
                 view: FleetView, shards: int) -> None:
        quota = fleet.shard_quota(shards)
        self.ring = ShardRing(shards)
        self.cores = [SchedulerCore(quota, policy, copy.deepcopy(predictor), view)
                      for _ in range(shards)]

    def _of(self, sid: str) -> SchedulerCore:
        return self.cores[self.ring.owner(DEFAULT_TENANT, sid)]

    def _all(self, call: Callable[[SchedulerCore], StepOutput]) -> StepOutput:
        return join_outputs([call(core) for core in self.cores])

    # -- a session's calls: its owner -------------------------------------------------
    def request_started(self, event: SessionEvent) -> StepOutput:
        return self._of(event.session_id).request_started(event)

    def route_request(self, sid: str, input_tokens: int, reused_tokens: int, now_s: float
                      ) -> StepOutput:
        return self._of(sid).route_request(sid, input_tokens, reused_tokens, now_s)

    def gpu_start(self, sid: str, node: int, reused_tokens: int, now_s: float) -> StepOutput:
        return self._of(sid).gpu_start(sid, node, reused_tokens, now_s)

    def use_local(self, sid: str, node: int, reused_tokens: int, now_s: float) -> int:
        return self._of(sid).use_local(sid, node, reused_tokens, now_s)

    def request_finished(self, event: SessionEvent, context_tokens: int) -> StepOutput:
        return self._of(event.session_id).request_finished(event, context_tokens)

    def hint(self, event: SessionEvent) -> StepOutput:
        return self._of(event.session_id).hint(event)

    def transfer_done(self, sid: str, node: int, now_s: float, *, demand: bool) -> StepOutput:
        return self._of(sid).transfer_done(sid, node, now_s, demand=demand)

    def start_prefetch(self, order: PrefetchOrder, now_s: float) -> StepOutput:
        return self._of(order.session_id).start_prefetch(order, now_s)

    # -- the fleet's: every core ------------------------------------------------------
    def sweep(self, now_s: float) -> StepOutput:
        return self._all(lambda core: core.sweep(now_s))

    def clear_local(self, now_s: float) -> StepOutput:
        return self._all(lambda core: core.clear_local(now_s))

    def node_left(self, node: int, now_s: float) -> StepOutput:
        return self._all(lambda core: core.node_left(node, now_s))

    def node_joined(self, node: int, now_s: float) -> StepOutput:
        return self._all(lambda core: core.node_joined(node, now_s))

    @property
    def stats(self) -> CoreStats:
        return summed(CoreStats, (core.stats for core in self.cores))
