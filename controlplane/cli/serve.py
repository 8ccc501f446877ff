"""``kvprefetch serve --config FILE``: the control plane on an existing Ray cluster.

Reads and validates the YAML config
(:class:`~kvprefetch.controlplane.cli.serve_config.ServeConfig`; errors name the file and the
field), attaches to Ray (``address: auto`` on a cluster node, or ``local``: a one-node
runtime on this machine whose node counts as one GPU node), finds the nodes that get an
agent (every node with the ``placement.resource`` Ray resource, ``GPU`` by default, and
every one of ``placement.labels``), starts the scheduler actor (pinned to this node, which
holds its journal), one prefetch agent per matching node, and the HTTP API
(:mod:`kvprefetch.controlplane.live.http_api`) in this process. Logs what it placed where. On SIGINT
or SIGTERM it stops the HTTP server, closes and kills its actors and leaves Ray.

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
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvprefetch.controlplane.base.errors import ConfigError, ServiceUnavailableError
from kvprefetch.controlplane.cli.options import require_extras

if TYPE_CHECKING:  # imported where used: --help builds without the extras they need
    from kvprefetch.controlplane.cli.serve_config import ServeConfig
    from kvprefetch.controlplane.live.tenants import TenantAuth

log = logging.getLogger(__name__)

EPILOG = """examples:
  kvprefetch serve --config kvp/serve.yaml --embedded   # one machine, nothing else to run
  kvprefetch serve --config kvp/serve.yaml              # on a Ray cluster node
  kvprefetch serve --config kvp/serve.yaml --address local  # this machine, your stores
  kvprefetch serve --config kvp/serve.yaml --check  # validate, probe Valkey, S3, Ray, exit

Every start runs --check's checks first and stops (exit 2, one line per problem) before
Ray starts when any fails.
"""


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
                        "S3, the Ray address, the LMCache server (local runtime) and the "
                        "journal's directory; one line each; exit 2 on any failure")
    p.add_argument("--embedded", action="store_true",
                   help="one machine with nothing else to run: start Valkey and S3 here "
                        "(the programs the 'stores' extra installs) in place of the "
                        "config's stores, a local Ray runtime (--address local), each "
                        "agent's own local tier in place of lmcache-mp "
                        "(agent.tier_capacity_bytes, default 1 GiB), the journal as "
                        "journal.jsonl beside the config; the stores and the tier go "
                        "when serve stops, the journal stays")


def run(args: argparse.Namespace) -> int:
    embedded = bool(getattr(args, "embedded", False))
    if embedded and args.address not in (None, "local"):
        raise ConfigError(f"--embedded runs on a local Ray runtime; drop --address "
                          f"{args.address}")
    if args.check:
        require_extras("stores")
        return _check(args.config, args.address, embedded=embedded)
    require_extras("serve", "stores")
    if _preflight(args.config, args.address, embedded=embedded) != 0:
        return 2
    from kvprefetch.controlplane.cli.serve_config import load_serve_config

    cfg = load_serve_config(args.config, embedded=embedded)
    auth = cfg.auth()
    address = "local" if embedded else (args.address or cfg.ray.address)
    if not auth.required and cfg.http.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the HTTP API listens on %s without a bearer token", cfg.http.host)
    if not embedded:
        return Serve(cfg, address, auth, nodes_file=args.nodes_file).run()
    from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
    from kvprefetch.controlplane.cli.serve_config import with_embedded_stores

    with EmbeddedValkey() as valkey, EmbeddedS3() as s3:
        log.info("embedded stores: Valkey on %s:%d, %s S3 at %s", valkey.host, valkey.port,
                 s3.backend, s3.endpoint_url)
        cfg = with_embedded_stores(cfg, valkey, s3)
        tier = cfg.agent.dram(0)
        try:
            return Serve(cfg, address, auth, nodes_file=args.nodes_file).run()
        finally:  # the tier's copies of the stores' data go with them
            if tier is not None:
                shutil.rmtree(tier.path, ignore_errors=True)


def _check(path: str, address: str | None, *, embedded: bool = False) -> int:
    """``--check``: one line per finding (failures on stderr); 2 if any failed."""
    from kvprefetch.controlplane.cli.serve_check import check_config

    findings = check_config(path, address, embedded=embedded)
    for f in findings:
        print(f"kvprefetch serve --check: {f.line()}",
              file=sys.stdout if f.ok else sys.stderr, flush=True)
    return 0 if all(f.ok for f in findings) else 2


def _preflight(path: str, address: str | None, *, embedded: bool) -> int:
    """``--check``'s checks before a start, and whether the HTTP API's port is free: the
    failures only, one line each on stderr; 2 if any failed, else 0."""
    from kvprefetch.controlplane.cli.serve_check import check_config, http_listen_finding
    from kvprefetch.controlplane.cli.serve_config import load_serve_config

    findings = check_config(path, address, embedded=embedded)
    if all(f.ok or f.what != "config" for f in findings):  # a config that loads
        http = load_serve_config(path, embedded=embedded).http
        findings.append(http_listen_finding(http.host, http.port))
    failed = [f for f in findings if not f.ok]
    for f in failed:
        print(f"kvprefetch serve: {f.line()}", file=sys.stderr, flush=True)
    return 2 if failed else 0


def http_app(cfg: ServeConfig, scheduler: Any, auth: TenantAuth, *, chunk_tokens: int,
             metrics: Any = None, health: Any = None) -> Any:
    """The HTTP API app of a serve config in front of ``scheduler`` (a client or a
    GatewayAPI): its credentials, limits and timeout; token ids are hashed in the API
    (``chunk_tokens``: the scheduler's), not in the scheduler actor."""
    from kvprefetch.controlplane.live.http_api import create_app

    return create_app(scheduler, auth=auth, limits=cfg.http.limits, chunk_tokens=chunk_tokens,
                      metrics_registry=metrics, call_timeout_s=cfg.http.call_timeout_s,
                      health_check=health, metrics_tenant_names=cfg.http.metrics_tenant_names)


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
        from kvprefetch.controlplane.base.actors import SCHEDULER_NAME
        from kvprefetch.controlplane.live.http_api import HttpServer, ray_client
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
                               dram=a.dram(i), vllm=a.vllm_for(ip),
                               engine_url=a.engine_url_for(ip), warming=a.warming,
                               status_interval_s=a.status_interval_s)

        ips = [str(n.get("NodeManagerAddress") or "127.0.0.1") for n in nodes]
        agents = [agent_config(i, names[i], ips[i]) for i in range(len(nodes))]
        placements = [Placement(node_id=n["NodeID"]) for n in nodes]
        here = Placement(node_id=ray.get_runtime_context().get_node_id())
        log.info("deploying the scheduler (policy %s on engine %s) and %d agents in "
                 "namespace %r", service.policy, cfg.engine, len(agents), cfg.ray.namespace)
        for mechanism, how in cfg.engine_mechanisms().items():
            log.info("engine %s grants %s: %s", cfg.engine, mechanism, how)
        front = self._front_end() if cfg.http.front_end == "scheduler" else None
        try:
            dep = deploy(service, agents, placements, namespace=cfg.ray.namespace,
                         scheduler_placement=here, shards=service.shards, http=front)
        except ray.exceptions.RayActorError as exc:
            raise ServiceUnavailableError(actor_failure(exc, self._server_field())) from None
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
        if front is not None:
            url = str(ray.get(dep.scheduler.http_url.remote(), timeout=60))
            where = "in the scheduler actor's process"
        else:
            client = ray_client(self.address, cfg.ray.namespace,
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
                                                    access_log=cfg.http.access_log,
                                                    log_level="info"))
            url, where = server.url, "in this process"
        from kvprefetch.controlplane.cli.serve_config import describe_auth

        log.info("HTTP API on %s (%s, %s): POST /v1/route ..., GET /metrics, GET /healthz, "
                 "OpenAPI at /openapi.json", url, where, describe_auth(self.auth))
        if self.nodes_file is not None:
            write_nodes_file(self.nodes_file, names, ips)
            log.info("node order written to %s", self.nodes_file)
        print(f"kvprefetch serve: ready, {len(agents)} agents, "
              f"{listening_on(cfg.http.host, url)}", flush=True)

    def _front_end(self) -> Any:
        """The HTTP API as the scheduler actor serves it (``http.front_end: scheduler``):
        this config's address, credentials (their digests), limits and timeout."""
        from kvprefetch.controlplane.live.scheduler_http import HttpFrontEnd

        h = self.cfg.http
        return HttpFrontEnd(host=h.host, port=h.port, auth=self.auth, limits=h.limits,
                            call_timeout_s=h.call_timeout_s,
                            metrics_tenant_names=h.metrics_tenant_names,
                            access_log=h.access_log, log_level="info")

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

    def _server_field(self) -> tuple[str, str] | None:
        """The agents' node server: (its URL as configured, the config field that sets
        it); None for a backend without one."""
        from kvprefetch.agents.backends.registry import backend_spec

        backend = backend_spec(self.cfg.agent.backend)
        settings = backend.settings_of(self.cfg.agent)
        if backend.server is None or settings is None:
            return None
        section = backend.section or backend.name
        return backend.server.url_of(settings), f"agent.{section}.{backend.server.url_field}"

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


