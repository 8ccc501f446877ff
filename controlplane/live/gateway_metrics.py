"""The gateway's Prometheus metrics, on one private registry per gateway (several gateways
per process are fine). Every label set is bounded: ``node`` is the fleet index, ``tenant``
keeps the first :data:`MAX_GATEWAY_TENANT_LABELS` tenants seen (the rest share
:data:`~kvprefetch.controlplane.live.metrics.OTHER_TENANTS`), ``deployment`` comes from the
config, and the sessions remembered to tell a returning turn are at most
:data:`MAX_SEEN_SESSIONS`. Needs ``prometheus_client`` (the ``serve`` extra).

Called from the gateway's event loop only (one request's phases, in order)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.live.metrics import LabelCap

#: Time to first token, seconds: a prefix-cache hit on a short prompt answers in a few
#: milliseconds, a long context recomputed on a busy node in tens of seconds.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                  30.0, 60.0)
#: The scheduler's route call, seconds (its timeout is ``scheduler_timeout_s``, 2 s by
#: default).
ROUTE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0)
MAX_GATEWAY_TENANT_LABELS = 64
MAX_SEEN_SESSIONS = 100_000


class SeenSessions:
    """The sessions whose turns this gateway saw, least recently seen first dropped once
    there are ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: OrderedDict[SessionKey, None] = OrderedDict()

    def seen_before(self, key: SessionKey) -> bool:
        """Whether an earlier turn of ``key`` was seen; records this one."""
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        self._seen[key] = None
        if len(self._seen) > self._limit:
            self._seen.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._seen)


class GatewayMetrics:
    """The gateway's counters, gauges and histograms; ``deployment`` labels the
    histograms (a name from the gateway's config)."""

    def __init__(self, deployment: str, *, max_tenants: int = MAX_GATEWAY_TENANT_LABELS,
                 max_sessions: int = MAX_SEEN_SESSIONS) -> None:
        self.deployment = deployment
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvprefetch_gateway_requests",
                                "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.routed = Counter("kvprefetch_gateway_routed",
                              "Requests routed, by who chose the node", ["by"], registry=r)
        self.scheduler_unavailable = Counter(
            "kvprefetch_gateway_scheduler_unavailable",
            "Scheduler calls that failed or timed out (the request still ran)", registry=r)
        self.route_deadline = Counter(
            "kvprefetch_gateway_route_deadline",
            "Requests routed by load because the scheduler's route did not answer within "
            "route_deadline_s (the late answer dropped)", registry=r)
        self.failovers = Counter(
            "kvprefetch_gateway_failovers",
            "Requests sent to another node because the engine of the node they were routed "
            "to refused the connection (it left the fleet, or restarts)", registry=r)
        self.token_store_errors = Counter("kvprefetch_gateway_token_store_errors",
                                          "Token ids that could not be stored", registry=r)
        self.in_flight = Gauge("kvprefetch_gateway_in_flight", "Requests in flight per node",
                               ["node"], registry=r)
        self._ttft = Histogram(
            "kvprefetch_gateway_ttft_seconds",
            "Arrival at the gateway to the upstream's first streamed chunk (the whole answer "
            "when not streaming), successful requests; returning: the session had an "
            "earlier turn at this gateway", ["deployment", "node", "tenant", "returning"],
            buckets=TTFT_BUCKETS_S, registry=r)
        self._route = Histogram("kvprefetch_gateway_route_seconds",
                                "The scheduler's route call, as the gateway waits for it",
                                ["deployment", "node", "tenant"], buckets=ROUTE_BUCKETS_S,
                                registry=r)
        self._tenant_label = LabelCap(max_tenants)
        self._seen = SeenSessions(max_sessions)
        seen = Gauge("kvprefetch_gateway_seen_sessions",
                     f"Sessions remembered to tell returning turns (at most {max_sessions})",
                     registry=r)
        seen.set_function(lambda: len(self._seen))
        #: Each known node -> whether the gateway routes to it now (read at scrape time).
        self._nodes: Callable[[], Mapping[int, bool]] = dict
        r.register(_ScrapeTime(self._node_families))

    def follow_nodes(self, nodes: Callable[[], Mapping[int, bool]]) -> None:
        """Where ``kvprefetch_gateway_node_routable`` reads the node set: each node the
        gateway knows -> whether it routes to it now."""
        self._nodes = nodes

    def _node_families(self) -> Iterator[Metric]:
        routable = GaugeMetricFamily(
            "kvprefetch_gateway_node_routable",
            "1 for each node the gateway routes to now (in the scheduler's fleet, its engine "
            "answering), 0 for each other node it knows", labels=["node"])
        for node, up in sorted(self._nodes().items()):
            routable.add_metric([str(node)], 1.0 if up else 0.0)
        yield routable

    def returning(self, key: SessionKey) -> bool:
        """Whether ``key`` had an earlier turn at this gateway; remembers this one."""
        return self._seen.seen_before(key)

    def ttft(self, seconds: float, *, node: int, tenant: str, returning: bool) -> None:
        self._ttft.labels(self.deployment, str(node), self._tenant_label(tenant),
                          "true" if returning else "false").observe(seconds)

    def route_time(self, seconds: float, *, node: int, tenant: str) -> None:
        self._route.labels(self.deployment, str(node),
                           self._tenant_label(tenant)).observe(seconds)


class _ScrapeTime:
    """A collector whose families are made when the registry is scraped."""

    def __init__(self, families: Callable[[], Iterator[Metric]]) -> None:
        self.collect = families
