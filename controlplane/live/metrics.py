"""Prometheus metrics of the scheduler service (one private registry per service: no global
state, several services per process are fine). Needs ``prometheus_client`` (the ``serve``
extra); the service runs without it (:class:`~controlplane.live.service.NullMetrics`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from controlplane.core.quotas import TenantQuotaStats

#: Lateness = prefetch ready - request arrival (negative = in time), seconds.
LATENESS_BUCKETS_S = (-60, -10, -3, -1, -0.3, -0.1, 0, 0.1, 0.3, 1, 3, 10, 60)
TTLB_BUCKETS_S = (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100)
#: Distinct tenant labels kept; later tenants share the label :data:`OTHER_TENANTS` (a
#: service that admits any tenant must not grow its label set without bound).
MAX_TENANT_LABELS = 256
OTHER_TENANTS = "_other"


class PrometheusMetrics:
    """Implements :class:`~controlplane.live.service.ServiceMetricsSink`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._events = Counter("kvprefetch_events", "Session events ingested", ["kind"],
                               registry=r)
        self._events_rate = Gauge("kvprefetch_events_per_second",
                                  "Session events per second over the last window", registry=r)
        self._ttlb = Histogram("kvprefetch_ttlb_seconds",
                               "Time to last byte of a transfer into a local tier",
                               ["kind"], buckets=TTLB_BUCKETS_S, registry=r)
        self._lateness = Histogram("kvprefetch_prefetch_lateness_seconds",
                                   "Prefetch ready time minus request arrival",
                                   buckets=LATENESS_BUCKETS_S, registry=r)
        self._bytes = Counter("kvprefetch_transfer_bytes", "Bytes moved into local tiers",
                              ["kind"], registry=r)
        self._wasted = Gauge("kvprefetch_wasted_bytes",
                             "Prefetched bytes evicted or overwritten unread (modelled)",
                             registry=r)
        self._useful = Gauge("kvprefetch_useful_bytes",
                             "Prefetched bytes a request read (modelled)", registry=r)
        self._over_budget = Gauge(
            "kvprefetch_prefetches_over_budget",
            "Prefetches the waste budget refused (planner.waste_allowance_gib): once it "
            "grows with nothing prefetched left unread, prefetch is off until a restart",
            registry=r)
        self._local_tokens = Counter("kvprefetch_local_tokens",
                                     "Reusable tokens found in HBM or the local tier",
                                     registry=r)
        self._reused_tokens = Counter("kvprefetch_reused_tokens",
                                      "Reusable tokens of requests", registry=r)
        self._hit_rate = Gauge("kvprefetch_local_hit_rate",
                               "Local hits / reusable tokens since start", registry=r)
        self._inflight = Gauge("kvprefetch_orders_in_flight", "Transfer orders in flight",
                               ["node"], registry=r)
        self._tenant_live = Gauge("kvprefetch_tenant_live_sessions",
                                  "Live sessions each tenant holds", ["tenant"], registry=r)
        self._quota_refusals = Counter("kvprefetch_tenant_quota_refusals",
                                       "Calls refused: the tenant held its quota of live "
                                       "sessions", ["tenant"], registry=r)
        self._tenant_tier = Gauge("kvprefetch_tenant_local_tier_bytes",
                                  "Bytes of the tenant's sessions in the node's local-tier "
                                  "books (tenants with a share only)", ["tenant", "node"],
                                  registry=r)
        self._share_counts = {
            field: Counter(f"kvprefetch_tenant_{name}", help_, ["tenant"], registry=r)
            for field, name, help_ in (
                ("tier_evictions", "tier_share_evictions",
                 "The tenant's own sessions evicted to keep it within its local-tier share"),
                ("tier_refusals", "tier_share_refusals",
                 "KV of the tenant not admitted to a local tier: its own sessions could "
                 "not make room within its share"),
                ("prefetch_deferrals", "prefetch_bandwidth_deferrals",
                 "Prefetches of the tenant not started: its prefetch-bandwidth share on "
                 "the node was in use"))}
        self._share_seen: dict[tuple[str, str], int] = {}
        self._tenant_labels: set[str] = set()
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._window_events = 0
        self._local = 0
        self._reused = 0

    def event(self, kind: str) -> None:
        self._events.labels(kind).inc()
        with self._lock:
            self._window_events += 1
            now = time.monotonic()
            if now - self._window_start >= 1.0:
                self._events_rate.set(self._window_events / (now - self._window_start))
                self._window_start, self._window_events = now, 0

    def ttlb(self, seconds: float, prefetch: bool) -> None:
        self._ttlb.labels("prefetch" if prefetch else "demand").observe(seconds)

    def lateness(self, seconds: float) -> None:
        self._lateness.observe(seconds)

    def local_lookup(self, local_tokens: int, reused_tokens: int) -> None:
        self._local_tokens.inc(local_tokens)
        self._reused_tokens.inc(reused_tokens)
        with self._lock:
            self._local += local_tokens
            self._reused += reused_tokens
            if self._reused:
                self._hit_rate.set(self._local / self._reused)

    def bytes_moved(self, nbytes: int, prefetch: bool) -> None:
        self._bytes.labels("prefetch" if prefetch else "demand").inc(nbytes)

    def orders_in_flight(self, node: str, count: int) -> None:
        self._inflight.labels(node).set(count)

    def core_stats(self, wasted_bytes: int, useful_bytes: int, over_budget: int) -> None:
        self._wasted.set(wasted_bytes)
        self._useful.set(useful_bytes)
        self._over_budget.set(over_budget)

    def _tenant(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._tenant_labels:
                return tenant
            if len(self._tenant_labels) < MAX_TENANT_LABELS:
                self._tenant_labels.add(tenant)
                return tenant
        return OTHER_TENANTS

    def tenant_sessions(self, tenant: str, live: int) -> None:
        label = self._tenant(tenant)
        if label != OTHER_TENANTS:  # a sum over the others would need their counts
            self._tenant_live.labels(label).set(live)

    def quota_refused(self, tenant: str) -> None:
        self._quota_refusals.labels(self._tenant(tenant)).inc()

    def tenant_shares(self, tier_bytes: Mapping[tuple[str, str], int],
                      stats: Mapping[str, TenantQuotaStats]) -> None:
        for (tenant, node), nbytes in tier_bytes.items():
            self._tenant_tier.labels(tenant, node).set(nbytes)  # configured tenants only
        for tenant, st in stats.items():
            for field, counter in self._share_counts.items():
                value = getattr(st, field)
                with self._lock:
                    delta = value - self._share_seen.get((tenant, field), 0)
                    self._share_seen[(tenant, field)] = value
                if delta > 0:
                    counter.labels(self._tenant(tenant)).inc(delta)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
