"""The ``kvprefetch serve`` config: the YAML file's sections as pydantic models
(:class:`ServeConfig`), read and fully validated by :func:`load_serve_config` (errors name
the file and the field), and the one log line that says which credentials it sets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
from kvprefetch.agents.backends.registry import (
    BACKENDS,
    DEFAULT_BACKEND,
    BackendName,
    backend_spec,
)
from kvprefetch.agents.backends.sglang.warmer import SGLangWarmConfig
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.agents.transfer import TransferConfig
from kvprefetch.agents.vllm.kv_events import VLLMEventsConfig
from kvprefetch.agents.warm_gate import WarmingConfig
from kvprefetch.controlplane.base.actors import NAMESPACE
from kvprefetch.controlplane.base.config import FleetConfig, fleet_from_dict
from kvprefetch.controlplane.base.errors import ConfigError, KvPrefetchError
from kvprefetch.controlplane.base.names import check_tenant_name
from kvprefetch.controlplane.base.units import ByteSize
from kvprefetch.controlplane.core.engines import DEFAULT_ENGINE, ENGINES, Mechanism
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.limits import RequestLimits
from kvprefetch.controlplane.live.tenants import TenantAuth

MIB = 1 << 20


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
    backend: BackendName = DEFAULT_BACKEND
    lmcache: LMCacheBackendConfig | None = None
    sglang: SGLangWarmConfig | None = None
    #: The node-local DRAM tier of each agent (``{node}``: the node's number, so that
    #: several nodes on one machine do not share a directory). Under /dev/shm for DRAM.
    tier_path: str = Field("/dev/shm/kvprefetch-{node}", min_length=1)
    tier_capacity_bytes: ByteSize | None = Field(None, gt=0)
    tier_kind: str = Field("dram", pattern="^(dram|disk)$")
    #: How the tier chooses victims: ``lru``, or ``predicted``: furthest predicted next use
    #: first, as the scheduler advises through each order's deadline and its evict advice
    #: (the DRAM ranking, which only the ``local`` engine profile grants). Unset: what the
    #: engine profile grants (``predicted`` on ``local``, else ``lru``).
    tier_eviction: Literal["lru", "predicted"] | None = None
    #: The node's vLLM KV events (``--kv-events-config``): what its HBM stores and evicts
    #: reaches the scheduler's books of the node. ``{node_ip}`` in ``endpoint`` and
    #: ``replay_endpoint`` becomes the node's address. Unset: not followed.
    vllm: VLLMEventsConfig | None = None
    #: Each node's engine's OpenAI base URL as the gateway reaches it, ``{node_ip}`` the
    #: node's address (e.g. ``http://{node_ip}:8000``): its agent announces it, and the
    #: gateway forwards the node's requests there, following nodes that join, leave or
    #: move. "" = the gateway's configured upstreams.
    engine_url: str = ""
    #: How prefetch warms yield to the node's engine (held while its ``/metrics`` at
    #: ``engine_url`` says requests wait) and when a late one is dropped.
    warming: WarmingConfig = WarmingConfig()
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
        spec = backend_spec(self.backend)
        if spec.section is not None and spec.settings_of(self) is None:
            what = dict(spec.needs)[spec.section]
            raise ValueError(f"backend {self.backend} needs an agent.{spec.section} section "
                             f"({what})")
        if spec.needs_tier and self.tier_capacity_bytes is None:
            raise ValueError("agent.tier_capacity_bytes is required with backend "
                             f"{self.backend}")
        return self

    def engine_url_for(self, node_ip: str) -> str:
        """``engine_url`` for the node at ``node_ip`` (``{node_ip}`` substituted)."""
        return self.engine_url.replace("{node_ip}", node_ip)

    def vllm_for(self, node_ip: str) -> VLLMEventsConfig | None:
        """The ``vllm`` section for the node at ``node_ip`` (``{node_ip}`` substituted)."""
        if self.vllm is None:
            return None
        urls = {name: url.replace("{node_ip}", node_ip)
                for name in ("endpoint", "replay_endpoint")
                if "{node_ip}" in (url := getattr(self.vllm, name))}
        return self.vllm.model_copy(update=urls) if urls else self.vllm

    def lmcache_for(self, node_ip: str) -> LMCacheBackendConfig | None:
        """The ``lmcache`` section for the node at ``node_ip``: ``{node_ip}`` in its
        ``http_url`` and ``request_url`` becomes the node's address (servers bound to their
        node's address, e.g. several nodes' LMCache servers on one machine)."""
        if self.lmcache is None:
            return None
        urls = {name: url.replace("{node_ip}", node_ip)
                for name in ("http_url", "request_url")
                if "{node_ip}" in (url := getattr(self.lmcache, name))}
        return self.lmcache.model_copy(update=urls) if urls else self.lmcache

    def dram(self, node: int) -> LocalTierConfig | None:
        """Node ``node``'s local tier (None with the ``lmcache-mp`` backend)."""
        if not backend_spec(self.backend).needs_tier or self.tier_capacity_bytes is None:
            return None
        return LocalTierConfig(path=self.tier_path.format(node=node), kind=self.tier_kind,
                               capacity_bytes=self.tier_capacity_bytes,
                               eviction=self.tier_eviction or "lru",
                               remove_on_close=self.tier_kind == "dram")


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
    #: Shared-token mode (instead of ``tenants``): the one bearer token every /v1 call
    #: must carry, or the name of an environment variable holding it; the tenant is then
    #: named in each body, so any holder may act for any tenant. Neither (and no
    #: ``tenants``): no auth.
    bearer_token: SecretStr | None = None
    bearer_token_env: str | None = None
    #: Where bodies name their tenant (shared token, no auth): distinct tenants admitted
    #: per process; a call naming one more is refused (403).
    max_named_tenants: int = Field(64, ge=1, le=100_000)
    #: The operators' token (with ``tenants``): may act for any tenant, named in the body.
    admin_token: SecretSource | None = None
    #: The token Prometheus reads ``/metrics`` with (``authorization: credentials_file``
    #: in its scrape config); the admin token reads it too. Unset: ``/metrics`` is open
    #: and names tenants by pseudonym (``t-`` and a keyed hash; see metrics_tenant_names).
    metrics_token: SecretSource | None = None
    #: An open ``/metrics`` (no metrics_token) names tenants as they are. Default false:
    #: anyone who reaches the port would read the tenants' names and live-session counts.
    metrics_tenant_names: bool = False
    #: Seconds the API waits for the scheduler per call before answering "no prefetch".
    call_timeout_s: float = Field(2.0, gt=0, le=60)
    access_log: bool = False
    #: Which process serves the API: ``serve`` (this one, calling the scheduler actor over
    #: Ray) or ``scheduler`` (the scheduler actor's own, no Ray hop per call; one
    #: scheduler shard; Ray restarts it with the actor).
    front_end: Literal["serve", "scheduler"] = "serve"
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

    #: The engine profile the nodes run, as ``kvprefetch sim --engine`` names it
    #: (``vllm-lmcache``, ``vllm-lmcache-lazy``, ``sglang-hicache``, ``local``): the
    #: scheduler's policy runs with the mechanisms it grants, and each of them is set up on
    #: the nodes (:meth:`ServeConfig.engine_mechanisms`).
    engine: str = DEFAULT_ENGINE
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
        self._check_engine()
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
        shards = self.service.get("shards", 1)
        if self.http.front_end == "scheduler" and shards != 1:
            raise ValueError(f"http.front_end: scheduler serves the API in the one "
                             f"scheduler's process; service.shards is {shards} (set "
                             "http.front_end: serve, or one shard)")
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

    def _check_engine(self) -> None:
        """The engine profile against the agents' settings; resolves an unset
        ``agent.tier_eviction`` to what the profile grants."""
        if self.engine not in ENGINES:
            raise ValueError(f"engine: unknown engine profile {self.engine!r}; known: "
                             f"{', '.join(ENGINES)}")
        if "engine" in self.service:
            raise ValueError("service.engine: set at the top level (engine)")
        profile = ENGINES[self.engine]
        ranking = profile.offers(Mechanism.DRAM_RANKING)
        own_tier = (Mechanism.DRAM_RANKING, Mechanism.TRIMS)
        backend = backend_spec(self.agent.backend)
        if any(profile.offers(m) for m in own_tier) and not backend.needs_tier:
            raise ValueError(f"engine {self.engine}: its DRAM ranking and trims are carried "
                             f"out by the agent's own tier; agent.backend {backend.name} has "
                             "none (use backend local, or engine vllm-lmcache)")
        refused = backend.refused_engines.get(self.engine)
        if refused is not None:
            raise ValueError(f"engine {self.engine}: {refused}")
        if self.agent.tier_eviction == "predicted" and not ranking:
            raise ValueError(f"agent.tier_eviction: predicted ranks the tier by the "
                             f"scheduler's forecasts, which engine {self.engine} does not "
                             "grant (engine local does)")
        if self.agent.tier_eviction is None:
            agent = self.agent.model_copy(
                update={"tier_eviction": "predicted" if ranking else "lru"})
            object.__setattr__(self, "agent", agent)

    def engine_mechanisms(self) -> dict[str, str]:
        """What each mechanism the engine profile grants is carried out by on the
        nodes of this deployment (mechanism -> the setting or API)."""
        live = {
            Mechanism.DEMOTE_ON_EVICT.value:
            "the engine's write-back of evicted KV (SGLang --hicache-write-policy write_back)",
            Mechanism.ASYNC_LOAD.value: "the engine's connector loads asynchronously",
            Mechanism.QUEUED_LOAD.value: "the scheduler's demand order at routing",
            Mechanism.EVICT_ADVICE.value: "the agent's evict advice to its own tier",
            Mechanism.DRAM_RANKING.value: f"agent.tier_eviction: {self.agent.tier_eviction}",
            Mechanism.TRIMS.value: "the agent's trim advice to its own tier",
        } | dict(backend_spec(self.agent.backend).carried_by)
        return {m.value: live[m.value] for m in ENGINES[self.engine].mechanisms}

    def vllm_connector(self, lmcache_host: str, lmcache_port: int) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` for a node of this deployment: the LMCache MP
        connector at ``lmcache_host:lmcache_port``, with the engine profile's LMCache
        mechanisms on (``lazy_offload`` for demote-on-evict, ``eager_prefetch`` for loads
        that start while the request is queued)."""
        from kvprefetch.agents.vllm.server import lmcache_connector_config

        profile = ENGINES[self.engine]
        return lmcache_connector_config(
            lmcache_host, lmcache_port,
            lazy_offload=profile.offers(Mechanism.DEMOTE_ON_EVICT),
            eager_prefetch=profile.offers(Mechanism.QUEUED_LOAD))

    def vllm_kv_events(self, node_ip: str = "") -> dict[str, Any] | None:
        """vLLM's ``--kv-events-config`` for a node of this deployment (None without
        ``agent.vllm``, or with its ``kv_events: off``): the ZMQ publisher bound on every
        address at the port of ``agent.vllm.endpoint`` (with ``bind``: connecting to the
        agent there), and the replay socket bound at the port of its ``replay_endpoint``
        (with ``bind``: on that address). ``node_ip``: the node's address, for
        ``{node_ip}`` in them."""
        events = self.agent.vllm_for(node_ip)
        if events is None or events.kv_events == "off":
            return None
        raw = self.agent.vllm
        if events.bind and not node_ip and raw is not None and (
                "{node_ip}" in raw.endpoint + raw.replay_endpoint):
            raise ConfigError("agent.vllm.bind: vLLM connects to the node's own address; "
                              "give the node's address (KVP_NODE_IP)")

        def bound(url: str) -> str:
            return f"tcp://*:{url.rsplit(':', 1)[1]}"

        def at(url: str) -> str:
            return url if events.bind else bound(url)

        config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": at(events.endpoint), "topic": events.topic}
        if events.replay_endpoint:
            config["replay_endpoint"] = at(events.replay_endpoint)
        return config

    def auth(self) -> TenantAuth:
        """The credentials, their secrets read now (ConfigError naming the tenant and
        where its secret was looked for, never the secret)."""
        tokens = {name: t.token.read(f"tenants.{name}.token")
                  for name, t in self.tenants.items()}
        admin = (self.http.admin_token.read("http.admin_token")
                 if self.http.admin_token is not None else None)
        metrics = (self.http.metrics_token.read("http.metrics_token")
                   if self.http.metrics_token is not None else None)
        return TenantAuth(tokens, admin_token=admin, shared_token=self.http.token(),
                          metrics_token=metrics, max_named_tenants=self.http.max_named_tenants)

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
                {**self.service, **tenancy, "engine": self.engine,
                 "limits": self.http.limits, "fleet": fleet,
                 "node_names": tuple(node_names), "initial_nodes": initial_nodes})
        except ValidationError as exc:
            raise ConfigError(_describe(exc, "service")) from None


def _describe(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "") or "(root)"
        parts.append(f"field {loc!r}: {err['msg']}")
    return "; ".join(parts)


#: The local tier of each agent in the embedded profile when the config sets no
#: ``agent.tier_capacity_bytes`` (bytes).
EMBEDDED_TIER_BYTES = 1 << 30
#: The stores section the embedded profile validates with; ``kvprefetch serve --embedded``
#: replaces it by the servers it starts (:func:`with_embedded_stores`).
_EMBEDDED_STAND_IN = {"valkey": {"host": "127.0.0.1", "port": 6379},
                      "s3": {"bucket": "kvprefetch", "endpoint_url": "http://127.0.0.1:8333",
                             "path_style": True}}


def embedded_profile(raw: dict[str, Any], config_dir: Path) -> dict[str, Any]:
    """The one-machine profile of a config document (``kvprefetch serve --embedded``):
    the stores are the Valkey and S3 servers serve starts here (the file's ``stores``
    section is ignored but for ``tiered``), Ray is a local one-node runtime, an agent
    whose backend needs a node server (``lmcache-mp``: serve starts none) gets the default
    backend's local tier instead (``agent.tier_capacity_bytes``, default
    :data:`EMBEDDED_TIER_BYTES`), and the journal, when
    the file names one, is ``journal.jsonl`` in ``config_dir``. Everything else (tokens,
    tenants, policy, fleet, http) is the file's."""
    doc = dict(raw)
    given = doc.get("stores")
    stores: dict[str, Any] = given if isinstance(given, dict) else {}
    doc["stores"] = {**_EMBEDDED_STAND_IN,
                     **({"tiered": stores["tiered"]} if "tiered" in stores else {})}
    ray = dict(doc["ray"]) if isinstance(doc.get("ray"), dict) else {}
    doc["ray"] = {**ray, "address": "local"}
    agent = dict(doc["agent"]) if isinstance(doc.get("agent"), dict) else {}
    spec = BACKENDS.get(str(agent.get("backend", DEFAULT_BACKEND)))
    if spec is not None and spec.server is not None:
        agent["backend"] = DEFAULT_BACKEND
        if spec.section is not None:
            agent.pop(spec.section, None)
    agent.setdefault("tier_capacity_bytes", EMBEDDED_TIER_BYTES)
    doc["agent"] = agent
    service = doc.get("service")
    if isinstance(service, dict) and service.get("journal_path"):
        doc["service"] = {**service, "journal_path": str(config_dir / "journal.jsonl")}
    return doc


def with_embedded_stores(cfg: ServeConfig, valkey: Any, s3: Any) -> ServeConfig:
    """``cfg`` (validated with :func:`embedded_profile`) on the running embedded
    servers (:class:`~kvprefetch.agents.embedded.EmbeddedValkey`, ``EmbeddedS3``)."""
    stores = RemoteStoreConfig(valkey=valkey.store_config(), s3=s3.store_config(),
                               tiered=cfg.stores.tiered)
    return cfg.model_copy(update={"stores": stores})


def read_serve_document(path: str | Path, *, embedded: bool = False) -> dict[str, Any]:
    """The config file's document (its :func:`embedded_profile` with ``embedded``);
    ConfigError naming the file when it is missing, not YAML or not a mapping."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: serve config not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the serve config: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return embedded_profile(raw, p.resolve().parent) if embedded else raw


def load_serve_config(path: str | Path, *, embedded: bool = False) -> ServeConfig:
    """Read and fully validate a serve config (the fleet and the service too, for one
    node), as :func:`embedded_profile` makes it with ``embedded``; raises
    :class:`ConfigError` naming the file and the field."""
    p = Path(path)
    raw = read_serve_document(p, embedded=embedded)
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


def describe_auth(auth: TenantAuth) -> str:
    """One line for the log: which kind of credentials (never a token)."""
    if auth.isolated:
        return f"{len(auth.tenants)} tenants with their own tokens: {', '.join(auth.tenants)}"
    return "one shared bearer token, tenant named per call" if auth.required else "no auth"
