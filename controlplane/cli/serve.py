"""``kvprefetch serve --config FILE``: the control plane on an existing Ray cluster.

Reads and validates the YAML config (:class:`ServeConfig`; errors name the file and the
field), attaches to Ray (``address: auto`` on a cluster node, or ``local``: a one-node
runtime on this machine whose node counts as one GPU node), finds the nodes that get an
agent (every node with the ``placement.resource`` Ray resource, ``GPU`` by default, and
every one of ``placement.labels``), starts the scheduler actor (pinned to this node, which
holds its journal), one prefetch agent per matching node, and the HTTP API
(:mod:`kvprefetch.controlplane.live.http_api`) in this process. Logs what it placed where. On SIGINT
or
SIGTERM it stops the HTTP server, closes and kills its actors and leaves Ray.

The actors live as long as this process (they are not detached): run it under a
supervisor (systemd, the cluster launcher's head start commands) to keep it up. Nodes that
join later: every ``placement.watch_interval_s`` it looks for matching nodes without an
agent; one gets the next free node slot (``placement.max_nodes`` slots; without it, as many
as matched at start, so a fleet that starts full ignores newcomers with one warning), its
agent starts there, and the scheduler takes the node into the fleet and warms it.

Tenants: ``tenants:`` gives each tenant its own bearer token (from an environment variable
or a file, never inline, never logged) and optionally its quotas: live sessions, a share of
each node's local tier and a share of its prefetch bandwidth (enforced by the scheduling
core, see :mod:`kvprefetch.controlplane.core.quotas`);
``http.admin_token`` is the operators' token (any tenant, named in the body). A config
with only ``http.bearer_token`` / ``bearer_token_env`` keeps the old behaviour: one shared
token, the tenant named in each body. ``http.limits`` bounds each call (body bytes, token
ids, chunk hashes, token-id range); see :mod:`kvprefetch.controlplane.live.limits`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.lmcache.backend import Backend, LMCacheBackendConfig
from kvprefetch.agents.sglang.warm import SGLangWarmConfig
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.agents.transfer import TransferConfig
from kvprefetch.controlplane.base.config import FleetConfig, fleet_from_dict
from kvprefetch.controlplane.base.errors import (
    ConfigError,
    KvPrefetchError,
    ServiceUnavailableError,
)
from kvprefetch.controlplane.base.units import ByteSize
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.limits import RequestLimits, check_tenant_name
from kvprefetch.controlplane.live.tenants import TenantAuth

log = logging.getLogger(__name__)
MIB = 1 << 20
NAMESPACE = "kvprefetch"  # = kvprefetch.agents.ray_entry.NAMESPACE (not imported: it imports ray)

EPILOG = """examples:
  kvprefetch serve --config examples/serve.yaml                  # on a Ray cluster node
  kvprefetch serve --config examples/serve.yaml --address local  # this machine, one node
  kvprefetch serve --config my.yaml --check   # validate, probe Valkey, S3 and Ray, exit
