"""Limits on what the core may start: the waste budget and tenant shares (:class:`Budgets`).

Called by the tier books (:mod:`kvprefetch.controlplane.core.books`) before every
admission that grows a node's books: a write-through, a demand load, a prefetch, a warm-up.
Both checks are pure questions on counters; neither evicts: a share answers which of the
tenant's own sessions must go for the room, and the books evict them.

* **Waste budget** (policies with ``waste_budget``): every byte a prefetch started ends
  read (used), evicted or cut unread, or cancelled (wasted), or is still unread, so keeping
  ``exposed + nbytes <= (1 + r) x used + allowance`` at every start keeps
  ``wasted <= r x used + allowance`` at all times, whatever the forecasts
  (``r`` = ``planner.waste_per_used_byte``). The allowance refills: it grows by its own
  size every ``planner.waste_window_s`` from the first prefetch the budget weighs, so a
  credit spent on forecasts that were wrong comes back, and prefetch resumes once the
  traffic changes, instead of staying off for good (the bound is then
  ``wasted <= r x used + allowance x (1 + t / window)``). Warm-ups of empty nodes are
  outside it (they fill free room only) and widen the credit by their bytes.
* **Tenant shares** (:mod:`kvprefetch.controlplane.core.quotas`): a tenant's bytes in one
  node's books, and its prefetch rate on that node, stay within its quota.

Bytes are KV bytes; times seconds on the driver's clock.
"""

from __future__ import annotations

from kvprefetch.controlplane.base.config import GIB, PlannerConfig
from kvprefetch.controlplane.core.policies import PolicySpec
from kvprefetch.controlplane.core.quotas import TenantShares
from kvprefetch.controlplane.core.stats import CoreStats
from kvprefetch.controlplane.core.tiers import EvictionStrategy, Tier, TierEntry

__all__ = ["Budgets"]


class Budgets:
    """The waste budget over ``stats`` and the tenant ``shares`` (None: no quotas)."""

    def __init__(self, policy: PolicySpec, planner: PlannerConfig, stats: CoreStats,
                 shares: TenantShares | None) -> None:
        self._policy = policy
        self._planner = planner
        self._stats = stats
        self.shares = shares
        #: When the budget first weighed a prefetch (the allowance refills from then).
        self._since_s: float | None = None

    def within_waste_budget(self, nbytes: int, now_s: float) -> bool:
        """Whether a prefetch of ``nbytes`` more may start at ``now_s`` (module
        docstring): forecasts that are right earn the budget they need; on traffic where
        they are wrong, prefetch stops once the credit is spent and resumes as prefetches
        already started are read, or as the allowance refills. A refusal is counted
        (``prefetches_over_budget``)."""
        if not self._policy.waste_budget:
            return True
        st = self._stats
        planner = self._planner
        if self._since_s is None:
            self._since_s = now_s
        windows = 1.0
        if planner.waste_window_s > 0:
            windows += max(0.0, now_s - self._since_s) / planner.waste_window_s
        credit = ((1.0 + planner.waste_per_used_byte) * st.prefetch_used_bytes
                  + planner.waste_allowance_gib * GIB * windows + st.warmup_bytes)
        if st.prefetch_exposed_bytes + nbytes <= credit:
            return True
        st.prefetches_over_budget += 1
        return False

    def share_room(self, tier: Tier, sid: str, node: int, grow_bytes: int, now_s: float, *,
                   min_key: float, prefetch: bool, free_only: bool,
                   strategy: EvictionStrategy) -> list[TierEntry] | None:
        """Whether the session's tenant may grow the node's books by ``grow_bytes`` (and,
        for a prefetch, start one now) within its shares: None if not, else the tenant's
        own sessions to evict first for the room (often none), in ``strategy``'s order.
        Only with quotas (``shares`` is not None)."""
        shares = self.shares
        assert shares is not None
        if prefetch and not shares.may_prefetch(sid, node, now_s):
            return None
        return shares.own_victims(tier, sid, grow_bytes, now_s, min_key=min_key,
                                  free_only=free_only, strategy=strategy)
