"""Ray entry points of the per-node parts: the one place where ``ray.remote`` wraps
:class:`~kvprefetch.agents.agent.PrefetchAgent` and
:class:`~kvprefetch.agents.engine_emulator.EngineEmulator`.

* ``AgentActor``: one per GPU node (named ``kvprefetch-agent-<node>``), restarted by Ray
  when it dies; on every (re)start it greets the scheduler with its incarnation and the
  keys its tier still holds, so orders sent to a dead predecessor are re-planned (once its
  engine can take warm orders: a node that joins the fleet is warmed at once); every
  ``status_interval_s`` it reports its tier's capacity and occupancy to every shard
  (their quotas of the node follow it), and what its tier evicts by its own order (LMCache's
  L1: as its KV events tell) goes to the shards that own those sessions (their books drop
  them).
* ``EngineActor``: one per node on CPU-only clusters (named ``kvprefetch-engine-<node>``),
  serving many requests at once (threads), each blocking until its response ends.

Their calls on the scheduler's shards are the methods of
:class:`~kvprefetch.controlplane.base.scheduler_api.NodeAPI`, which name and type them.

Placement is chosen by the caller (:mod:`kvprefetch.controlplane.live.ray_app`): node
affinity on a real cluster, a per-node custom resource
(:func:`~kvprefetch.controlplane.base.actors.node_resource`) on one machine. The actors'
names are those of :mod:`kvprefetch.controlplane.base.actors`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.engine_emulator import (
    EngineConfig,
    EngineEmulator,
    ServeRequest,
    ServeResult,
)
from kvprefetch.agents.lmcache.kv_events import KVEventStats
from kvprefetch.controlplane.base.actors import (
    NAMESPACE,
    SCHEDULER_NAME,
    agent_name,
    scheduler_name,
)
from kvprefetch.controlplane.base.scheduler_api import NodeAPI
from kvprefetch.controlplane.base.shards import (
    ShardRing,
    split_engine_report,
    split_hbm_report,
    split_tier_evictions,
)
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    TransferOrder,
    TransferReport,
    order_epoch,
)

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")

#: Seconds an engine waits for the scheduler before serving without its advice.
ENGINE_CALL_TIMEOUT_S = 10.0
#: Longest wait of the agent's eviction sender for the tier's next evictions (seconds).
EVICTIONS_WAIT_S = 0.5
#: How often an agent whose engine has not registered yet asks again (seconds).
ENGINE_READY_POLL_S = 1.0


class _SchedulerRef:
    """One scheduler shard's actor, looked up by name (and again after :meth:`reset`, once
    it restarted). Its calls are the methods of
    :class:`~kvprefetch.controlplane.base.scheduler_api.NodeAPI`, which name and type them:
    ``ref.send(NodeAPI.report_transfer, report)``."""

    def __init__(self, name: str = SCHEDULER_NAME, namespace: str = NAMESPACE) -> None:
        self._name = name
        self._namespace = namespace
        self._handle: Any = None

    def get(self) -> Any:
        """The actor handle (ValueError while no actor has the name)."""
        if self._handle is None:
            self._handle = ray.get_actor(self._name, namespace=self._namespace)
        return self._handle

    def reset(self) -> None:
        self._handle = None

    def send(self, call: Callable[Concatenate[NodeAPI, _P], object], /,
             *args: _P.args, **kwargs: _P.kwargs) -> Any:
        """Start ``call`` on the actor and return its ObjectRef at once (fire and forget
        unless the caller waits on it)."""
        return getattr(self.get(), call.__name__).remote(*args, **kwargs)

    def ask(self, timeout_s: float, call: Callable[Concatenate[NodeAPI, _P], _R], /,
            *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """``call`` on the actor, waiting at most ``timeout_s`` seconds for its answer
        (``ray.exceptions.GetTimeoutError`` after)."""
        answer: _R = ray.get(self.send(call, *args, **kwargs), timeout=timeout_s)
        return answer


class _Shards:
    """Every scheduler shard's reference: the one that issued an order (its epoch modulo
    the shard count), the one that owns a session (:class:`ShardRing`), or all."""

    def __init__(self, shards: int, base: str, namespace: str) -> None:
        self.refs = [_SchedulerRef(scheduler_name(i, base), namespace) for i in range(shards)]
        self.ring = ShardRing(shards)

    def of_order(self, order_id: int) -> _SchedulerRef:
        return self.refs[order_epoch(order_id) % len(self.refs)]

    def owner(self, tenant: str, session_id: str) -> _SchedulerRef:
        return self.refs[self.ring.owner(tenant, session_id)]


class _AgentActor:
    def __init__(self, config: AgentConfig, scheduler_name: str = SCHEDULER_NAME,
                 namespace: str = NAMESPACE) -> None:
        logging.basicConfig(level=logging.INFO)
        self._shards = _Shards(config.scheduler_shards, scheduler_name, namespace)
        self.agent = PrefetchAgent(config, reporter=self._report)
        self.agent.start()
        self._closed = threading.Event()
        if self._engine_ready():
            self.greet()
        else:
            log.info("agent %d: its engine has not registered yet; saying hello once it has",
                     config.node)
            threading.Thread(target=self._greet_when_engine_ready,
                             name=f"agent-{config.node}-hello", daemon=True).start()
        if config.status_interval_s > 0:
            threading.Thread(target=self._send_status, args=(config.status_interval_s,),
                             name=f"agent-{config.node}-status", daemon=True).start()
        threading.Thread(target=self._send_evictions, name=f"agent-{config.node}-evicted",
                         daemon=True).start()

    def _engine_ready(self) -> bool:
        try:
            return self.agent.backend.engine_ready()
        except Exception as exc:  # its server restarts: ask again
            log.debug("agent %d: engine readiness not known: %s", self.agent.node, exc)
            return False

    def _greet_when_engine_ready(self) -> None:
        """The first greeting, once the node's engine can take warm orders
        (:meth:`~kvprefetch.agents.backends.base.NodeBackend.engine_ready`, asked every
        ``ENGINE_READY_POLL_S``): the hello of a node out of the fleet joins it, and the
        scheduler warms it at once."""
        while not self._closed.wait(ENGINE_READY_POLL_S):
            if self._engine_ready():
                self.greet()
                return

    def _send_evictions(self) -> None:
        """What the tier evicted by its own order, to the shards that own the sessions
        (batched: what accrued while the last batch was sent goes in the next)."""
        while not self._closed.is_set():
            try:
                evicted = self.agent.take_evictions(EVICTIONS_WAIT_S)
            except Exception:  # the agent is closing
                log.warning("agent %d: evictions not read", self.agent.node, exc_info=True)
                self._closed.wait(EVICTIONS_WAIT_S)
                continue
            self._send_hbm()
            if evicted is None:
                continue
            for shard, part in split_tier_evictions(evicted, self._shards.ring).items():
                ref = self._shards.refs[shard]
                try:
                    ref.send(NodeAPI.tier_evicted, part)
                except Exception as exc:  # the shard's next reconcile drops them
                    ref.reset()
                    log.warning("agent %d: shard %d not told of %d evicted sessions: %s",
                                self.agent.node, shard, len(part.sessions), exc)

    def _send_hbm(self) -> None:
        """The engine's HBM changes (its KV events), to the shards that own the sessions
        (a listing to every shard)."""
        try:
            report = self.agent.take_hbm()
        except Exception:  # the agent is closing
            log.warning("agent %d: HBM changes not read", self.agent.node, exc_info=True)
            return
        if report is None:
            return
        for shard, part in split_hbm_report(report, self._shards.ring).items():
            ref = self._shards.refs[shard]
            try:
                ref.send(NodeAPI.hbm_changed, part)
            except Exception as exc:  # the next change, or the next listing, mends it
                ref.reset()
                log.warning("agent %d: shard %d not told of %d HBM changes: %s",
                            self.agent.node, shard, len(part.sessions), exc)

    def _send_status(self, interval_s: float) -> None:
        """Every ``interval_s``: the tier's capacity and occupancy to every shard."""
        while not self._closed.wait(interval_s):
            self._status_to(self._shards.refs)

    def _status_to(self, refs: Sequence[_SchedulerRef]) -> None:
        """The tier's capacity and occupancy to ``refs`` (fire and forget: a shard that is
        down gets the next one)."""
        try:
            status = self.agent.status()
        except Exception:  # the agent is closing, or its tier is not reachable now
            log.warning("agent %d: no status to report", self.agent.node, exc_info=True)
            return
        for ref in refs:
            try:
                ref.send(NodeAPI.node_status, status)
            except Exception as exc:
                ref.reset()
                log.debug("agent %d: shard not reachable for a status: %s",
                          self.agent.node, exc)

    def _report(self, report: TransferReport) -> None:
        ref = self._shards.of_order(report.order_id)
        try:
            ref.send(NodeAPI.report_transfer, report)
        except Exception:
            ref.reset()
            raise

    def greet(self) -> bool:
        """Tell every scheduler shard this incarnation is up (also after one restarts),
        then the tier's status (a restarted shard plans with the real capacity at once)."""
        ok = True
        greeted = []
        for ref in self._shards.refs:
            try:
                ref.send(NodeAPI.agent_hello, self.agent.hello())
                greeted.append(ref)
            except Exception as exc:
                ref.reset()
                log.warning("agent %d: scheduler not reachable yet: %s", self.agent.node, exc)
                ok = False
        if self.agent.config.status_interval_s > 0:
            self._status_to(greeted)
        self.agent.relist_hbm()  # the next HBM report is a listing: a new shard has none
        return ok

    def hello(self) -> AgentHello:
        return self.agent.hello()

    def execute(self, order: TransferOrder) -> None:
        self.agent.execute(order)

    def cancel(self, session_id: str, order_id: int | None = None) -> int:
        return self.agent.cancel(session_id, order_id)

    def evict(self, prefixes: Sequence[str], keys: Sequence[str]) -> int:
        return self.agent.evict(prefixes, keys)

    def wait(self, order_id: int, timeout_s: float | None = None) -> TransferReport | None:
        return self.agent.wait(order_id, timeout_s)

    def write_local(self, items: Sequence[tuple[str, bytes]], drop: Sequence[str] = ()
                    ) -> int:
        return self.agent.write_local(items, drop)

    def inventory(self) -> tuple[str, ...]:
        return self.agent.inventory()

    def has(self, keys: Sequence[str]) -> list[bool]:
        return self.agent.has(keys)

    def status(self) -> AgentStatus:
        return self.agent.status()

    def kv_events(self) -> KVEventStats | None:
        return self.agent.kv_events()

    def where(self) -> dict[str, Any]:
        """The Ray node this agent runs on (for placement checks)."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "node": self.agent.node, "pid": self.agent.status().pid,
                "tier_path": cfg.dram.path if (cfg := self.agent.config).dram else "",
                "lmcache_url": cfg.lmcache.http_url if cfg.lmcache else ""}

    def close(self) -> None:
        self._closed.set()
        self.agent.close()


class _EngineActor:
    def __init__(self, config: EngineConfig, remote: RemoteStoreConfig | None,
                 scheduler_name: str = SCHEDULER_NAME, namespace: str = NAMESPACE,
                 shards: int = 1) -> None:
        logging.basicConfig(level=logging.INFO)
        self._shards = _Shards(shards, scheduler_name, namespace)
        self._agent = ray.get_actor(agent_name(config.node), namespace=namespace)
        self.engine = EngineEmulator(
            config, gpu_start=self._gpu_start, use_local=self._use_local, report=self._send,
            wait_order=self._wait, write_local=self._write_local,
            store=remote.build() if remote is not None else None)
        self.engine.start()

    def _gpu_start(self, node: int, tenant: str, sid: str, reused: int) -> GpuStartPlan:
        ref = self._shards.owner(tenant, sid)
        try:
            return ref.ask(ENGINE_CALL_TIMEOUT_S, NodeAPI.gpu_start, node, tenant, sid, reused)
        except (ray.exceptions.RayActorError, ValueError):
            ref.reset()
            raise

    def _use_local(self, node: int, tenant: str, sid: str, reused: int,
                   done: TransferReport | None) -> int:
        # Fire and forget: it carries the report it depends on, and the GPU must not wait
        # a round trip for book-keeping (the engine reads what its tier really holds).
        self._shards.owner(tenant, sid).send(NodeAPI.use_local, node, tenant, sid, reused,
                                             done)
        return 0

    def _send(self, report: EngineReport) -> None:
        # The served session's shard, and drop notices to the shards of the dropped ones.
        for shard, part in split_engine_report(report, self._shards.ring).items():
            self._shards.refs[shard].send(NodeAPI.engine_report, part)

    def _wait(self, order_id: int, timeout_s: float) -> TransferReport | None:
        ref: Any = self._agent.wait.remote(order_id, timeout_s)
        report: TransferReport | None = ray.get(ref, timeout=timeout_s + 5)
        return report

    def _write_local(self, items: Sequence[tuple[str, bytes]], drop: Sequence[str] = ()
                     ) -> int:
        ref: Any = self._agent.write_local.remote(list(items), list(drop))
        return int(ray.get(ref, timeout=30))

    def ping(self) -> bool:
        return True

    def serve(self, req: ServeRequest) -> ServeResult:
        return self.engine.serve(req)

    def close(self) -> None:
        self.engine.close()


_remote: Any = ray.remote  # the stubs do not know max_concurrency
#: Restarted without limit. Calls are retried on the new incarnation (every agent method is
#: idempotent: execute per order id, evict/cancel/write_local by key); an order that was
#: running when the agent died is reported lost by the scheduler on the new greeting.
AgentActor = _remote(max_restarts=-1, max_task_retries=-1, max_concurrency=64,
                     num_cpus=0)(_AgentActor)
EngineActor = _remote(max_restarts=-1, max_task_retries=0, max_concurrency=128,
                      num_cpus=0)(_EngineActor)