"""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RaySettings(_Section):
    #: ``auto`` (the cluster this machine belongs to), ``host:port``, ``ray://host:10001``,
    #: or ``local``: start a one-node runtime here whose node counts as a matching node.
    address: str = "auto"
    namespace: str = Field(NAMESPACE, min_length=1)
    #: Forward the actors' logs to this process's output.
    log_to_driver: bool = True
    #: The local runtime only: CPUs, object store size, temp dir.
    local_num_cpus: int = Field(2, ge=1)
    local_object_store_bytes: int = Field(80 * MIB, ge=78 * MIB)
    local_temp_dir: str | None = None


class PlacementSettings(_Section):
    #: Nodes with this Ray resource get an agent: ``GPU`` (every GPU node), a custom
    #: resource (``ray start --resources='{"kv_node": 1}'``), or null (every node).
    resource: str | None = "GPU"
    #: ... and every one of these Ray node labels (``ray start --labels=...``).
    labels: dict[str, str] = Field(default_factory=dict)
    #: Fail unless at least this many nodes match, after waiting up to
    #: ``wait_for_nodes_s`` for the autoscaler to bring them up.
    min_nodes: int = Field(1, ge=1, le=4096)
    wait_for_nodes_s: float = Field(0.0, ge=0)
    #: Agents on at most this many of the matching nodes (the first in NodeID order); the
    #: fleet's size, so that nodes that match later can join it (see watch_interval_s).
    max_nodes: int | None = Field(None, ge=1, le=4096)
    #: Look for matching nodes that joined the cluster every this many seconds and give
    #: each one a free node slot (up to max_nodes) and an agent; 0 = never.
    watch_interval_s: float = Field(5.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> PlacementSettings:
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            raise ValueError("max_nodes is smaller than min_nodes")
        return self


class AgentSettings(_Section):
    #: Where orders land: ``local`` = the agent's own tier below; ``lmcache-mp`` = the
    #: node's LMCache MP server's L1 (``lmcache``: the server as every node runs it);
    #: ``sglang`` = the tier below, filled with SGLang's page objects, which the node's
    #: SGLang reads first through our HiCache backend (``sglang``: how it names pages).
    backend: Backend | Literal["sglang"] = "local"
    lmcache: LMCacheBackendConfig | None = None
    sglang: SGLangWarmConfig | None = None
    #: The node-local DRAM tier of each agent (``{node}``: the node's number, so that
    #: several nodes on one machine do not share a directory). Under /dev/shm for DRAM.
    tier_path: str = Field("/dev/shm/kvprefetch-{node}", min_length=1)
    tier_capacity_bytes: ByteSize | None = Field(None, gt=0)
    tier_kind: str = Field("dram", pattern="^(dram|disk)$")
    transfer: TransferConfig = TransferConfig()
    #: Each agent reports its tier's capacity to the scheduler this often (seconds): every
    #: shard's quota of the node follows it (a tier smaller than ``fleet.node.
    #: dram_tier_bytes`` is planned at its real size). 0: never.
    status_interval_s: float = Field(5.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> AgentSettings:
        try:
            self.tier_path.format(node=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"tier_path: only {{node}} may be substituted ({exc})") from None
        if self.backend == "lmcache-mp" and self.lmcache is None:
            raise ValueError("backend lmcache-mp needs an agent.lmcache section (http_url, "
                             "model_name ...)")
        if self.backend == "sglang" and self.sglang is None:
            raise ValueError("backend sglang needs an agent.sglang section (model_name, "
                             "page_size, tp_size as the node's SGLang runs)")
        if self.backend in ("local", "sglang") and self.tier_capacity_bytes is None:
            raise ValueError("agent.tier_capacity_bytes is required with backend "
                             f"{self.backend}")
        return self

    def lmcache_for(self, node_ip: str) -> LMCacheBackendConfig | None:
        """The ``lmcache`` section for the node at ``node_ip``: ``{node_ip}`` in its
        ``http_url`` becomes the node's address (servers bound to their node's address,
        e.g. several nodes' LMCache servers on one machine)."""
        if self.lmcache is None or "{node_ip}" not in self.lmcache.http_url:
            return self.lmcache
        return self.lmcache.model_copy(
            update={"http_url": self.lmcache.http_url.replace("{node_ip}", node_ip)})

    def dram(self, node: int) -> LocalTierConfig | None:
        """Node ``node``'s local tier (None with the ``lmcache-mp`` backend)."""
        if self.backend == "lmcache-mp" or self.tier_capacity_bytes is None:
            return None
        return LocalTierConfig(path=self.tier_path.format(node=node), kind=self.tier_kind,
                               capacity_bytes=self.tier_capacity_bytes)


