"""The control plane on Ray: the one place where ``ray.remote`` wraps the scheduler service,
and where the per-node actors are placed.

* ``SchedulerActor``: the :class:`~controlplane.live.protocol.SchedulerAPI` of one
  :class:`SchedulerService` as a named actor (``kvprefetch-scheduler`` in namespace
  ``kvprefetch``), restarted by Ray when it dies; on restart it resumes from its journal
  and asks every agent to greet it again (their tier inventories rebuild its books). Its
  methods run one at a time, in the order each caller sent them; a thread inside it runs
  the control loop.
* :func:`deploy`: starts the scheduler, then one agent (and, on CPU-only clusters, one
  engine emulator) per node, pinned by a per-node custom resource or by node affinity.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agents.agent import AgentConfig, RemoteStoreConfig
from agents.engine_emulator import EngineConfig
from agents.ray_entry import (
    NAMESPACE,
    SCHEDULER_NAME,
    AgentActor,
    EngineActor,
    agent_name,
    engine_name,
    node_resource,
)
from controlplane.base import api
from controlplane.base.errors import ServiceUnavailableError
from controlplane.base.wire import (
    AgentHello,
    EngineReport,
    GpuStartPlan,
    TransferOrder,
    TransferReport,
)
from controlplane.live.protocol import SchedulerAPI
from controlplane.live.service import SchedulerService, ServiceConfig

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
    """Thin: every method of :class:`~controlplane.live.protocol.SchedulerAPI` delegates to
    :class:`SchedulerService` (:class:`~controlplane.live.client.RayTransport` calls them);
    ``ping``, ``metrics_text`` and ``close`` serve the deployment."""

    def __init__(self, config: ServiceConfig, namespace: str = NAMESPACE) -> None:
        logging.basicConfig(level=logging.INFO)
        ports = {i: _RayAgentPort(i, namespace) for i in range(config.fleet.nodes)}
        metrics = None
        try:
            from controlplane.live.metrics import PrometheusMetrics

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

    def ping(self) -> bool:
        return True

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        return self.svc.route(call)

    def request_started(self, call: api.RequestStarted) -> api.Ack:
        return self.svc.request_started(call)

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        return self.svc.request_finished(call)

    def hint(self, call: api.HintCall) -> api.Ack:
        return self.svc.hint(call)

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        return self.svc.session_closed(call)

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

    def summary(self) -> dict[str, Any]:
        return self.svc.summary()

    def sessions(self) -> int:
        return self.svc.sessions()

    def has_session(self, tenant: str, session_id: str) -> bool:
        return self.svc.has_session(tenant, session_id)

    def metrics_text(self) -> bytes:
        return self.metrics.render() if self.metrics is not None else b""

    def close(self) -> None:
        self.svc.close()


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
    forever when ``detached``)."""

    scheduler: Any
    agents: list[Any] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)
    namespace: str = NAMESPACE

    def shutdown(self) -> None:
        """Close and kill every actor (no restart)."""
        for handle in [*self.engines, *self.agents, self.scheduler]:
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


def deploy(service: ServiceConfig, agents: Sequence[AgentConfig],
           placements: Sequence[Placement], *, engines: Sequence[EngineConfig] = (),
           engine_remote: RemoteStoreConfig | None = None, namespace: str = NAMESPACE,
           detached: bool = False, ready_timeout_s: float = 120.0,
           scheduler_placement: Placement | None = None) -> Deployment:
    """Start the scheduler (at ``scheduler_placement``, e.g. the head node that holds its
    journal; anywhere when None), then agent ``i`` (and engine ``i``) at ``placements[i]``.
    Waits until every actor answers."""
    if len(agents) != len(placements) or len(agents) != service.fleet.nodes:
        raise ValueError("one agent config and one placement per node")
    lifetime = {"lifetime": "detached"} if detached else {}
    where = scheduler_placement.options() if scheduler_placement is not None else {}
    scheduler = SchedulerActor.options(name=SCHEDULER_NAME, namespace=namespace,
                                       get_if_exists=True, **lifetime, **where).remote(
                                           service, namespace)
    ray.get(scheduler.ping.remote(), timeout=ready_timeout_s)
    handles = [
        AgentActor.options(name=agent_name(cfg.node), namespace=namespace, get_if_exists=True,
                           **lifetime, **p.options()).remote(cfg, SCHEDULER_NAME, namespace)
        for cfg, p in zip(agents, placements, strict=True)
    ]
    ray.get([h.status.remote() for h in handles], timeout=ready_timeout_s)
    engine_handles = [
        EngineActor.options(name=engine_name(cfg.node), namespace=namespace,
                            get_if_exists=True, **lifetime,
                            **placements[cfg.node].options()).remote(
                                cfg, engine_remote, SCHEDULER_NAME, namespace)
        for cfg in engines
    ]
    ray.get([h.ping.remote() for h in engine_handles], timeout=ready_timeout_s)
    return Deployment(scheduler, handles, engine_handles, namespace)
