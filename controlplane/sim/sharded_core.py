"""Several scheduling cores as one, the way a sharded deployment runs them (for the
simulator: what does sharding cost in decisions?).

:class:`ShardedCore` holds ``N`` :class:`~kvprefetch.controlplane.core.scheduler.SchedulerCore` s,
each planning with its quota of the fleet (:meth:`FleetConfig.shard_quota`: 1/N of every
node's DRAM tier, link and Valkey rate, and of the waste allowance) and its own copy of the
predictor, as ``N`` scheduler shards on Ray do. A session's events go to the core that owns
it (:class:`~kvprefetch.controlplane.base.shards.ShardRing`); fleet-wide calls (the sweep, a node
leaving or joining, tiers cleared) go to every core and their decisions are joined. Every
core sees the same fleet (queues, HBM, links) through the one ``FleetView``: what the
agents' and engines' reports give each shard live.

With ``shared_tier`` every core books each node's whole DRAM tier (the live
``shard_tier: shared``), and after every call a node whose cores' books together exceed the
tier drops entries, least recently used first across all cores, until they fit: what the
node's own LRU tier does when the shards' writes overfill it, each eviction reported to
the owning shard, which drops it from its books and plans it again.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.shards import ShardRing
from kvprefetch.controlplane.base.types import DEFAULT_TENANT, SessionEvent
from kvprefetch.controlplane.core.planner import PrefetchOrder
from kvprefetch.controlplane.core.policies import PolicySpec
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.stats import CoreStats, summed
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.core.view import FleetView
from kvprefetch.predictors.base import Predictor


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
                 view: FleetView, shards: int, *, shared_tier: bool = False) -> None:
        quota = fleet.shard_quota(shards, shared_tier=shared_tier)
        self.ring = ShardRing(shards)
        self.cores = [SchedulerCore(quota, policy, copy.deepcopy(predictor), view)
                      for _ in range(shards)]
        #: Each node's real tier when the cores share it (None: static quotas).
        self._shared_bytes = (fleet.node.dram_tier_bytes
                              if shared_tier and policy.dram_tier else None)
        #: Books entries the shared tiers evicted (summed over nodes).
        self.tier_evictions = 0

    def _of(self, sid: str) -> SchedulerCore:
        return self.cores[self.ring.owner(DEFAULT_TENANT, sid)]

    def _all(self, call: Callable[[SchedulerCore], StepOutput], now_s: float) -> StepOutput:
        return self._fit(join_outputs([call(core) for core in self.cores]), now_s)

    def _fit(self, out: StepOutput, now_s: float) -> StepOutput:
        """``out``, plus what the shared tiers evicted to hold the cores' books (module
        doc); ``out`` alone with static quotas."""
        capacity = self._shared_bytes
        if capacity is None:
            return out
        evicted: list[StepOutput] = []
        for node in range(len(self.cores[0].dram)):
            over = sum(core.dram[node].used_bytes for core in self.cores) - capacity
            if over <= 0:
                continue
            lru = sorted(((e.last_use_s, e.key, i, e) for i, core in enumerate(self.cores)
                          for e in core.dram[node] if not e.pinned),
                         key=lambda c: (c[0], c[1]))
            gone: dict[int, set[str]] = {}
            for _, sid, i, e in lru:
                if over <= 0:
                    break
                gone.setdefault(i, set()).add(sid)
                over -= e.nbytes
            for i, sids in gone.items():
                self.tier_evictions += len(sids)
                evicted.append(self.cores[i].forget_local(node, sids, now_s))
        if not evicted:
            return out
        more = join_outputs(evicted)
        return dataclasses.replace(
            out, cancels=out.cancels + more.cancels, loads=out.loads + more.loads,
            orders=out.orders + more.orders, evictions=out.evictions + more.evictions,
            trims=out.trims + more.trims)

    # -- a session's calls: its owner -------------------------------------------------
    def request_started(self, event: SessionEvent) -> StepOutput:
        return self._fit(self._of(event.session_id).request_started(event), event.time_s)

    def route_request(self, sid: str, input_tokens: int, reused_tokens: int, now_s: float
                      ) -> StepOutput:
        return self._fit(self._of(sid).route_request(sid, input_tokens, reused_tokens, now_s),
                         now_s)

    def gpu_start(self, sid: str, node: int, reused_tokens: int, now_s: float) -> StepOutput:
        return self._fit(self._of(sid).gpu_start(sid, node, reused_tokens, now_s), now_s)

    def use_local(self, sid: str, node: int, reused_tokens: int, now_s: float) -> int:
        return self._of(sid).use_local(sid, node, reused_tokens, now_s)

    def dram_tokens(self, node: int, sid: str) -> int:
        """Tokens of the session in the node's DRAM books (its shard's)."""
        return self._of(sid).dram_tokens(node, sid)

    def request_finished(self, event: SessionEvent, context_tokens: int) -> StepOutput:
        return self._fit(self._of(event.session_id).request_finished(event, context_tokens),
                         event.time_s)

    def hbm_evicted(self, sid: str, node: int, tokens: int, now_s: float) -> StepOutput:
        return self._fit(self._of(sid).hbm_evicted(sid, node, tokens, now_s), now_s)

    def hint(self, event: SessionEvent) -> StepOutput:
        return self._fit(self._of(event.session_id).hint(event), event.time_s)

    def transfer_done(self, sid: str, node: int, now_s: float, *, demand: bool) -> StepOutput:
        return self._fit(self._of(sid).transfer_done(sid, node, now_s, demand=demand), now_s)

    def start_prefetch(self, order: PrefetchOrder, now_s: float) -> StepOutput:
        return self._fit(self._of(order.session_id).start_prefetch(order, now_s), now_s)

    # -- the fleet's: every core ------------------------------------------------------
    def sweep(self, now_s: float) -> StepOutput:
        return self._all(lambda core: core.sweep(now_s), now_s)

    def clear_local(self, now_s: float) -> StepOutput:
        return self._all(lambda core: core.clear_local(now_s), now_s)

    def node_left(self, node: int, now_s: float) -> StepOutput:
        return self._all(lambda core: core.node_left(node, now_s), now_s)

    def node_joined(self, node: int, now_s: float) -> StepOutput:
        return self._all(lambda core: core.node_joined(node, now_s), now_s)

    @property
    def stats(self) -> CoreStats:
        return summed(CoreStats, (core.stats for core in self.cores))
