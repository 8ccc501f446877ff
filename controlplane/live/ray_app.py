"""The control plane on Ray: the one place where ``ray.remote`` wraps the scheduler service,
and where the per-node actors are placed.

* ``SchedulerActor``: the :class:`~kvprefetch.controlplane.live.protocol.SchedulerAPI` of one
  :class:`SchedulerService` as a named actor (``kvprefetch-scheduler`` in namespace
  ``kvprefetch``), restarted by Ray when it dies; on restart it resumes from its journal
  and asks every agent to greet it again (their tier inventories rebuild its books). Its
  methods run one at a time, in the order each caller sent them; a thread inside it runs
  the control loop.
* :func:`start_shards`: ``N`` such actors as scheduler shards (``scheduler_name(i)``; shard 0
  keeps the unsharded name), each with its quota of the fleet and its journal segment
  (:meth:`ServiceConfig.for_shard`); clients find them through shard 0
  (:mod:`kvprefetch.controlplane.live.sharded`).
* :func:`deploy`: starts the scheduler (its shards), then one agent (and, on CPU-only
  clusters, one engine emulator) per node present at start, pinned by a per-node custom
  resource or by node affinity; agents and engines talk to every shard.
* :class:`NodeWatcher` (:meth:`Deployment.watch_nodes`): a thread in the deploying process
  that polls Ray every few seconds and gives a node that joins the cluster the next free
  node slot (``ServiceConfig.fleet.nodes`` is the capacity): it starts that slot's agent
  (and engine) there as :func:`deploy` does, and the agent's hello makes the scheduler
  take the node into the fleet and warm it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvprefetch.agents.agent import AgentConfig, RemoteStoreConfig
from kvprefetch.agents.engine_emulator import EngineConfig
from kvprefetch.agents.ray_entry import AgentActor, EngineActor
from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.actors import (
    NAMESPACE,
    SCHEDULER_NAME,
    agent_name,
    engine_name,
    node_resource,
    scheduler_name,
)
from kvprefetch.controlplane.base.errors import ServiceError, ServiceUnavailableError
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    HbmReport,
    TierEvictions,
    TransferOrder,
    TransferReport,
)
from kvprefetch.controlplane.live.node_registry import NodeListing
from kvprefetch.controlplane.live.packing import pack, unpack, unpack_event
from kvprefetch.controlplane.live.protocol import SchedulerAPI
from kvprefetch.controlplane.live.routes.claims import ClaimHolder
from kvprefetch.controlplane.live.scheduler_http import HttpFrontEnd, serve_scheduler
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionState

if TYPE_CHECKING:
    from kvprefetch.controlplane.live.http_api import HttpServer

log = logging.getLogger(__name__)


class _RayAgentPort:
    """AgentPort over Ray: fire-and-forget calls to the named agent actor of one node."""

    def __init__(self, node: int, namespace: str) -> None:
        self._node = node
        self._namespace = namespace
        self._handle: Any = None

    def _get(self) -> Any:
        if self._handle is None:
            try:
                self._handle = ray.get_actor(agent_name(self._node), namespace=self._namespace)
            except ValueError as exc:
                raise ServiceUnavailableError(f"no agent on node {self._node}") from exc
        return self._handle

    def execute(self, order: TransferOrder) -> None:
        self._get().execute.remote(order)

    def cancel(self, session_id: str, order_id: int) -> None:
        self._get().cancel.remote(session_id, order_id)

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None:
        self._get().evict.remote(prefixes, keys)

    def ask_greeting(self) -> None:
        self._get().greet.remote()


class _SchedulerActor:
    """Thin: every method of :class:`~kvprefetch.controlplane.live.protocol.SchedulerAPI`
    delegates to :class:`SchedulerService` (called by
    :class:`~kvprefetch.controlplane.live.client.RayTransport` and by the agents' and
    engines' actors); ``ping``, ``metrics_text`` and ``close`` serve the deployment."""

    def __init__(self, config: ServiceConfig, namespace: str = NAMESPACE, *,
                 with_agents: bool = True, http: HttpFrontEnd | None = None) -> None:
        logging.basicConfig(level=logging.INFO)
        # Without agents (the control-plane benchmark) orders go nowhere and are re-planned
        # by the service, as for a node whose agent is down.
        ports = ({i: _RayAgentPort(i, namespace) for i in range(config.fleet.nodes)}
                 if with_agents else {})
        metrics = None
        try:
            from kvprefetch.controlplane.live.metrics import PrometheusMetrics

            metrics = PrometheusMetrics()
        except ImportError:
            log.info("prometheus_client not installed: no metrics")
        self.metrics = metrics
        self.svc = SchedulerService(config, agents=ports, metrics=metrics)
        self.svc.start()
        for port in ports.values():  # agents alive from before a restart: greet again
            try:
                port.ask_greeting()
            except Exception:
                log.debug("agent not up yet", exc_info=True)
        #: The HTTP API served in this process (``http``), else None.
        self.http: HttpServer | None = None
        if http is not None:
            try:
                self.http = serve_scheduler(self.svc, http, self.metrics_text)
            except BaseException:
                self.svc.close()
                raise
            log.info("HTTP API in the scheduler's process on %s", self.http.url)

    def http_url(self) -> str | None:
        """The URL of the HTTP API this actor serves (None: it serves none)."""
        return self.http.url if self.http is not None else None

    def ping(self) -> bool:
        """True while the scheduler answers and its journal takes records
        (JournalUnavailableError otherwise: ``/healthz`` answers 503)."""
        self.svc.check_health()
        return True

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        return self.svc.route(call)

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        return self.svc.cancel_route(call)

    def request_started(self, call: api.RequestStarted) -> api.Ack:
        return self.svc.request_started(call)

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        return self.svc.request_finished(call)

    def hint(self, call: api.HintCall) -> api.Ack:
        return self.svc.hint(call)

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        return self.svc.session_closed(call)

    def session_state(self, call: SessionQuery) -> SessionState:
        return self.svc.session_state(call)

    # -- batched fire-and-forget events (kvprefetch.controlplane.live.batching.EventBatcher) --
    def apply_events(self, events: Sequence[tuple[str, Any]]) -> list[str]:
        """Apply queued events in the order they were queued; one message per event the
        service refused or failed (empty: all applied). A refusal does not stop the rest:
        each event stands alone, as when it was its own call."""
        refused: list[str] = []
        with self.svc.batch():
            self._apply(events, refused)
        return refused

    def _apply(self, events: Sequence[tuple[str, Any]], refused: list[str]) -> None:
        for kind, call in events:
            method = _BATCHED.get(kind)
            try:
                if method is None:
                    raise ValueError(f"not a batched event: {kind!r}")
                method(self.svc, unpack_event(kind, call))
            except Exception as exc:  # counted by the client, never fatal to the batch
                log.debug("batched %s refused", kind, exc_info=True)
                refused.append(f"{kind}: {type(exc).__name__}: {exc}")

    def route_after(self, events: Sequence[tuple[str, Any]],
                    call: api.RouteQuery | tuple[Any, ...]
                    ) -> tuple[list[str], tuple[Any, ...]]:
        """The events queued before this route, then the route: one actor call, one
        step. The answer is packed (:mod:`kvprefetch.controlplane.live.packing`)."""
        refused: list[str] = []
        with self.svc.batch():
            self._apply(events, refused)
            answer = self.svc.route(unpack(api.RouteQuery, call))
        return refused, pack(answer)

    def route_many_after(self, events: Sequence[tuple[str, Any]],
                         calls: Sequence[api.RouteQuery | tuple[Any, ...]]
                         ) -> tuple[list[str], list[tuple[Any, ...] | ServiceError]]:
        """The events queued before these routes, then the routes in order: one actor
        call. A refused route answers its typed error; the others are routed (answers
        packed, :mod:`kvprefetch.controlplane.live.packing`)."""
        refused: list[str] = []
        answers: list[tuple[Any, ...] | ServiceError] = []
        route = self.svc.route
        with self.svc.batch():
            self._apply(events, refused)
            for call in calls:
                try:
                    answers.append(pack(route(unpack(api.RouteQuery, call))))
                except ServiceError as exc:
                    answers.append(exc)
        return refused, answers

    def cpu_seconds(self) -> float:
        """CPU seconds this actor process has used (all its threads, Ray's included)."""
        return time.process_time()

    def rss_bytes(self) -> int:
        """This actor process's resident memory (Linux ``/proc``; 0 elsewhere)."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def epoch(self) -> int:
        """This incarnation's epoch (a restarted shard answers a new one)."""
        return self.svc.epoch

    def shard_info(self) -> tuple[int, int]:
        """(this shard, how many): what a client needs to hash sessions to shards."""
        return self.svc.config.shard, self.svc.config.shards

    def gpu_start(self, node: int, tenant: str, session_id: str,
                  reused_tokens: int) -> GpuStartPlan:
        return self.svc.gpu_start(node, tenant, session_id, reused_tokens)

    def use_local(self, node: int, tenant: str, session_id: str, reused_tokens: int,
                  done: TransferReport | None = None) -> int:
        return self.svc.use_local(node, tenant, session_id, reused_tokens, done)

    def engine_report(self, report: EngineReport) -> None:
        self.svc.engine_report(report)

    def agent_hello(self, hello: AgentHello) -> None:
        self.svc.agent_hello(hello)

    def report_transfer(self, report: TransferReport) -> None:
        self.svc.report_transfer(report)

    def node_status(self, status: AgentStatus) -> None:
        self.svc.node_status(status)

    def tier_evicted(self, evictions: TierEvictions) -> None:
        self.svc.tier_evicted(evictions)

    def hbm_changed(self, report: HbmReport) -> None:
        self.svc.hbm_changed(report)

    def nodes(self) -> NodeListing:
        return self.svc.nodes()

    def node_left(self, node: int) -> None:
        self.svc.node_left(node)

    def summary(self) -> dict[str, Any]:
        return self.svc.summary()

    def sessions(self) -> int:
        return self.svc.sessions()

    def has_session(self, tenant: str, session_id: str) -> bool:
        return self.svc.has_session(tenant, session_id)

    def claim_request_id(self, tenant: str, request_id: str, session_id: str,
                         replacing: str | None = None) -> ClaimHolder | None:
        return self.svc.claim_request_id(tenant, request_id, session_id, replacing)

    def remembers_route(self, tenant: str, request_id: str, session_id: str) -> bool:
        return self.svc.remembers_route(tenant, request_id, session_id)

    def metrics_text(self) -> bytes:
        return self.metrics.render() if self.metrics is not None else b""

    def close(self) -> None:
        if self.http is not None:  # the API's calls in progress end before the service
            self.http.close()
        self.svc.close()


#: The events a batch may carry, by the name the client queues them under.
_BATCHED: dict[str, Callable[[SchedulerService, Any], Any]] = {
    "request_started": SchedulerService.request_started,
    "request_finished": SchedulerService.request_finished,
    "hint": SchedulerService.hint,
    "session_closed": SchedulerService.session_closed,
    "report_transfer": SchedulerService.report_transfer,
    "engine_report": SchedulerService.engine_report,
}

if TYPE_CHECKING:  # mypy checks the actor against the Protocol its callers rely on
    _ACTOR: type[SchedulerAPI] = _SchedulerActor

_remote: Any = ray.remote  # the stubs do not know max_concurrency
SchedulerActor = _remote(max_restarts=-1, max_task_retries=0, max_concurrency=1,
                         num_cpus=0)(_SchedulerActor)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where node ``i``'s actors go: a custom resource (one machine) or a Ray node id."""

    resource: str | None = None
    node_id: str | None = None

    @property
    def key(self) -> str:
        """What identifies the node over polls: the Ray node id, else the resource."""
        return self.node_id or self.resource or ""

    def options(self) -> dict[str, Any]:
        if self.node_id is not None:
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(self.node_id,
                                                                          soft=False)}
        if self.resource is not None:
            return {"resources": {self.resource: 0.01}}
        return {}


