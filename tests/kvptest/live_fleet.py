"""In-process wiring of a live fleet (no Ray): one SchedulerService, one PrefetchAgent and one
EngineEmulator per node, real Valkey and S3 on loopback. The Ray deployment wires the very
same plain classes through actors (kvprefetch.controlplane.live.ray_app)."""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.engine_emulator import (
    EngineConfig,
    EngineEmulator,
    ServeRequest,
    ServeResult,
)
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.agents.stores.tiered import TieredStoreConfig
from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.wire import TransferOrder
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.service import SchedulerService

MIB = 1 << 20


def session_home(core: SchedulerCore, sid: str) -> int | None:
    """The node the service's core routes the session to first (where its KV was last
    written); None for a session it does not hold or whose home left."""
    s = core._sessions.get(sid)
    return s.home if s is not None else None


def started_agents(tmp_path: Path, valkey: EmbeddedValkey, nodes: int, *, prefix: str,
                   dram_bytes: int = 64 * MIB) -> list[PrefetchAgent]:
    """One started agent per node over the shared Valkey (keys under a fresh
    ``prefix-<random>:`` namespace, short timeouts) with a DRAM tier in ``tmp_path``."""
    remote = RemoteStoreConfig(valkey=valkey.store_config(
        key_prefix=f"{prefix}-{uuid.uuid4().hex[:8]}:", connect_timeout_s=0.5,
        socket_timeout_s=2.0))
    agents = [PrefetchAgent(AgentConfig(
        node=node, node_name=f"node-{node}", remote=remote,
        dram=LocalTierConfig(path=str(tmp_path / f"dram{node}"), capacity_bytes=dram_bytes)))
        for node in range(nodes)]
    for agent in agents:
        agent.start()
    return agents


class InProcessPort:
    """AgentPort for an in-process agent."""

    def __init__(self, agent: PrefetchAgent) -> None:
        self.agent = agent

    def execute(self, order: TransferOrder) -> None:
        self.agent.execute(order)

    def cancel(self, session_id: str, order_id: int) -> None:
        self.agent.cancel(session_id, order_id)

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None:
        self.agent.evict(prefixes, keys)


class RecordingPort:
    """AgentPort that keeps the orders the service hands it and does nothing else."""

    def __init__(self) -> None:
        self.orders: list[TransferOrder] = []

    def execute(self, order: TransferOrder) -> None:
        self.orders.append(order)

    def cancel(self, session_id: str, order_id: int) -> None: ...

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None: ...


@dataclass
class LocalFleet:
    service: SchedulerService
    agents: list[PrefetchAgent]
    engines: list[EngineEmulator]
    dirs: list[Path] = field(default_factory=list)

    def serve(self, tenant: str, session: str, turn: int, input_tokens: int, reused: int,
              output_tokens: int) -> tuple[int, ServeResult]:
        arrival = time.time()
        answer = self.service.route({"tenant": tenant, "session_id": session,
                                     "input_tokens": input_tokens, "reused_tokens": reused})
        assert answer.node is not None
        res = self.engines[answer.node].serve(ServeRequest(
            tenant, session, turn, input_tokens, reused, output_tokens, arrival))
        self.service.request_finished({"tenant": tenant, "session_id": session,
                                       "node": answer.node, "input_tokens": input_tokens,
                                       "output_tokens": output_tokens})
        return answer.node, res

    def close(self) -> None:
        self.service.close()
        for e in self.engines:
            e.close()
        for a in self.agents:
            a.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def remote_config(valkey: EmbeddedValkey | None, s3: EmbeddedS3 | None,
                  prefix: str) -> RemoteStoreConfig:
    return RemoteStoreConfig(
        valkey=valkey.store_config(key_prefix=f"{prefix}:", connect_timeout_s=0.5,
                                   socket_timeout_s=2.0) if valkey else None,
        s3=s3.store_config(key_prefix=f"{prefix}/", connect_timeout_s=0.5,
                           read_timeout_s=2.0, max_attempts=1) if s3 else None,
        tiered=TieredStoreConfig(retry_down_after_s=5.0),
    )


def build_local_fleet(fleet: FleetConfig, valkey: EmbeddedValkey | None, s3: EmbeddedS3 | None,
                      *, policy: str = "predictive", compression: float = 100.0,
                      kv_scale: float = 1 / 4096, chunk_tokens: int = 4096,
                      journal: Path | None = None, tier_bytes: int = 64 * MIB,
                      predictor: str = "last-gap", **service_kw: Any) -> LocalFleet:
    prefix = uuid.uuid4().hex[:8]
    remote = remote_config(valkey, s3, prefix)
    dirs: list[Path] = []
    agents: list[PrefetchAgent] = []
    for node in range(fleet.nodes):
        d = Path("/dev/shm") / f"kvp-live-{prefix}-{node}"
        dirs.append(d)
        agents.append(PrefetchAgent(AgentConfig(
            node=node, node_name=f"node-{node}",
            dram=LocalTierConfig(path=str(d), capacity_bytes=tier_bytes), remote=remote)))
    svc = SchedulerService(ServiceConfig(
        fleet=fleet, policy=policy, predictor=predictor, time_compression=compression,
        chunk_tokens=chunk_tokens, journal_path=str(journal) if journal else None,
        **service_kw), agents={i: InProcessPort(a) for i, a in enumerate(agents)})
    svc.start()
    engines = []
    for node, agent in enumerate(agents):
        agent.set_reporter(svc.report_transfer)
        agent.start()
        svc.agent_hello(agent.hello())
        engines.append(EngineEmulator(
            EngineConfig(node=node, fleet=fleet, dram=agent.config.dram,
                         time_compression=compression, kv_scale=kv_scale,
                         chunk_tokens=chunk_tokens),
            gpu_start=svc.gpu_start, use_local=svc.use_local, report=svc.engine_report,
            wait_order=agent.wait, write_local=agent.write_local,
            store=remote.build()).start())
    return LocalFleet(svc, agents, engines, dirs)