class SecretSource(_Section):
    """Where a secret is read at start-up: an environment variable (``env``) or a file
    (``file``: its content, without the trailing newline; e.g. a Kubernetes or systemd
    credential). Exactly one. The value is never logged nor written in an error."""

    env: str | None = Field(None, min_length=1)
    file: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one(self) -> SecretSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("give env (an environment variable) or file, exactly one")
        return self

    def read(self, what: str) -> str:
        """The secret; ConfigError naming ``what`` and where it was looked for."""
        if self.env is not None:
            value = os.environ.get(self.env, "")
            where = f"environment variable {self.env!r}"
        else:
            assert self.file is not None
            where = f"file {self.file!r}"
            try:
                value = Path(self.file).read_text().rstrip("\r\n")
            except OSError as exc:
                raise ConfigError(f"{what}: cannot read {where}: {exc.strerror}") from None
        if not value.strip():
            raise ConfigError(f"{what}: {where} is not set or empty")
        return value


class TenantSettings(_Section):
    #: The tenant's bearer token: its calls are this tenant's and no other's.
    token: SecretSource
    #: Live sessions the tenant may hold (default: ``service.max_live_sessions_per_tenant``).
    max_live_sessions: int | None = Field(None, ge=1, le=100_000_000)
    #: Fraction (0, 1] of each node's local tier its sessions may hold (default: no cap).
    #: At its share, its own sessions are evicted first to fit a new one, never another
    #: tenant's; KV its own cannot make room for is not kept locally.
    local_tier_share: float | None = Field(None, gt=0, le=1)
    #: Fraction (0, 1] of each node's NIC rate its prefetches may use on average (default:
    #: no cap); prefetches over it wait for a later sweep. Demand loads are not limited.
    prefetch_bandwidth_share: float | None = Field(None, gt=0, le=1)


class HttpSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, lt=65536)
    #: Older configs: the one bearer token every /v1 call must carry, or the name of an
    #: environment variable holding it; the tenant is then named in each body. Neither
    #: (and no ``tenants``): no auth.
    bearer_token: SecretStr | None = None
    bearer_token_env: str | None = None
    #: The operators' token (with ``tenants``): may act for any tenant, named in the body.
    admin_token: SecretSource | None = None
    #: Seconds the API waits for the scheduler per call before answering "no prefetch".
    call_timeout_s: float = Field(2.0, gt=0, le=60)
    access_log: bool = False
    #: Per-call limits: body bytes (413), token ids and chunk hashes (422), token-id range.
    limits: RequestLimits = RequestLimits()

    @model_validator(mode="after")
    def _check(self) -> HttpSettings:
        if self.bearer_token is not None and self.bearer_token_env is not None:
            raise ValueError("give bearer_token or bearer_token_env, not both")
        if self.bearer_token is not None and not self.bearer_token.get_secret_value().strip():
            raise ValueError("bearer_token is empty")
        return self

    @property
    def shared_token_configured(self) -> bool:
        return self.bearer_token is not None or self.bearer_token_env is not None

    def token(self) -> str | None:
        """The token, read from the environment when named there (ConfigError if unset)."""
        if self.bearer_token is not None:
            return self.bearer_token.get_secret_value()
        if self.bearer_token_env is not None:
            value = os.environ.get(self.bearer_token_env, "")
            if not value.strip():
                raise ConfigError(f"http.bearer_token_env: environment variable "
                                  f"{self.bearer_token_env!r} is not set")
            return value
        return None


