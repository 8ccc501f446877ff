"""Prometheus metrics of the scheduler service (one private registry per service: no global
state, several services per process are fine). Needs ``prometheus_client`` (the ``serve``
extra); the service runs without it (:class:`~kvprefetch.controlplane.live.service.NullMetrics`)."""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvprefetch.controlplane.live.ports import SchedulerGauges, ShareBooks

#: Lateness = prefetch ready - request arrival (negative = in time), seconds.
LATENESS_BUCKETS_S = (-60, -10, -3, -1, -0.3, -0.1, 0, 0.1, 0.3, 1, 3, 10, 60)
TTLB_BUCKETS_S = (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100)
#: Distinct tenant labels kept; later tenants share the label :data:`OTHER_TENANTS` (a
#: service that admits any tenant must not grow its label set without bound).
MAX_TENANT_LABELS = 256
OTHER_TENANTS = "_other"


class LabelCap:
    """The first ``limit`` distinct values of a label, as they are; every later value as
    :data:`OTHER_TENANTS`. Thread-safe; its memory is bounded by ``limit``."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._kept:  # set membership needs no lock
            return value
        with self._lock:
            if value in self._kept or len(self._kept) < self._limit:
                self._kept.add(value)
                return value
        return OTHER_TENANTS


#: A ``tenant`` label in the text exposition format (its value escaped as the format
#: escapes it: backslash, double quote, newline).
_TENANT_LABEL = re.compile(rb'(?<=[{,])tenant="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {b"\\\\": b"\\", b'\\"': b'"', b"\\n": b"\n"}


def tenant_pseudonyms(key: bytes) -> Callable[[str], str]:
    """Tenant name -> its pseudonym on an open ``/metrics``: ``t-`` and 12 hex digits of an
    HMAC-SHA256 of the name under ``key`` (the same name, the same pseudonym, for as long
    as the key; a name cannot be confirmed without the key). :data:`OTHER_TENANTS` stays
    as it is: it names no tenant."""
    memo: dict[str, str] = {}

    def pseudonym(tenant: str) -> str:
        if tenant == OTHER_TENANTS:
            return tenant
        label = memo.get(tenant)
        if label is None:
            digest = hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()
            label = f"t-{digest[:12]}"
            if len(memo) < MAX_TENANT_LABELS * 4:  # bounded, as the label sets are
                memo[tenant] = label
        return label

    return pseudonym


def pseudonymize_tenants(text: bytes, pseudonym: Callable[[str], str]) -> bytes:
    """``text`` (the text exposition format) with the value of every ``tenant`` label
    replaced by ``pseudonym(value)``; everything else as it is."""

    def swap(match: re.Match[bytes]) -> bytes:
        raw = re.sub(rb"\\.", lambda m: _UNESCAPE.get(m.group(0), m.group(0)[1:]),
                     match.group(1))
        return b'tenant="' + pseudonym(raw.decode("utf-8")).encode() + b'"'

    return _TENANT_LABEL.sub(swap, text)


class PrometheusMetrics:
    """Implements :class:`~kvprefetch.controlplane.live.service.ServiceMetricsSink`."""

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
        self._local_tokens = Counter("kvprefetch_local_tokens",
                                     "Reusable tokens found in HBM or the local tier",
                                     registry=r)
        self._reused_tokens = Counter("kvprefetch_reused_tokens",
                                      "Reusable tokens of requests", registry=r)
        self._hit_rate = Gauge("kvprefetch_local_hit_rate",
                               "Local hits / reusable tokens since start", registry=r)
        self._tenant_live = Gauge("kvprefetch_tenant_live_sessions",
                                  "Live sessions each tenant holds", ["tenant"], registry=r)
        self._quota_refusals = Counter("kvprefetch_tenant_quota_refusals",
                                       "Calls refused: the tenant held its quota of live "
                                       "sessions", ["tenant"], registry=r)
        #: Read when the metrics are (scrape time), not per event: see tenant_shares_from
        #: and scheduler_gauges_from.
        self._share_books: ShareBooks | None = None
        self._gauges: Callable[[], SchedulerGauges] | None = None
        r.register(_ScrapeTime(self._scheduler_families))
        r.register(_ScrapeTime(self._share_families))
        self._tenant_label = LabelCap(MAX_TENANT_LABELS)
        #: Label children by value (the same objects ``labels()`` returns), per event kind
        #: and per tenant: each event updates both.
        self._event_counts: dict[str, Any] = {}
        self._tenant_gauges: dict[str, Any] = {}
        #: The live count each tenant's gauge shows (set under the service's lock, as every
        #: call of this sink is).
        self._tenant_counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._window_events = 0
        self._local = 0
        self._reused = 0

    def event(self, kind: str) -> None:
        child = self._event_counts.get(kind)
        if child is None:  # labels() takes a lock and checks the values: once per kind
            child = self._event_counts[kind] = self._events.labels(kind)
        child.inc()
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

    def scheduler_gauges_from(self, read: Callable[[], SchedulerGauges]) -> None:
        self._gauges = read

    def tenant_sessions(self, tenant: str, live: int) -> None:
        child = self._tenant_gauges.get(tenant)
        if child is None:
            label = self._tenant_label(tenant)
            if label == OTHER_TENANTS:  # a sum over the others would need their counts
                return
            child = self._tenant_gauges[label] = self._tenant_live.labels(label)
        if self._tenant_counts.get(tenant) != live:  # most events leave the count as it was
            self._tenant_counts[tenant] = live
            child.set(live)

    def quota_refused(self, tenant: str) -> None:
        self._quota_refusals.labels(self._tenant_label(tenant)).inc()

    def tenant_shares_from(self, books: ShareBooks) -> None:
        self._share_books = books

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))

    def _scheduler_families(self) -> Iterator[Metric]:
        """Orders in flight per node and the core's prefetch accounting, read from the
        scheduler at scrape time, so that the event path does no gauge work."""
        if self._gauges is None:
            return
        g = self._gauges()
        inflight = GaugeMetricFamily("kvprefetch_orders_in_flight",
                                     "Transfer orders in flight", labels=["node"])
        for node, count in g.orders_in_flight.items():
            inflight.add_metric([node], count)
        yield inflight
        # The core's running totals: counters (exported with ``_total``), read here.
        yield CounterMetricFamily("kvprefetch_wasted_bytes",
                                  "Prefetched bytes evicted or overwritten unread (modelled)",
                                  value=g.wasted_bytes)
        yield CounterMetricFamily("kvprefetch_useful_bytes",
                                  "Prefetched bytes a request read (modelled)",
                                  value=g.useful_bytes)
        yield CounterMetricFamily(
            "kvprefetch_prefetches_over_budget",
            "Prefetches the waste budget refused (planner.waste_allowance_gib): prefetch "
            "resumes as prefetched bytes are read or the allowance refills "
            "(planner.waste_window_s)",
            value=g.over_budget)
        bets = CounterMetricFamily(
            "kvprefetch_displacement_bets",
            "Settled bets that a prefetch's session comes back before the residents it "
            "would push out (planner.prefetch_min_win_share gates prefetch on them)",
            labels=["outcome"])
        bets.add_metric(["won"], g.bets_won)
        bets.add_metric(["lost"], g.bets_lost)
        yield bets
        yield CounterMetricFamily(
            "kvprefetch_warmup_bytes",
            "Bytes ordered to warm nodes that restarted or joined empty (free room only; "
            "outside the waste budget, modelled)", value=g.warmup_bytes)
        yield CounterMetricFamily(
            "kvprefetch_orders_failed",
            "Transfer orders that failed: the agent reported an error, could not be "
            "reached, restarted or did not answer in time (each is re-planned)",
            value=g.orders_failed)
        yield CounterMetricFamily(
            "kvprefetch_orders_lost",
            "Transfer orders whose agent never reported (timed out or the agent restarted)",
            value=g.orders_lost)
        yield CounterMetricFamily(
            "kvprefetch_loop_errors",
            "Control-loop iterations that raised (logged; the loop goes on)",
            value=g.loop_errors)
        quota = GaugeMetricFamily(
            "kvprefetch_node_tier_quota_bytes",
            "This scheduler's quota of the node's DRAM tier (modelled bytes): the configured "
            "tier divided among the shards, lowered to the capacity the node's agent reports",
            labels=["node"])
        for node, nbytes in g.tier_quota_bytes.items():
            quota.add_metric([node], nbytes)
        yield quota
        deferred = CounterMetricFamily(
            "kvprefetch_agent_orders_deferred",
            "Prefetch orders the node's agent held while its engine was busy (agent."
            "warming), as its latest status says", labels=["node"])
        for node, n in g.agent_orders_deferred.items():
            deferred.add_metric([node], n)
        yield deferred
        late = CounterMetricFamily(
            "kvprefetch_agent_orders_dropped_late",
            "Prefetch orders the node's agent dropped, never started, past their deadline "
            "plus agent.warming.late_grace_s (each also counts as a failed order)",
            labels=["node"])
        for node, n in g.agent_orders_dropped_late.items():
            late.add_metric([node], n)
        yield late

    def _share_families(self) -> Iterator[Metric]:
        """The tenants' shares, read from the scheduler's books at scrape time (counting a
        tenant's bytes scans every node's books: once per scrape, not per event). Only
        tenants with a share appear: their number is bounded by the configuration."""
        if self._share_books is None:
            return
        tier_bytes, stats = self._share_books()
        tier = GaugeMetricFamily("kvprefetch_tenant_local_tier_bytes",
                                 "Bytes of the tenant's sessions in the node's local-tier "
                                 "books (tenants with a share only)", labels=["tenant", "node"])
        for (tenant, node), nbytes in sorted(tier_bytes.items()):
            tier.add_metric([tenant, node], nbytes)
        yield tier
        for field, name, help_ in _SHARE_COUNTS:
            counter = CounterMetricFamily(name, help_, labels=["tenant"])
            for tenant, st in sorted(stats.items()):
                counter.add_metric([tenant], getattr(st, field))
            yield counter


#: The per-tenant share counters: (TenantQuotaStats field, metric name, help).
_SHARE_COUNTS = (
    ("tier_evictions", "kvprefetch_tenant_tier_share_evictions",
     "The tenant's own sessions evicted to keep it within its local-tier share"),
    ("tier_refusals", "kvprefetch_tenant_tier_share_refusals",
     "KV of the tenant not admitted to a local tier: its own sessions could not make "
     "room within its share"),
    ("prefetch_deferrals", "kvprefetch_tenant_prefetch_bandwidth_deferrals",
     "Prefetches of the tenant not started: its prefetch-bandwidth share on the node was "
     "in use"),
)


class _ScrapeTime:
    """A collector whose families are made when the registry is scraped."""

    def __init__(self, families: Callable[[], Iterator[Metric]]) -> None:
        self.collect = families


def merge_shard_metrics(texts: list[bytes]) -> bytes:
    """One exposition of several scheduler shards' metrics: every sample gets a ``shard``
    label (its index in ``texts``), and each metric family is written once with all the
    shards' samples (the text format wants a family's samples together)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for shard, text in enumerate(texts):
        for fam in text_string_to_metric_families(text.decode("utf-8")):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                     fam.unit)
            for sample in fam.samples:
                merged.samples.append(sample._replace(
                    labels={**sample.labels, "shard": str(shard)}))

    registry = CollectorRegistry()
    registry.register(_ScrapeTime(lambda: iter(families.values())))
    return bytes(generate_latest(registry))
