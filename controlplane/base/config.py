"""The fleet and cost model: one pydantic model, loadable from YAML, validated at start-up.

Every default states its source. Units are in field names (``_s``, ``_bytes``, ``_gbps``
= gigabits per second, ``_gbyte_s`` = gigabytes per second, ``_flops``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.units import ByteSize

GIB = 1 << 30


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelProfile(_Frozen):
    """A served model: KV geometry and compute.

    KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes.
    """

    name: str
    parameters: float = Field(gt=0, description="P, total parameters")
    layers: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    d_model: int = Field(gt=0)
    dtype_bytes: int = Field(gt=0, le=8)
    #: Memory-bound decode latency per output token at moderate batch (seconds).
    decode_s_per_token: float = Field(gt=0)
    #: Context window. Longer trace requests are clamped to it by the simulator (the
    #: Claude Code traces come from a model with a larger window).
    max_context_tokens: int = Field(131072, gt=0)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, new_tokens: int, cached_tokens: int) -> float:
        """FLOPs to prefill ``new_tokens`` after ``cached_tokens`` of reused context:
        2*P*n (weights) + 4*layers*d_model*(n*c + n^2/2) (attention scores and values)."""
        n, c = float(new_tokens), float(cached_tokens)
        return 2.0 * self.parameters * n + 4.0 * self.layers * self.d_model * (n * c + n * n / 2)


class NodeProfile(_Frozen):
    """One serving node = one engine instance (one GPU, or a tensor-parallel group)."""

    gpus: int = Field(1, gt=0)
    #: Dense bf16 peak per GPU. H100 SXM: 989 TFLOP/s (NVIDIA H100 datasheet).
    peak_flops_per_gpu: float = Field(989e12, gt=0)
    #: Prefill model-FLOPs utilisation; 0.4-0.6 is typical (docs/architecture.md, Cost model).
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    hbm_kv_bytes: ByteSize = Field(gt=0, description="HBM left for KV after weights/activations "
                                   "(bytes, or a size such as 48GiB)")
    dram_tier_bytes: ByteSize = Field(ge=0, description="node-local CPU DRAM tier (LMCache L1; "
                                      "bytes, or a size such as 64GiB)")
    #: NIC bandwidth per node: 100-400 Gb/s is common for GPU nodes (docs/architecture.md,
    #: Cost model).
    nic_gbps: float = Field(100.0, gt=0)
    #: Host-to-GPU copy bandwidth; PCIe 5 x16 gives ~25-50 GB/s in practice
    #: (docs/architecture.md, Cost model).
    h2d_gbyte_s: float = Field(25.0, gt=0)
    #: Fixed seconds per request between the engine taking it and its first token, beyond
    #: the copy, the prefill and one decode step (an engine's HTTP and scheduling path). 0
    #: in the reference fleet, whose cost model has no such term; a calibrated twin of a
    #: measured engine sets it.
    request_overhead_s: float = Field(0.0, ge=0)

    @property
    def prefill_flops_per_s(self) -> float:
        return self.gpus * self.peak_flops_per_gpu * self.prefill_mfu

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9 / 8


class RemoteStoreProfile(_Frozen):
    """The remote token store: Valkey (hot, in front of) S3 (cold, durable)."""

    #: Valkey per-request latency: sub-millisecond on a local network (docs/architecture.md,
    #: Cost model).
    valkey_latency_s: float = Field(0.0005, ge=0)
    #: Valkey throughput one node can pull with several connections and striped values
    #: (one connection alone reads a fraction of it; ``kvprefetch bench store`` measures a
    #: deployment's).
    valkey_gbyte_s_per_node: float = Field(5.0, gt=0)
    #: Total Valkey memory for KV, shared by the fleet (4 shards x 128 GiB); LRU beyond
    #: it, and older objects are read from S3.
    valkey_capacity_bytes: ByteSize = Field(512 * GIB, ge=0)
    #: S3 first-byte latency: tens of ms for S3 standard (AWS S3 performance guidelines).
    s3_first_byte_s: float = Field(0.030, ge=0)
    #: ~100 MB/s per connection (AWS S3 performance guidelines), many ranged GETs in parallel.
    s3_gbyte_s_per_connection: float = Field(0.1, gt=0)
    s3_connections: int = Field(64, gt=0)


class RouterConfig(_Frozen):
    """Request routing: estimated TTFT per node with a bonus for the session's home node."""

    #: A node other than the session's home must be better by this much to win (seconds).
    affinity_margin_s: float = Field(0.25, ge=0)
    #: Nodes whose estimates are within this share of the lowest are tied, and a tie goes
    #: to the first of them in the session's own order of the nodes (a rendezvous hash of
    #: session and node): sessions that no node holds spread over a fleet of equal nodes
    #: instead of all going to the lowest-numbered one, and a session tied again goes
    #: where it went before. 0: exact ties only.
    tie_share: float = Field(0.01, ge=0, lt=1)
    #: Salt of the sessions' order of the nodes: fleets with other salts spread the same
    #: sessions over other nodes (the yardstick's noise floor replays a cell with several).
    tie_salt: str = Field("", max_length=64)