class ServeConfig(_Section):
    """The whole ``kvprefetch serve`` config (see examples/serve.yaml)."""

    ray: RaySettings = RaySettings()
    placement: PlacementSettings = PlacementSettings()
    #: The modelled fleet, as in ``kvprefetch sim --fleet`` (model preset, node profile,
    #: remote store, router, planner). ``nodes`` is not given: one per matching Ray node.
    fleet: dict[str, Any] = Field(default_factory=dict)
    #: The scheduler (``ServiceConfig``): policy, predictor, journal_path, tenants, ...
    service: dict[str, Any] = Field(default_factory=dict)
    #: The remote token store: ``valkey`` and/or ``s3`` (both: Valkey in front of S3).
    stores: RemoteStoreConfig
    agent: AgentSettings
    http: HttpSettings = HttpSettings()
    #: Tenant name -> its token and quota. Given: every /v1 call needs a tenant's token
    #: (or ``http.admin_token``), and only these tenants exist.
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.stores.valkey is None and self.stores.s3 is None:
            raise ValueError("stores: configure valkey, s3 or both")
        for name in self.tenants:
            try:
                check_tenant_name(name, "tenants")
            except KvPrefetchError as exc:
                raise ValueError(str(exc)) from None
        if self.tenants and self.http.shared_token_configured:
            raise ValueError("tenants: per-tenant tokens and the shared http.bearer_token do "
                             "not mix (a shared token would act for every tenant): remove "
                             "it, and give operators http.admin_token")
        if self.http.admin_token is not None and not self.tenants:
            raise ValueError("http.admin_token: only with tenants (without them every "
                             "token may name any tenant)")
        if "limits" in self.service:
            raise ValueError("service.limits: set in http.limits")
        if self.tenants:
            for key in ("tenants", "tenant_max_live_sessions", "tenant_local_tier_share",
                        "tenant_prefetch_bandwidth_share"):
                if key in self.service:
                    raise ValueError(f"service.{key}: set from the tenants section")
        if "nodes" in self.fleet:
            raise ValueError("fleet.nodes: not set here: one node per matching Ray node "
                             "(see placement.min_nodes / max_nodes)")
        for key in ("fleet", "node_names", "initial_nodes"):
            if key in self.service:
                raise ValueError(f"service.{key}: set by kvprefetch serve, not in the file")
        return self

    def auth(self) -> TenantAuth:
        """The credentials, their secrets read now (ConfigError naming the tenant and
        where its secret was looked for, never the secret)."""
        tokens = {name: t.token.read(f"tenants.{name}.token")
                  for name, t in self.tenants.items()}
        admin = (self.http.admin_token.read("http.admin_token")
                 if self.http.admin_token is not None else None)
        return TenantAuth(tokens, admin_token=admin, shared_token=self.http.token())

    def fleet_config(self, nodes: int) -> FleetConfig:
        return fleet_from_dict({**self.fleet, "nodes": nodes}, source="fleet")

    def service_config(self, node_names: list[str], initial_nodes: int | None = None
                       ) -> ServiceConfig:
        """One node per name; nodes from ``initial_nodes`` on have no agent yet."""
        fleet = self.fleet_config(len(node_names))
        tenancy: dict[str, Any] = {}
        if self.tenants:
            tenancy = {"tenants": tuple(self.tenants)}
            for key, field in (("tenant_max_live_sessions", "max_live_sessions"),
                               ("tenant_local_tier_share", "local_tier_share"),
                               ("tenant_prefetch_bandwidth_share", "prefetch_bandwidth_share")):
                tenancy[key] = {name: getattr(t, field) for name, t in self.tenants.items()
                                if getattr(t, field) is not None}
        try:
            return ServiceConfig.model_validate(
                {**self.service, **tenancy, "limits": self.http.limits, "fleet": fleet,
                 "node_names": tuple(node_names), "initial_nodes": initial_nodes})
        except ValidationError as exc:
            raise ConfigError(_describe(exc, "service")) from None


def _describe(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "") or "(root)"
        parts.append(f"field {loc!r}: {err['msg']}")
    return "; ".join(parts)