@dataclass
class Deployment:
    """Handles of a deployed control plane (the actors live as long as their owner, or
    forever when ``detached``). ``agents``/``engines`` are in the order they started
    (node order at deploy; joined nodes after); ``placements[i]`` is node ``i``'s."""

    #: Scheduler shard 0 (the only one when unsharded); every shard in ``schedulers``.
    scheduler: Any
    agents: list[Any] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)
    namespace: str = NAMESPACE
    placements: dict[int, Placement] = field(default_factory=dict)
    #: The fleet's capacity (``ServiceConfig.fleet.nodes``).
    capacity: int = 0
    detached: bool = False
    ready_timeout_s: float = 120.0
    watcher: NodeWatcher | None = None
    schedulers: list[Any] = field(default_factory=list)

    def watch_nodes(self, discover: Callable[[], Sequence[NodeCandidate]],
                    make_agent: Callable[[int, NodeCandidate], AgentConfig], *,
                    make_engine: Callable[[int], EngineConfig | None] | None = None,
                    engine_remote: RemoteStoreConfig | None = None,
                    interval_s: float = 5.0) -> NodeWatcher:
        """Start a :class:`NodeWatcher` that gives each node ``discover`` finds and that has
        no slot yet the next free one, and starts there the agent ``make_agent(slot,
        node)`` (and the engine ``make_engine(slot)``, if it returns one). Stopped by
        :meth:`shutdown`."""
        if self.watcher is not None:
            raise RuntimeError("this deployment already watches for nodes")

        def start(node: int, candidate: NodeCandidate) -> None:
            where = candidate.placement
            engine = make_engine(node) if make_engine is not None else None
            started: list[Any] = []
            try:  # all or nothing: a named actor left behind would pin the slot's next try
                started.append(_start_agent(make_agent(node, candidate), where,
                                            self.namespace, self.detached,
                                            len(self.schedulers) or 1))
                ray.get(started[0].status.remote(), timeout=self.ready_timeout_s)
                if engine is not None:
                    started.append(_start_engine(engine, engine_remote, where,
                                                 self.namespace, self.detached,
                                                 len(self.schedulers) or 1))
                    ray.get(started[1].ping.remote(), timeout=self.ready_timeout_s)
            except Exception:
                for handle in started:
                    with contextlib.suppress(Exception):
                        ray.kill(handle, no_restart=True)
                raise
            self.agents.append(started[0])
            self.engines.extend(started[1:])
            self.placements[node] = where
            try:
                w = ray.get(started[0].where.remote(), timeout=self.ready_timeout_s)
            except Exception:  # only for the log: the agent is up
                log.debug("where() failed", exc_info=True)
            else:
                log.info("placed agent %d on Ray node %s at %s: tier %s", node, w["node_id"],
                         w["ip"], w["tier_path"] or f"LMCache L1 at {w['lmcache_url']}")

        def lost(node: int) -> None:
            # Every shard takes the node out; the slot's agent actor goes (its name would
            # pin the slot's next start).
            ray.get([s.node_left.remote(node) for s in self.schedulers or [self.scheduler]],
                    timeout=self.ready_timeout_s)
            for name in (agent_name(node), engine_name(node)):
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            self.placements.pop(node, None)

        placed = {p.key: i for i, p in self.placements.items()}
        self.watcher = NodeWatcher(discover, start, capacity=self.capacity, placed=placed,
                                   interval_s=interval_s, lost=lost).start()
        return self.watcher

    def shutdown(self) -> None:
        """Stop the node watcher, then close and kill every actor (no restart)."""
        if self.watcher is not None:
            self.watcher.stop()
        for handle in [*self.engines, *self.agents, *(self.schedulers or [self.scheduler])]:
            try:
                ray.get(handle.close.remote(), timeout=10)
            except Exception:
                log.debug("close failed", exc_info=True)
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                log.debug("kill failed", exc_info=True)