def listening_on(host: str, url: str) -> str:
    """Where the HTTP API listens, as the ready line says it: the address it is bound to
    (``http.host``), and the URL to reach it from this machine where that differs (all
    interfaces)."""
    port = url.rstrip("/").rsplit(":", 1)[-1]
    if url.rstrip("/") == f"http://{host}:{port}":
        return f"HTTP API on {url}"
    return f"HTTP API on {host}:{port} (all interfaces; {url} from this machine)"


#: The actor classes' names as Ray reports them -> the component they are.
_COMPONENTS = {"_AgentActor": "agent", "_EngineActor": "engine",
               "SchedulerActor": "scheduler", "_SchedulerActor": "scheduler"}


def actor_failure(exc: BaseException, server: tuple[str, str] | None = None) -> str:
    """One line for an actor that died while starting: the component (agent, scheduler)
    and the cause, the last line of the error Ray carries (``PermissionError: ...``).
    ``server``: the agents' node server as (its URL, the config field that sets it); a
    cause that names the URL ends by naming the field."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(getattr(exc, "error_msg", "") or exc))
    found = re.search(r"(\w+)\.__init__\(\)", text)
    name = found.group(1) if found else ""
    component = _COMPONENTS.get(name, name.strip("_") or "actor")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = lines[-1] if lines else type(exc).__name__
    # the error's class without its module: kvprefetch.x.StoreConfigError -> StoreConfigError
    cause = re.sub(r"^(?:\w+\.)+(\w+(?:Error|Exception)\b)", r"\1", cause)
    if server is not None and server[0].rstrip("/") in cause:
        cause += f" (check {server[1]})"
    if "creation task" in text:
        return f"the {component} failed to start: {cause}"
    return f"the {component} died while starting: {cause}"



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