class PlannerConfig(_Frozen):
    """The prefetch planner of the ``predictive`` policy."""

    #: Plan for the arrival quantile at this level: early quantiles start transfers sooner
    #: (fewer late prefetches, more DRAM occupied).
    arrival_quantile: float = Field(0.1, gt=0, lt=1)
    #: Finish this long before the chosen arrival quantile (seconds).
    safety_margin_s: float = Field(0.5, ge=0)
    #: Skip prefetches for sessions less likely than this to return within the horizon.
    min_p_return: float = Field(0.3, ge=0, le=1)
    #: Skip prefetches whose forecast is less confident than this (0, the default: plan
    #: every forecast likely enough to return; whether one starts is decided by the
    #: forecasts' record, ``prefetch_min_win_share``).
    min_confidence: float = Field(0.0, ge=0, le=1)
    #: A prefetch (which takes room that recency would keep) starts only where its
    #: forecasts have won this share of their bets against the residents it pushes out
    #: and its prefetches taken were read at least this often (one-sided 95% bounds;
    #: :mod:`kvprefetch.controlplane.core.bets`). Above 0.5 (the default 0.6) the
    #: forecast must beat recency by a margin; 1 turns prefetch off but for certain
    #: forecasts; 0 starts every one, record or not.
    prefetch_min_win_share: float = Field(0.6, ge=0, le=1)
    #: Forecasts at least this confident (a client's hint with an ETA, 0.9,
    #: ``kvprefetch.predictors.hinted``) keep a record of their own.
    displace_min_confidence: float = Field(0.85, ge=0, le=1)
    #: ... and only residents predicted to be used after this quantile of its arrival (a
    #: late one: the candidate must come first with some certainty, not only on median).
    displace_quantile: float = Field(0.75, ge=0.5, lt=1)
    #: Do not plan further ahead than this (seconds); such sessions are re-planned later,
    #: and sessions idle for longer are no longer swept.
    max_lead_s: float = Field(3600.0, gt=0)
    #: The waste budget's allowance (GiB): prefetched bytes evicted unread may exceed the
    #: prefetched bytes requests read by at most this much (policies with
    #: ``waste_budget``). It is the credit prefetch starts with; used prefetches earn more.
    waste_allowance_gib: float = Field(32.0, ge=0)
    #: ... and wasted bytes may reach this multiple of the bytes requests read (1: a
    #: prefetch never wastes more than it brings, beyond the allowance).
    waste_per_used_byte: float = Field(1.0, ge=0)
    #: The allowance refills by its size every this many seconds (0: it never refills, and
    #: a budget spent with nothing prefetched left unread stays spent until the scheduler
    #: restarts).
    waste_window_s: float = Field(3600.0, ge=0)
    #: How often idle sessions whose KV left their node are re-planned (seconds).
    sweep_interval_s: float = Field(10.0, gt=0)
    #: ``predictive`` loads a missing context at the request's arrival when the node's
    #: estimated queue wait hides at least this share of the load's time to last byte,
    #: and when the GPU picks the request up otherwise. 0 (the default): during any
    #: queue wait (a request that does not queue is loaded at its GPU start). While the
    #: request waits its load yields the link to the loads GPUs wait for
    #: (``QUEUED_PRIORITY``), so even a short overlap is a gain.
    arrival_load_min_wait_fraction: float = Field(0.0, ge=0)
    #: ... and starts it at most this multiple of the time to last byte before the GPU is
    #: expected to pick the request up: behind a longer queue, a load at arrival would
    #: hold DRAM for the whole wait and an overloaded fleet thrashes, so the load waits in
    #: the queue with its request and starts that long before the request's estimated GPU
    #: start.
    arrival_load_max_wait_fraction: float = Field(3.0, gt=0)