def load_serve_config(path: str | Path) -> ServeConfig:
    """Read and fully validate a serve config (the fleet and the service too, for one
    node); raises :class:`ConfigError` naming the file and the field."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: serve config not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    try:
        cfg = ServeConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{p}: {_describe(exc)}") from None
    try:
        service = cfg.service_config(["node-0"])  # fleet and service, before any Ray work
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    from kvprefetch.predictors.registry import load as load_predictor

    spec = service.policy_spec.predictor or service.predictor
    try:  # the scheduler actor loads it again; a bad name must fail here, not inside Ray
        load_predictor(spec)
    except KvPrefetchError as exc:
        raise ConfigError(f"{p}: field 'service.predictor': {exc}") from None
    return cfg


# ---------------------------------------------------------------------------- command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--config", required=True, help="serve config (YAML)")
    p.add_argument("--address", help="Ray address; overrides ray.address (auto, host:port, "
                                     "ray://..., or local)")
    p.add_argument("--nodes-file", metavar="PATH",
                   help="once ready, write the nodes in the scheduler's order (JSON: node, "
                        "name, ip), from which a gateway builds its --upstream list")
    p.add_argument("--check", action="store_true",
                   help="validate the config, refuse REPLACE_ME placeholders, probe Valkey, "
                        "S3 and the Ray address; one line each; exit 2 on any failure")


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args.config, args.address)
    cfg = load_serve_config(args.config)
    auth = cfg.auth()
    address = args.address or cfg.ray.address
    if not auth.required and cfg.http.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the HTTP API listens on %s without a bearer token", cfg.http.host)
    return Serve(cfg, address, auth, nodes_file=args.nodes_file).run()


def _check(path: str, address: str | None) -> int:
    """``--check``: one line per finding (failures on stderr); 2 if any failed."""
    from kvprefetch.controlplane.cli.serve_check import check_config

    findings = check_config(path, address)
    for f in findings:
        print(f"kvprefetch serve --check: {f.line()}",
              file=sys.stdout if f.ok else sys.stderr, flush=True)
    return 0 if all(f.ok for f in findings) else 2


def describe_auth(auth: TenantAuth) -> str:
    """One line for the log: which kind of credentials (never a token)."""
    if auth.isolated:
        return f"{len(auth.tenants)} tenants with their own tokens: {', '.join(auth.tenants)}"
    return "one shared bearer token, tenant named per call" if auth.required else "no auth"


def http_app(cfg: ServeConfig, scheduler: Any, auth: TenantAuth, *, chunk_tokens: int,
             metrics: Any = None, health: Any = None) -> Any:
    """The HTTP API app of a serve config in front of ``scheduler`` (a client or a
    GatewayAPI): its credentials, limits and timeout; token ids are hashed in the API
    (``chunk_tokens``: the scheduler's), not in the scheduler actor."""
    from kvprefetch.controlplane.live.http_api import create_app

    return create_app(scheduler, auth=auth, limits=cfg.http.limits, chunk_tokens=chunk_tokens,
                      metrics_registry=metrics, call_timeout_s=cfg.http.call_timeout_s,
                      health_check=health)


class Serve:
    """One ``serve`` run: set up, serve until a signal, tear down (in reverse order)."""

    def __init__(self, cfg: ServeConfig, address: str, auth: TenantAuth,
                 nodes_file: str | None = None) -> None:
        self.cfg = cfg
        self.address = address
        self.auth = auth
        #: Where the node order goes once the agents are placed (see write_nodes_file).
        self.nodes_file = nodes_file
        self._stop = threading.Event()
        self._serving = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self._serving:  # still setting up: abort it (the ExitStack unwinds)
            raise KeyboardInterrupt(name)
        if self._stop.is_set():
            return
        log.info("%s: shutting down", name)
        self._stop.set()

    def _catch_signals(self) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)

    def run(self) -> int:
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self._catch_signals()
        try:
            with contextlib.ExitStack() as stack:
                self._setup(stack)
                self._serving = True
                self._stop.wait()
                self._serving = False
                log.info("stopping the HTTP API and the actors")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        log.info("kvprefetch serve stopped")
        return 0

    def _setup(self, stack: contextlib.ExitStack) -> None:
        import ray

        from kvprefetch.agents.agent import AgentConfig
        from kvprefetch.agents.ray_entry import SCHEDULER_NAME
        from kvprefetch.controlplane.live.connect import connect
        from kvprefetch.controlplane.live.http_api import HttpServer
        from kvprefetch.controlplane.live.metrics import merge_shard_metrics
        from kvprefetch.controlplane.live.ray_app import (
            NodeCandidate,
            Placement,
            deploy,
            matching_nodes,
            ray_node_candidates,
        )

        cfg = self.cfg
        self._init_ray()
        stack.callback(ray.shutdown)
        self._catch_signals()  # ray.init installs its own SIGTERM handler (exit at once)
        try:  # deploy() would adopt its actors, and this run would then kill them
            ray.get_actor(SCHEDULER_NAME, namespace=cfg.ray.namespace)
        except ValueError:
            pass
        else:
            raise ConfigError(f"a kvprefetch scheduler already runs in Ray namespace "
                              f"{cfg.ray.namespace!r}: stop it, or set ray.namespace")
        nodes = self._wait_for_nodes(matching_nodes)
        names = _node_names(nodes)
        p = cfg.placement
        watch = p.watch_interval_s > 0
        capacity = max(p.max_nodes or 0, len(nodes)) if watch else len(nodes)
        service = cfg.service_config(
            names + [f"node-{i}" for i in range(len(nodes), capacity)], len(nodes))
        a = cfg.agent

        def agent_config(i: int, name: str, ip: str) -> AgentConfig:
            return AgentConfig(node=i, node_name=name, remote=cfg.stores, transfer=a.transfer,
                               backend=a.backend, lmcache=a.lmcache_for(ip), sglang=a.sglang,
                               dram=a.dram(i), status_interval_s=a.status_interval_s)

        ips = [str(n.get("NodeManagerAddress") or "127.0.0.1") for n in nodes]
        agents = [agent_config(i, names[i], ips[i]) for i in range(len(nodes))]
        placements = [Placement(node_id=n["NodeID"]) for n in nodes]
        here = Placement(node_id=ray.get_runtime_context().get_node_id())
        log.info("deploying the scheduler (policy %s) and %d agents in namespace %r",
                 service.policy, len(agents), cfg.ray.namespace)
        dep = deploy(service, agents, placements, namespace=cfg.ray.namespace,
                     scheduler_placement=here, shards=service.shards)
        stack.callback(dep.shutdown)
        for w in ray.get([a.where.remote() for a in dep.agents], timeout=60):
            log.info("placed agent %d (%s) on Ray node %s at %s: tier %s", w["node"],
                     names[w["node"]], w["node_id"], w["ip"],
                     w["tier_path"] or f"LMCache L1 at {w['lmcache_url']}")
        if watch:
            taken = set(names)

            def joined_agent(i: int, node: NodeCandidate) -> AgentConfig:
                name = str(node.info.get("NodeManagerAddress") or f"node-{i}")
                name = name if name not in taken else f"{name}#{i}"
                taken.add(name)
                ip = str(node.info.get("NodeManagerAddress") or "127.0.0.1")
                return agent_config(i, name, ip)

            dep.watch_nodes(lambda: ray_node_candidates(resource=p.resource, labels=p.labels),
                            joined_agent, interval_s=p.watch_interval_s)
            log.info("%d of %d node slots taken; matching nodes that join later get the "
                     "others (checked every %g s)", len(nodes), capacity, p.watch_interval_s)
        client = connect(self.address, namespace=cfg.ray.namespace,
                         timeout_s=cfg.http.call_timeout_s)
        stack.callback(client.close)
        shards = dep.schedulers

        def metrics_text() -> bytes:
            texts = ray.get([h.metrics_text.remote() for h in shards], timeout=5)
            return texts[0] if len(texts) == 1 else merge_shard_metrics(texts)

        def health() -> None:
            ray.get([h.ping.remote() for h in shards], timeout=2)

        app = http_app(cfg, client, self.auth, chunk_tokens=service.chunk_tokens,
                       metrics=metrics_text, health=health)
        server = stack.enter_context(HttpServer(app, cfg.http.host, cfg.http.port,
                                                access_log=cfg.http.access_log, log_level="info"))
        log.info("HTTP API on %s (%s): POST /v1/route ..., GET /metrics, GET /healthz, "
                 "OpenAPI at /openapi.json", server.url, describe_auth(self.auth))
        if self.nodes_file is not None:
            write_nodes_file(self.nodes_file, names, ips)
            log.info("node order written to %s", self.nodes_file)
        print(f"kvprefetch serve: ready, {len(agents)} agents, HTTP API on {server.url}",
              flush=True)

    def _init_ray(self) -> None:
        import ray

        cfg = self.cfg.ray
        common: dict[str, Any] = {"namespace": cfg.namespace, "log_to_driver": cfg.log_to_driver,
                                  "logging_level": logging.WARNING}
        if self.address != "local":
            log.info("attaching to the Ray cluster at %s", self.address)
            ray.init(address=self.address, **common)
            return
        placement = self.cfg.placement
        kw: dict[str, Any] = {}
        if placement.resource == "GPU":
            kw["num_gpus"] = 1  # declared, not detected: this node stands in for a GPU node
        elif placement.resource is not None:
            kw["resources"] = {placement.resource: 1.0}
        if placement.labels:
            kw["labels"] = dict(placement.labels)
        if cfg.local_temp_dir is not None:
            kw["_temp_dir"] = cfg.local_temp_dir
        log.info("starting a local Ray runtime (one node, %s)", kw or "no extra resources")
        ray.init(address="local", num_cpus=cfg.local_num_cpus,
                 object_store_memory=cfg.local_object_store_bytes, include_dashboard=False,
                 **kw, **common)

    def _wait_for_nodes(self, matching_nodes: Any) -> list[dict[str, Any]]:
        p = self.cfg.placement
        deadline = time.monotonic() + p.wait_for_nodes_s
        while True:
            nodes = matching_nodes(resource=p.resource, labels=p.labels)
            if len(nodes) >= p.min_nodes or time.monotonic() >= deadline:
                break
            log.info("%d of at least %d matching nodes are up; waiting", len(nodes), p.min_nodes)
            if self._stop.wait(min(5.0, max(0.1, deadline - time.monotonic()))):
                break
        what = f"resource {p.resource!r}" if p.resource else "any resources"
        if p.labels:
            what += f" and labels {p.labels}"
        if len(nodes) < p.min_nodes:
            raise ServiceUnavailableError(
                f"placement: {len(nodes)} alive Ray nodes with {what}, need at least "
                f"{p.min_nodes} (placement.min_nodes; waited {p.wait_for_nodes_s:g} s)")
        if p.max_nodes is not None:
            nodes = nodes[: p.max_nodes]
        log.info("%d nodes with %s get an agent", len(nodes), what)
        return nodes


def write_nodes_file(path: str | Path, names: list[str], ips: list[str]) -> None:
    """The scheduler's node order as JSON, ``[{"node": 0, "name": ..., "ip": ...}, ...]``
    (atomically): node i of every route answer is entry i, so a gateway started later
    (``examples/deploy/kvprefetch-node.sh gateway``) lists its upstreams in this order."""
    import json

    from kvprefetch.controlplane.base.atomic import write_atomic

    rows = [{"node": i, "name": n, "ip": ip} for i, (n, ip) in enumerate(zip(names, ips,
                                                                             strict=True))]
    write_atomic(Path(path), [(json.dumps(rows, indent=1) + "\n").encode()])


def _node_names(nodes: list[dict[str, Any]]) -> list[str]:
    """The node's address (unique per machine), made unique among raylets sharing one."""
    names: list[str] = []
    for i, n in enumerate(nodes):
        name = str(n.get("NodeManagerAddress") or n.get("NodeName") or f"node-{i}")
        names.append(name if name not in names else f"{name}#{i}")
    return names

