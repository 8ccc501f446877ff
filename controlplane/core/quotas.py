"""Per-tenant shares of each node's local tier and of its prefetch bandwidth, kept by the core.

Sessions are the core's by wire name; their tenant comes with their events
(``SessionEvent.tenant``: the live driver keys sessions by ``SessionKey(tenant, session)``
and names them ``tenant/session`` to the core). :class:`TenantShares` remembers it for as
long as the session is live or resident in some node's books.

**Local-tier share** (``TenantQuota.local_tier_share``, a fraction of each node's local
tier): the bytes of a tenant's sessions in one node's books may not exceed
``share x capacity``. When admitting a session's KV there (a write-through, a demand load,
a prefetch, a warm) would take its tenant over that cap, the core first evicts that
tenant's *own* sessions on the node, in the order the decision evicts by (largest key
first, and only those whose key is above the newcomer's, as for any eviction), never
another tenant's; if its own evictable sessions cannot make the room (pinned, needed sooner
than the newcomer, or the newcomer alone is over the cap) the KV is not admitted: a
write-through is not kept locally, a load or prefetch is not started. A prefetch that may
only use free room (an uncertain one, a warm) is not started at all when its tenant would go
over. A share is a cap, not a reservation: a tenant under its cap competes for the rest of
the tier by the policy's order.

**Prefetch-bandwidth share** (``TenantQuota.prefetch_bandwidth_share``, a fraction of each
node's NIC rate): a tenant's prefetches start on a node no faster than that rate on
average. Each (tenant, node) keeps a virtual finish time, advanced by each started
prefetch's bytes at ``share x nic_bytes_per_s``; a prefetch starts only when that time is
not after now (the tenant's earlier prefetches would have finished at its share's rate).
A prefetch refused so is counted as deferred and dropped like one without room; the
sweep plans the session again. Demand loads are never limited (a request waits for them).

Without quotas the core builds no :class:`TenantShares` and no share is checked.
Cost: one scan of the node's entries per admission of a tenant with a local-tier share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvprefetch.controlplane.base.tiers import INF, EvictionStrategy, Tier, TierEntry
from kvprefetch.controlplane.base.types import DEFAULT_TENANT

__all__ = ["TenantQuota", "TenantQuotaStats", "TenantShares"]

#: Sessions remembered beyond the live and resident ones before the map is pruned.
_PRUNE_SLACK = 1024


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """One tenant's shares; 1.0 = no limit."""

    #: Fraction (0, 1] of each node's local tier the tenant's sessions may hold.
    local_tier_share: float = 1.0
    #: Fraction (0, 1] of each node's NIC rate the tenant's prefetches may use on average.
    prefetch_bandwidth_share: float = 1.0

    def __post_init__(self) -> None:
        for name in ("local_tier_share", "prefetch_bandwidth_share"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")


@dataclass(slots=True)
class TenantQuotaStats:
    """What a tenant's shares did (cumulative)."""

    #: Its own sessions evicted from a node to keep it within its local-tier share.
    tier_evictions: int = 0
    #: Admissions of its KV refused: its own sessions could not make room within its share.
    tier_refusals: int = 0
    #: Prefetches not started: its prefetch-bandwidth share on the node was in use.
    prefetch_deferrals: int = 0


class TenantShares:
    """The tenants of the core's sessions and the books of their shares (see the module
    docstring). ``known(sid)`` says whether the core still needs a session's tenant (live or
    resident somewhere); the tenant map is pruned with it."""

    def __init__(self, quotas: Mapping[str, TenantQuota], *, nic_bytes_per_s: float,
                 known: Callable[[str], bool]) -> None:
        self.quotas = dict(quotas)
        self._nic_bytes_per_s = nic_bytes_per_s
        self._known = known
        self._tenant_of: dict[str, str] = {}
        self._prune_at = _PRUNE_SLACK
        #: (tenant, node) -> when its prefetches started so far would have finished at its
        #: share's rate.
        self._busy_until: dict[tuple[str, int], float] = {}
        self.stats: dict[str, TenantQuotaStats] = {}

    # -- tenants -----------------------------------------------------------------------
    def observe(self, sid: str, tenant: str) -> None:
        """An event of ``sid`` named its tenant."""
        self._tenant_of[sid] = tenant
        if len(self._tenant_of) > self._prune_at:
            self._tenant_of = {s: t for s, t in self._tenant_of.items() if self._known(s)}
            self._prune_at = 2 * len(self._tenant_of) + _PRUNE_SLACK

    def tenant(self, sid: str) -> str:
        return self._tenant_of.get(sid, DEFAULT_TENANT)

    def _stats(self, tenant: str) -> TenantQuotaStats:
        st = self.stats.get(tenant)
        if st is None:
            st = self.stats[tenant] = TenantQuotaStats()
        return st

    # -- local-tier share --------------------------------------------------------------
    def tier_cap_bytes(self, tenant: str, capacity_bytes: int) -> int | None:
        """The most bytes of ``tenant`` one node's tier may hold (None: no cap)."""
        q = self.quotas.get(tenant)
        if q is None or q.local_tier_share >= 1.0:
            return None
        return int(q.local_tier_share * capacity_bytes)

    def own_victims(self, tier: Tier, sid: str, grow_bytes: int, now_s: float, *,
                    strategy: EvictionStrategy, min_key: float = -INF, free_only: bool = False
                    ) -> list[TierEntry] | None:
        """The sessions of ``sid``'s tenant to evict from ``tier`` so that the tier's books
        can grow by ``grow_bytes`` for ``sid`` within the tenant's share ([] when no
        eviction is needed), or None when they cannot (counted as a refusal).
        ``free_only``: no eviction allowed (an uncertain prefetch, a warm)."""
        tenant = self.tenant(sid)
        cap = self.tier_cap_bytes(tenant, tier.capacity_bytes)
        if cap is None:
            return []
        mine = [e for e in tier if self.tenant(e.key) == tenant]
        over = sum(e.nbytes for e in mine) + grow_bytes - cap
        if over <= 0:
            return []
        chosen: list[TierEntry] = []
        if not free_only:
            movable = [e for e in mine if not e.pinned and e.key != sid]
            ranked = sorted(zip(strategy.keys(movable, now_s), movable, strict=True),
                            key=lambda c: (-c[0], c[1].key))
            freed = 0
            for key, e in ranked:
                if freed >= over or key <= min_key:
                    break
                chosen.append(e)
                freed += e.nbytes
            if freed >= over:
                self._stats(tenant).tier_evictions += len(chosen)
                return chosen
        self._stats(tenant).tier_refusals += 1
        return None

    def tier_bytes(self, tiers: Sequence[Tier]) -> dict[tuple[str, int], int]:
        """(tenant, node) -> bytes of the tenant's sessions in that node's books, for every
        tenant with a quota (0 where it holds none)."""
        out = {(t, n): 0 for t in self.quotas for n in range(len(tiers))}
        for node, tier in enumerate(tiers):
            for e in tier:
                key = (self.tenant(e.key), node)
                if key in out:
                    out[key] += e.nbytes
        return out

    # -- prefetch-bandwidth share ------------------------------------------------------
    def _rate(self, tenant: str) -> float | None:
        q = self.quotas.get(tenant)
        if q is None or q.prefetch_bandwidth_share >= 1.0:
            return None
        return q.prefetch_bandwidth_share * self._nic_bytes_per_s

    def may_prefetch(self, sid: str, node: int, now_s: float) -> bool:
        """Whether a prefetch of ``sid`` may start on ``node`` now (counted if not)."""
        tenant = self.tenant(sid)
        if self._rate(tenant) is None:
            return True
        if self._busy_until.get((tenant, node), -INF) > now_s:
            self._stats(tenant).prefetch_deferrals += 1
            return False
        return True

    def charge(self, sid: str, node: int, nbytes: int, now_s: float) -> None:
        """A prefetch of ``nbytes`` of ``sid`` started on ``node``."""
        tenant = self.tenant(sid)
        rate = self._rate(tenant)
        if rate is not None:
            key = (tenant, node)
            self._busy_until[key] = max(self._busy_until.get(key, now_s), now_s) + nbytes / rate

    def busy_until_s(self, tenant: str, node: int) -> float:
        """When the tenant's prefetch-bandwidth share on the node is free again."""
        return self._busy_until.get((tenant, node), -INF)