class FleetConfig(_Frozen):
    """The modelled GPU fleet: N identical nodes serving one model from one remote store."""

    nodes: int = Field(4, gt=0, le=4096)
    model: ModelProfile
    node: NodeProfile
    remote: RemoteStoreProfile = RemoteStoreProfile()
    router: RouterConfig = RouterConfig()
    planner: PlannerConfig = PlannerConfig()

    @model_validator(mode="after")
    def _check_capacity(self) -> FleetConfig:
        if self.node.hbm_kv_bytes < 1024 * self.model.kv_bytes_per_token:
            raise ValueError(
                "node.hbm_kv_bytes holds fewer than 1024 tokens of KV for model "
                f"{self.model.name!r} ({self.model.kv_bytes_per_token} bytes/token)"
            )
        return self

    def shard_quota(self, shards: int, *, shared_tier: bool = False) -> FleetConfig:
        """What one of ``shards`` scheduler shards may plan with: each node's DRAM tier,
        NIC rate and Valkey read rate, the Valkey capacity and the waste allowance divided
        evenly (a static quota: two shards never promise the same bytes or bandwidth). HBM
        is the engine's, not the scheduler's to divide: each shard sees it as it is.
        ``shared_tier``: every shard books the whole DRAM tier, and the node's tier decides
        what stays when their writes overfill it (each eviction reported to its owner)."""
        if shards == 1:
            return self
        node, remote, planner = self.node, self.remote, self.planner
        tier = node.dram_tier_bytes if shared_tier else node.dram_tier_bytes // shards
        return FleetConfig.model_validate({
            **self.model_dump(),
            "node": {**node.model_dump(), "dram_tier_bytes": tier,
                     "nic_gbps": node.nic_gbps / shards},
            "remote": {**remote.model_dump(),
                       "valkey_gbyte_s_per_node": remote.valkey_gbyte_s_per_node / shards,
                       "valkey_capacity_bytes": remote.valkey_capacity_bytes // shards},
            "planner": {**planner.model_dump(),
                        "waste_allowance_gib": planner.waste_allowance_gib / shards}})

    @property
    def local_capacity_bytes(self) -> int:
        """HBM KV + DRAM tier over all nodes: what local tiers can hold at once."""
        return self.nodes * (self.node.hbm_kv_bytes + self.node.dram_tier_bytes)

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        return self.model.prefill_flops(new_tokens, cached_tokens) / self.node.prefill_flops_per_s


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

#: Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, d_model 4096, 8.03e9 parameters
#: (Meta's model card / config.json); bf16 KV = 128 KiB per token. Decode ~8 ms/token on one
#: H100 at moderate batch (vLLM benchmarks report 6-12 ms TPOT for 8B models).
LLAMA_8B = ModelProfile(
    name="llama-3.1-8b", parameters=8.03e9, layers=32, kv_heads=8, head_dim=128,
    d_model=4096, dtype_bytes=2, decode_s_per_token=0.008,
)
#: Llama-3.1-70B: 80 layers, 8 KV heads, head_dim 128, d_model 8192, 70.6e9 parameters
#: (Meta's model card); bf16 KV = 320 KiB per token. Decode ~20 ms/token with TP=8 on H100.
LLAMA_70B = ModelProfile(
    name="llama-3.1-70b", parameters=70.6e9, layers=80, kv_heads=8, head_dim=128,
    d_model=8192, dtype_bytes=2, decode_s_per_token=0.020,
)

MODELS: dict[str, ModelProfile] = {m.name: m for m in (LLAMA_8B, LLAMA_70B)}
MODEL_ALIASES: dict[str, str] = {"8b": LLAMA_8B.name, "70b": LLAMA_70B.name}

#: One H100-80GB per 8B engine: 80 GB - 16 GB bf16 weights - activations/graphs leaves
#: ~48 GiB for KV (vLLM's default gpu_memory_utilization=0.9). DRAM tier: 64 GiB of the
#: node's host memory per GPU for LMCache's L1 (a DGX H100 has 2 TiB for 8 GPUs, shared
#: with everything else on the host). NIC: 100 Gb/s per GPU.
H100_FOR_8B = NodeProfile(gpus=1, hbm_kv_bytes=48 * GIB, dram_tier_bytes=64 * GIB, nic_gbps=100)
#: 8 x H100 with TP=8 per 70B engine: 640 GB - 141 GB weights - activations leaves ~400 GiB
#: for KV; 512 GiB DRAM tier; 400 Gb/s NIC (one 400G NIC per node is common).
H100X8_FOR_70B = NodeProfile(
    gpus=8, hbm_kv_bytes=400 * GIB, dram_tier_bytes=512 * GIB, nic_gbps=400, h2d_gbyte_s=50.0
)

NODE_PRESETS: dict[str, NodeProfile] = {LLAMA_8B.name: H100_FOR_8B, LLAMA_70B.name: H100X8_FOR_70B}

#: Node presets per GPU, chosen by name in a fleet (``gpu: l40s``): for each model preset the
#: KV room left in HBM and the GPU's dense bf16 peak, the rest as the model's H100 preset.
#: A100: 312 TFLOP/s dense bf16 (NVIDIA A100 datasheet), 80 GB as the H100, so the same KV
#: room, on PCIe 4 (~25 GB/s to the GPU). L40S: 362 TFLOP/s dense bf16 (NVIDIA L40S
#: datasheet), 48 GB: 90% of it less 16 GB of 8B weights and activations leaves ~22 GiB for
#: KV; eight of them (384 GB) less 141 GB of 70B weights and activations leave ~170 GiB.
GPU_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "h100": {LLAMA_8B.name: {}, LLAMA_70B.name: {}},
    "a100": {LLAMA_8B.name: {"peak_flops_per_gpu": 312e12},
             LLAMA_70B.name: {"peak_flops_per_gpu": 312e12, "h2d_gbyte_s": 25.0}},
    "l40s": {LLAMA_8B.name: {"peak_flops_per_gpu": 362e12, "hbm_kv_bytes": 22 * GIB},
             LLAMA_70B.name: {"peak_flops_per_gpu": 362e12, "hbm_kv_bytes": 170 * GIB,
                              "h2d_gbyte_s": 25.0}},
}