def local_placements(nodes: int) -> list[Placement]:
    return [Placement(resource=node_resource(i)) for i in range(nodes)]


def matching_nodes(nodes: Sequence[dict[str, Any]] | None = None, *,
                   resource: str | None = "GPU",
                   labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The alive Ray nodes (``ray.nodes()`` entries) that have ``resource`` (None = any) and
    every one of ``labels``, in NodeID order (stable over calls)."""
    found = []
    for n in sorted(nodes if nodes is not None else ray.nodes(), key=lambda n: n["NodeID"]):
        if not n.get("Alive", True):
            continue
        if resource is not None and n.get("Resources", {}).get(resource, 0) <= 0:
            continue
        have = n.get("Labels") or {}
        if labels and any(have.get(k) != v for k, v in labels.items()):
            continue
        found.append(n)
    return found


def gpu_node_placements(nodes: Sequence[dict[str, Any]] | None = None, *,
                        resource: str | None = "GPU",
                        labels: Mapping[str, str] | None = None) -> list[Placement]:
    """One placement per alive Ray node that has ``resource`` (None = every node) and all
    ``labels`` (see :func:`matching_nodes`)."""
    return [Placement(node_id=n["NodeID"])
            for n in matching_nodes(nodes, resource=resource, labels=labels)]


def _lifetime(detached: bool) -> dict[str, Any]:
    return {"lifetime": "detached"} if detached else {}


def _start_agent(cfg: AgentConfig, where: Placement, namespace: str, detached: bool,
                 shards: int = 1) -> Any:
    """Node ``cfg.node``'s agent, taking orders from (and reporting to) ``shards`` shards."""
    cfg = cfg.model_copy(update={"scheduler_shards": shards})
    return AgentActor.options(name=agent_name(cfg.node), namespace=namespace,
                              get_if_exists=True, **_lifetime(detached),
                              **where.options()).remote(cfg, SCHEDULER_NAME, namespace)


def _start_engine(cfg: EngineConfig, remote: RemoteStoreConfig | None, where: Placement,
                  namespace: str, detached: bool, shards: int = 1) -> Any:
    return EngineActor.options(name=engine_name(cfg.node), namespace=namespace,
                               get_if_exists=True, **_lifetime(detached),
                               **where.options()).remote(cfg, remote, SCHEDULER_NAME,
                                                         namespace, shards)


def start_shards(service: ServiceConfig, shards: int, *, namespace: str = NAMESPACE,
                 detached: bool = False, ready_timeout_s: float = 120.0,
                 placement: Placement | None = None, with_agents: bool = True,
                 http: HttpFrontEnd | None = None) -> list[Any]:
    """Start ``shards`` scheduler shards (named ``scheduler_name(i)``; each with
    ``service.for_shard(i, shards)``: its quota of every node, its journal segment) or get
    those running, and wait until each answers. Ray restarts a shard that dies; it resumes
    from its own journal segment while the others keep serving. ``http``: the one shard
    serves the HTTP API in its process (:mod:`~kvprefetch.controlplane.live.scheduler_http`;
    ConfigError for ``shards`` > 1)."""
    if http is not None:
        http.check(shards)
    where = placement.options() if placement is not None else {}
    handles = [SchedulerActor.options(name=scheduler_name(i), namespace=namespace,
                                      get_if_exists=True, **_lifetime(detached),
                                      **where).remote(service.for_shard(i, shards), namespace,
                                                      with_agents=with_agents, http=http)
               for i in range(shards)]
    ray.get([h.ping.remote() for h in handles], timeout=ready_timeout_s)
    return handles


def deploy(service: ServiceConfig, agents: Sequence[AgentConfig],
           placements: Sequence[Placement], *, engines: Sequence[EngineConfig] = (),
           engine_remote: RemoteStoreConfig | None = None, namespace: str = NAMESPACE,
           detached: bool = False, ready_timeout_s: float = 120.0,
           scheduler_placement: Placement | None = None, shards: int = 1,
           http: HttpFrontEnd | None = None) -> Deployment:
    """Start the scheduler's ``shards`` shards (at ``scheduler_placement``, e.g. the head
    node that holds their journals; anywhere when None), then agent ``i`` (and engine
    ``i``) at ``placements[i]`` for the nodes present at start (``service.initial_nodes``,
    default all), each talking to every shard. Waits until every actor answers. Nodes that
    join later: :meth:`Deployment.watch_nodes`. ``http``: the scheduler serves the HTTP
    API in its own process (see :func:`start_shards`)."""
    if len(agents) != len(placements) or len(agents) != service.nodes_at_start:
        raise ValueError(f"one agent config and one placement per node present at start "
                         f"({service.nodes_at_start}); got {len(agents)} and "
                         f"{len(placements)}")
    schedulers = start_shards(service, shards, namespace=namespace, detached=detached,
                              ready_timeout_s=ready_timeout_s, placement=scheduler_placement,
                              http=http)
    handles = [_start_agent(cfg, p, namespace, detached, shards)
               for cfg, p in zip(agents, placements, strict=True)]
    ray.get([h.status.remote() for h in handles], timeout=ready_timeout_s)
    engine_handles = [_start_engine(cfg, engine_remote, placements[cfg.node], namespace,
                                    detached, shards) for cfg in engines]
    ray.get([h.ping.remote() for h in engine_handles], timeout=ready_timeout_s)
    return Deployment(schedulers[0], handles, engine_handles, namespace,
                      placements={cfg.node: p for cfg, p in zip(agents, placements,
                                                                strict=True)},
                      capacity=service.fleet.nodes, detached=detached,
                      ready_timeout_s=ready_timeout_s, schedulers=schedulers)


# ---------------------------------------------------------------------------- joining nodes
@dataclass(frozen=True, slots=True)
class NodeCandidate:
    """A Ray node that may get a node slot: where its actors go (``placement.key``
    identifies it over polls), the slot it must have (``slot``: the local variant, whose
    resource names it) or None (the next free one), and its ``ray.nodes()`` entry."""

    placement: Placement
    slot: int | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


def ray_node_candidates(nodes: Sequence[dict[str, Any]] | None = None, *,
                        resource: str | None = "GPU",
                        labels: Mapping[str, str] | None = None) -> list[NodeCandidate]:
    """Every alive Ray node with ``resource`` and ``labels`` (as :func:`gpu_node_placements`
    finds them), pinned by node affinity, in NodeID order."""
    return [NodeCandidate(Placement(node_id=n["NodeID"]), None, n)
            for n in matching_nodes(nodes, resource=resource, labels=labels)]


def assign_slots(candidates: Sequence[NodeCandidate], placed: Mapping[str, int],
                 capacity: int) -> tuple[list[tuple[int, NodeCandidate]], list[NodeCandidate]]:
    """Pure: the candidates that have no slot yet, each with the slot it gets (its own, or
    the lowest free one below ``capacity``), and those left without one (the fleet is
    full, or their own slot is taken)."""
    taken = set(placed.values())
    joins: list[tuple[int, NodeCandidate]] = []
    refused: list[NodeCandidate] = []
    for c in candidates:
        if c.placement.key in placed:
            continue
        if c.slot is not None:
            slot: int | None = c.slot if c.slot < capacity and c.slot not in taken else None
        else:
            slot = next((i for i in range(capacity) if i not in taken), None)
        if slot is None:
            refused.append(c)
            continue
        taken.add(slot)
        joins.append((slot, c))
    return joins, refused


class NodeWatcher:
    """Gives Ray nodes that join after start a node slot and starts its actors there.

    ``discover()`` (every ``interval_s`` wall seconds, on the watcher's thread) lists the
    candidate nodes; each one not placed yet gets a slot (:func:`assign_slots`) and
    ``start(slot, candidate)`` starts its agent (and engine): the agent's hello makes the
    scheduler take the node in and warm it. A start that fails is logged and counted, and
    retried on the next poll; once the fleet is full, refused nodes are logged once and
    ignored. A placed node that ``discover()`` no longer lists in ``LOST_AFTER_POLLS``
    polls in a row (its Ray node died or no longer matches) is lost: ``lost(slot)`` takes
    it out of the fleet and its slot is free for a node that joins later. The loop never
    dies. :meth:`poll` runs one pass (tests call it directly)."""

    #: Polls in a row a placed node must be missing from to count as lost (one poll may
    #: see a raylet that is re-registering).
    LOST_AFTER_POLLS = 2

    def __init__(self, discover: Callable[[], Sequence[NodeCandidate]],
                 start: Callable[[int, NodeCandidate], None], *, capacity: int,
                 placed: Mapping[str, int], interval_s: float = 5.0,
                 lost: Callable[[int], None] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._discover = discover
        self._start = start
        self._lost = lost
        #: Placed nodes missing from the last polls, by key: polls missed in a row.
        self._missing: dict[str, int] = {}
        self.lost = 0
        self.capacity = capacity
        #: Slot of every node placed so far, by :attr:`Placement.key`.
        self.placed: dict[str, int] = dict(placed)
        self.interval_s = interval_s
        self.joined = 0
        self.start_failures = 0
        self.poll_errors = 0
        self._full_logged = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NodeWatcher:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="kvprefetch-node-watcher",
                                            daemon=True)
            self._thread.start()
            log.info("watching for nodes that join: every %g s, %d of %d node slots taken",
                     self.interval_s, len(self.placed), self.capacity)
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # the watcher never dies: log, count, poll again
                self.poll_errors += 1
                log.exception("node watcher: poll failed")

    def _forget_lost(self, listed: set[str]) -> None:
        """Placed nodes missing ``LOST_AFTER_POLLS`` polls in a row: ``lost(slot)``,
        then the slot is free. A ``lost`` that fails is retried on the next poll."""
        if self._lost is None:
            return
        for key in [k for k in self._missing if k in listed]:
            del self._missing[key]
        for key, slot in sorted(self.placed.items(), key=lambda kv: kv[1]):
            if key in listed:
                continue
            self._missing[key] = misses = self._missing.get(key, 0) + 1
            if misses < self.LOST_AFTER_POLLS:
                continue
            log.warning("Ray node %s (node %d) is gone: taking the node out of the fleet",
                        key, slot)
            try:
                self._lost(slot)
            except Exception as exc:  # retried on the next poll
                log.warning("node %d: could not report it lost: %s", slot, exc)
                continue
            del self.placed[key]
            del self._missing[key]
            self.lost += 1

    def poll(self) -> list[int]:
        """One pass; returns the slots whose actors were started."""
        candidates = self._discover()
        self._forget_lost({c.placement.key for c in candidates})
        joins, refused = assign_slots(candidates, self.placed, self.capacity)
        started = []
        for slot, candidate in joins:
            if self._stop.is_set():
                break
            key = candidate.placement.key
            log.info("Ray node %s joined: starting node %d's agent there", key, slot)
            try:
                self._start(slot, candidate)
            except Exception as exc:  # retried on the next poll
                self.start_failures += 1
                log.warning("node %d: could not start its actors on Ray node %s: %s", slot,
                            key, exc)
                continue
            self.placed[key] = slot
            self.joined += 1
            started.append(slot)
        if refused and not self._full_logged:
            self._full_logged = True
            log.warning("Ray node %s has no free node slot (the fleet has %d, all taken, or "
                        "its own is): ignored, as are further ones; a larger fleet needs a "
                        "restart with more nodes", refused[0].placement.key, self.capacity)
        return started
