"""The live scheduler's configuration and its clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvprefetch.controlplane.base.config import FleetConfig, default_fleet
from kvprefetch.controlplane.base.errors import InvalidRequestError
from kvprefetch.controlplane.base.keys import DEFAULT_CHUNK_TOKENS
from kvprefetch.controlplane.base.names import check_tenant_name
from kvprefetch.controlplane.base.shards import MAX_SHARDS
from kvprefetch.controlplane.core.engines import ENGINES, on_engine
from kvprefetch.controlplane.core.policies import POLICIES, PolicySpec
from kvprefetch.controlplane.core.quotas import TenantQuota
from kvprefetch.controlplane.live.limits import RequestLimits

#: Live sessions a tenant may hold when its quota is not given.
DEFAULT_MAX_LIVE_SESSIONS = 100_000


class ServiceConfig(BaseModel):
    """The live scheduler's configuration (validated at start-up)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The fleet's capacity: ``fleet.nodes`` node slots, numbered 0..nodes-1.
    fleet: FleetConfig = Field(default_factory=lambda: default_fleet("8b", 2))
    #: Nodes 0..initial_nodes-1 have agents at start; the others are out of the fleet
    #: (never routed to) until their agent says hello (they join, and are warmed then).
    #: None = every node (the fleet is full).
    initial_nodes: int | None = Field(None, ge=1)
    policy: str = "predictive"
    predictor: str = "default"
    #: The engine profile the nodes run (:data:`~kvprefetch.controlplane.core.engines.
    #: ENGINES`, as ``kvprefetch sim --engine``): the policy runs with the mechanisms it
    #: grants (:func:`~kvprefetch.controlplane.core.engines.on_engine`). None: the policy
    #: as declared.
    engine: str | None = None
    #: Service seconds per wall second: 1 in production; >1 replays a trace faster (the
    #: demo). Every time the core sees is on this clock.
    time_compression: float = Field(1.0, gt=0, le=100_000)
    chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, gt=0, le=1 << 20)
    journal_path: str | None = None
    #: Fsync the journal every this many wall seconds (it is flushed to the OS each loop).
    journal_sync_interval_s: float = Field(5.0, gt=0)
    #: Compact the journal (drop closed sessions' records, atomically) once this many
    #: records were written since it was opened or last compacted, and at least as many
    #: as it kept then (so compaction costs O(1) per event); also at start-up when the
    #: journal replayed holds this many. 0: never.
    journal_compact_records: int = Field(200_000, ge=0)
    #: Allowed tenants; None = any.
    tenants: tuple[str, ...] | None = None
    #: Live sessions (opened, not yet closed) each tenant may hold; a call that would open
    #: one more is refused (TenantQuotaError, HTTP 429) and other tenants are unaffected.
    max_live_sessions_per_tenant: int = Field(DEFAULT_MAX_LIVE_SESSIONS, ge=1,
                                              le=100_000_000)
    #: Per-tenant quotas that replace the default above.
    tenant_max_live_sessions: dict[str, int] = Field(default_factory=dict)
    #: Route request ids each tenant's routes are remembered by (journalled, so across
    #: restarts): a retry with one answers the first call's answer; past this many the
    #: least recently used is forgotten (:mod:`kvprefetch.controlplane.live.routes.ledger`).
    route_memory_per_tenant: int = Field(10_000, ge=1, le=10_000_000)
    #: Per-tenant share (0, 1] of each node's local tier: a tenant at its share has its own
    #: sessions evicted first to fit a new one, never another tenant's, and KV that its own
    #: cannot make room for is not kept (:mod:`kvprefetch.controlplane.core.quotas`). Unlisted: 1.
    tenant_local_tier_share: dict[str, float] = Field(default_factory=dict)
    #: Per-tenant share (0, 1] of each node's NIC rate its prefetches may use on average;
    #: a prefetch over it is deferred to a later sweep. Demand loads are not limited.
    tenant_prefetch_bandwidth_share: dict[str, float] = Field(default_factory=dict)
    #: Limits on each gateway call (token ids, hashes, names), checked before any state
    #: changes; ``kvprefetch serve`` sets them from ``http.limits``.
    limits: RequestLimits = RequestLimits()
    #: Names of the nodes (index = node number), for answers and metrics.
    node_names: tuple[str, ...] | None = None
    #: Control-loop period when idle (wall seconds).
    loop_interval_s: float = Field(0.05, gt=0, le=5)
    #: An order not reported after this long (wall seconds) is given up and re-planned.
    order_timeout_s: float = Field(120.0, gt=0)
    #: This service is shard ``shard`` of ``shards`` (:mod:`kvprefetch.controlplane.base.shards`):
    #: it owns the sessions the ring gives it, with its quota of every node's tiers and
    #: links (:meth:`for_shard`); its epochs are congruent to ``shard`` modulo ``shards``.
    shard: int = Field(0, ge=0)
    shards: int = Field(1, ge=1, le=MAX_SHARDS)
    #: How shards hold each node's DRAM tier: ``split`` = 1/N each (a static quota, which
    #: fragments a tier of few large contexts); ``shared`` = each books the whole tier,
    #: the node's own tier evicts by its order when their writes overfill it and tells the
    #: owner of each session it evicted (:meth:`FleetMembership.tier_evicted`). ``shared`` needs
    #: agents with their own tier holding chunks named by position (backend ``local``, the
    #: gateway sending token counts): an evicted chunk named by content (a hash, an SGLang
    #: page) does not say whose it is, and LMCache's L1 (``lmcache-mp``) evicts unseen.
    shard_tier: Literal["split", "shared"] = "split"

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if POLICIES[self.policy].predictor == "oracle":
            raise ValueError(f"policy {self.policy!r} reads the future (the oracle "
                             "predictor): simulator only")
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"unknown engine profile {self.engine!r}; known: "
                             f"{', '.join(ENGINES)}")
        if self.initial_nodes is not None and self.initial_nodes > self.fleet.nodes:
            raise ValueError(f"initial_nodes={self.initial_nodes} is more than the fleet's "
                             f"{self.fleet.nodes} nodes")
        for tenant, quota in self.tenant_max_live_sessions.items():
            try:
                check_tenant_name(tenant, "tenant_max_live_sessions")
            except InvalidRequestError as exc:
                raise ValueError(str(exc)) from None
            if quota < 1:
                raise ValueError(f"tenant_max_live_sessions[{tenant!r}] must be >= 1")
        for field in ("tenant_local_tier_share", "tenant_prefetch_bandwidth_share"):
            for tenant, share in getattr(self, field).items():
                try:
                    check_tenant_name(tenant, field)
                except InvalidRequestError as exc:
                    raise ValueError(str(exc)) from None
                if not 0.0 < share <= 1.0:
                    raise ValueError(f"{field}[{tenant!r}] must be a fraction in (0, 1], "
                                     f"got {share!r}")
                if self.tenants is not None and tenant not in self.tenants:
                    raise ValueError(f"{field}[{tenant!r}]: not one of the tenants "
                                     f"({', '.join(self.tenants)})")
        if self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} is not one of {self.shards} shards")
        if self.node_names is not None and len(self.node_names) != self.fleet.nodes:
            raise ValueError(f"node_names has {len(self.node_names)} names for "
                             f"{self.fleet.nodes} nodes")
        return self

    @property
    def policy_spec(self) -> PolicySpec:
        """The policy, on the engine profile when one is named."""
        policy = POLICIES[self.policy]
        return policy if self.engine is None else on_engine(policy, ENGINES[self.engine])

    def max_live_sessions(self, tenant: str) -> int:
        """The live-session quota of ``tenant``."""
        return self.tenant_max_live_sessions.get(tenant, self.max_live_sessions_per_tenant)

    @property
    def tenant_quotas(self) -> dict[str, TenantQuota]:
        """The core's per-tenant shares (empty: none configured)."""
        tier, bw = self.tenant_local_tier_share, self.tenant_prefetch_bandwidth_share
        return {t: TenantQuota(local_tier_share=tier.get(t, 1.0),
                               prefetch_bandwidth_share=bw.get(t, 1.0))
                for t in sorted(set(tier) | set(bw))}

    def for_shard(self, shard: int, shards: int) -> ServiceConfig:
        """The configuration of shard ``shard`` of ``shards`` cut from this whole-fleet one:
        the fleet's quota for one shard (:meth:`FleetConfig.shard_quota`), every tenant's
        live-session quota divided (rounded up), and one journal segment per shard
        (``<path>.shard<i>of<n>``)."""
        if shards == 1:
            return self.model_copy(update={"shard": 0, "shards": 1})
        journal = (None if self.journal_path is None
                   else f"{self.journal_path}.shard{shard}of{shards}")
        per_shard = {t: -(-q // shards) for t, q in self.tenant_max_live_sessions.items()}
        return ServiceConfig.model_validate({
            **self.model_dump(exclude={"fleet"}),
            "fleet": self.fleet.shard_quota(shards, shared_tier=self.shard_tier == "shared"),
            "journal_path": journal,
            "max_live_sessions_per_tenant": -(-self.max_live_sessions_per_tenant // shards),
            "tenant_max_live_sessions": per_shard, "shard": shard, "shards": shards})

    @property
    def nodes_at_start(self) -> int:
        """How many nodes (0..n-1) have agents when the service starts."""
        return self.fleet.nodes if self.initial_nodes is None else self.initial_nodes


class ServiceClock:
    """Service seconds: ``offset_s + (wall - start) * compression``. ``wall_at`` maps a
    service time back to the wall clock (for timers)."""

    def __init__(self, compression: float = 1.0, *, offset_s: float = 0.0,
                 wall: Callable[[], float] = time.monotonic) -> None:
        self.compression = compression
        self._wall = wall
        self._start = wall()
        self.offset_s = offset_s

    def now_s(self) -> float:
        return self.offset_s + (self._wall() - self._start) * self.compression

    def continue_after(self, t_s: float) -> None:
        """Resume a clock so that now is just after ``t_s``."""
        self._start = self._wall()
        self.offset_s = t_s

    def wall_delay_s(self, at_s: float) -> float:
        return max(0.0, (at_s - self.now_s()) / self.compression)