def gpu_node(gpu: str, model: ModelProfile, *, source: str = "fleet config") -> dict[str, Any]:
    """The node preset of ``gpu`` (a :data:`GPU_PRESETS` name) for ``model``: every field of
    :class:`NodeProfile`. A model that is not a preset takes the GPU's peak FLOP/s only; its
    ``hbm_kv_bytes`` is the fleet's to give."""
    presets = GPU_PRESETS.get(gpu.lower())
    if presets is None:
        raise ConfigError(f"{source}: field 'gpu': unknown GPU {gpu!r}; known: "
                          f"{', '.join(sorted(GPU_PRESETS))}")
    base = NODE_PRESETS.get(model.name, H100_FOR_8B).model_dump()
    own = presets.get(model.name)
    if own is None:
        own = {"peak_flops_per_gpu": next(iter(presets.values())).get(
            "peak_flops_per_gpu", base["peak_flops_per_gpu"])}
    return {**base, **own}


def default_fleet(model: str = "8b", nodes: int = 4) -> FleetConfig:
    """The default fleet for a model preset (``8b`` or ``70b``, or a full preset name)."""
    name = MODEL_ALIASES.get(model, model)
    if name not in MODELS:
        known = ", ".join(sorted([*MODEL_ALIASES, *MODELS]))
        raise ConfigError(f"unknown model {model!r}; known: {known}")
    return FleetConfig(nodes=nodes, model=MODELS[name], node=NODE_PRESETS[name])


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{source}: field {loc!r}: {err['msg']}")
    return "; ".join(parts)


def load_fleet(path: str | Path, *, overrides: dict[str, Any] | None = None) -> FleetConfig:
    """Load a fleet from YAML. ``model`` may be a preset name (``8b``/``70b``) or a full
    profile; ``node`` defaults to the model's preset and may override single fields.

    Raises :class:`ConfigError` naming the file and the offending field.
    """
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{p}: fleet config not found") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    raw = {**raw, **(overrides or {})}
    return fleet_from_dict(raw, source=str(p))


def fleet_from_dict(raw: dict[str, Any], *, source: str = "fleet config") -> FleetConfig:
    """Build a fleet from a plain mapping (see :func:`load_fleet`); ``gpu`` (``h100``,
    ``a100``, ``l40s``) picks the node preset of that GPU for the model (:data:`GPU_PRESETS`),
    under the fields ``node`` gives."""
    data = dict(raw)
    model_spec = data.get("model", "8b")
    try:
        if isinstance(model_spec, str):
            name = MODEL_ALIASES.get(model_spec, model_spec)
            if name not in MODELS:
                known = ", ".join(sorted([*MODEL_ALIASES, *MODELS]))
                raise ConfigError(f"{source}: field 'model': unknown preset {model_spec!r}; "
                                  f"known: {known}")
            model = MODELS[name]
        else:
            model = ModelProfile.model_validate(model_spec)
        gpu = data.pop("gpu", None)
        if gpu is not None and not isinstance(gpu, str):
            raise ConfigError(f"{source}: field 'gpu': a GPU name "
                              f"({', '.join(sorted(GPU_PRESETS))})")
        node_base = (gpu_node(gpu, model, source=source) if gpu is not None
                     else NODE_PRESETS.get(model.name, H100_FOR_8B).model_dump())
        node_over = data.get("node") or {}
        if not isinstance(node_over, dict):
            raise ConfigError(f"{source}: field 'node': expected a mapping")
        data["model"] = model
        data["node"] = {**node_base, **node_over}
        return FleetConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from exc

