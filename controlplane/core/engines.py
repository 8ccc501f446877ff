"""Engine profiles: the engine stack a fleet runs, as the mechanisms it offers a policy.

A policy (:class:`~kvprefetch.controlplane.core.policies.PolicySpec`) says what it would
do; the engine it runs on says what can be done. :func:`on_engine` turns one into the
other: every policy in a comparison runs on the same profile, gets each mechanism the
profile offers to every policy (the tier hierarchy, asynchronous loads, loads at queue
time) and loses each mechanism it asks for that the profile lacks (a DRAM ranking the tier
cannot be driven by, trims, HBM retention). A profile is a small declared table
(:attr:`EngineProfile.mechanisms`): each mechanism it offers cites the engine API that
carries it out, and a mechanism no engine API carries out is in no profile.

The profiles:

* ``vllm-lmcache`` (the default, what the shipped deployment runs): vLLM 0.32 with
  LMCache 0.5.6's multiprocess server. Every context is written through to LMCache's L1 when
  it is stored; L1 evicts by its own LRU; kvprefetch's warm makes room by whole-session evict
  advice chosen by predicted next use; loads are asynchronous (the GPU serves other requests
  while one's KV lands) and may start when the request is queued.
* ``vllm-lmcache-lazy``: the same with ``lmcache.mp.lazy_offload``: a context reaches L1
  when vLLM is about to evict its blocks, not when it is stored.
* ``sglang-hicache``: SGLang 0.5.23 HiCache with ``write_back``: the host pool is written
  when the device evicts; it keeps its own LRU, which kvprefetch's advice does not reach.
* ``local``: kvprefetch's own node tier (``agent.backend: local``), which kvprefetch
  ranks by predicted next use and trims to a prefix.

No profile offers HBM retention: neither vLLM nor SGLang lets an outside component rank or
pin the GPU prefix cache (docs/engines-retention.md). The published peers bring their own
engine change, which no other policy gets: an HBM ranking (``continuum-ttl``, ``mori``;
:attr:`PolicySpec.hbm_retention`) or a DRAM retention window (``ttl-lognormal``, LMCache's
retention pull request, not in 0.5.6).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.core.policies import EvictionKind, LoadStart, PolicySpec

__all__ = ["DEFAULT_ENGINE", "ENGINES", "EngineProfile", "Mechanism", "engine_profile",
           "on_engine"]


class Mechanism(enum.Enum):
    """A mechanism an engine stack may offer (the rows of a profile's table)."""

    #: A context reaches DRAM when HBM evicts it, not when it is stored (otherwise every
    #: context is written through at store time).
    DEMOTE_ON_EVICT = "demote-on-evict"
    #: The GPU serves other requests while a request's KV loads from the remote store
    #: (otherwise the GPU waits for the load once it picks the request up).
    ASYNC_LOAD = "async-load"
    #: A request's remote load may start when it is queued, not when the GPU picks it up.
    QUEUED_LOAD = "queued-load"
    #: kvprefetch deletes whole sessions from the DRAM tier (evict advice), chosen by
    #: predicted next use, to make room for a warm; the tier's own evictions stay LRU.
    EVICT_ADVICE = "evict-advice"
    #: The DRAM tier evicts by kvprefetch's ranking (predicted next use), not its own.
    DRAM_RANKING = "dram-ranking"
    #: kvprefetch cuts a session's DRAM copy back to a prefix, chunk by chunk.
    TRIMS = "trims"


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine stack: its name, a line on what it is, and the mechanisms it offers,
    each with the engine API that carries it out (:class:`Mechanism` -> citation)."""

    name: str
    summary: str
    mechanisms: Mapping[Mechanism, str] = field(default_factory=dict)

    def offers(self, mechanism: Mechanism) -> bool:
        return mechanism in self.mechanisms

    def table(self) -> list[tuple[str, str]]:
        """(mechanism, what carries it out or "-") for every mechanism, in declared order."""
        return [(m.value, self.mechanisms.get(m, "-")) for m in Mechanism]


_LMCACHE_LOADS: dict[Mechanism, str] = {
    Mechanism.ASYNC_LOAD: "LMCacheMPConnector.get_num_new_matched_tokens returns "
    "load_kv_async: the request waits for its KV outside the running batch "
    "(lmcache/integration/vllm/lmcache_mp_connector.py)",
    Mechanism.QUEUED_LOAD: "lmcache.mp.eager_prefetch: the lookup and L2 prefetch start "
    "when the request enters vLLM's waiting queue",
    Mechanism.EVICT_ADVICE: "DELETE /cache/objects, tier l1 (LMCache MP server; "
    "kvprefetch.agents.backends.lmcache.warmer evict_sessions)",
}

ENGINES: Mapping[str, EngineProfile] = MappingProxyType({
    p.name: p for p in (
        EngineProfile(
            "vllm-lmcache",
            "vLLM 0.32 + LMCache 0.5.6 MP server: write-through L1 (LRU), async loads",
            MappingProxyType(dict(_LMCACHE_LOADS))),
        EngineProfile(
            "vllm-lmcache-lazy",
            "vLLM 0.32 + LMCache 0.5.6 MP server with lazy_offload: L1 written on HBM evict",
            MappingProxyType({
                Mechanism.DEMOTE_ON_EVICT: "lmcache.mp.lazy_offload: a store is emitted when "
                "the request's GPU blocks near the free queue's eviction head "
                "(lmcache/integration/vllm/lazy_offload_manager.py)",
                **_LMCACHE_LOADS})),
        EngineProfile(
            "sglang-hicache",
            "SGLang 0.5.23 HiCache, write_back: host pool written on device evict (LRU)",
            MappingProxyType({
                Mechanism.DEMOTE_ON_EVICT: "--hicache-write-policy write_back "
                "(sglang/srt/managers/cache_controller.py)",
                Mechanism.ASYNC_LOAD: "the storage prefetch of a queued request runs beside "
                "the running batch (--hicache-storage-prefetch-policy)",
                Mechanism.QUEUED_LOAD: "HiCache starts the L3 prefetch when the request is "
                "queued (prefetch_from_storage)",
            })),
        EngineProfile(
            "local",
            "kvprefetch's own node tier (agent.backend: local): predicted-use ranking, trims",
            MappingProxyType({
                Mechanism.ASYNC_LOAD: "the engine reads the node tier through its connector's "
                "asynchronous load, as from LMCache",
                Mechanism.QUEUED_LOAD: "the scheduler's demand order at routing "
                "(kvprefetch.controlplane.core.loads)",
                Mechanism.EVICT_ADVICE: "the agent's evict advice (kvprefetch.agents.stores."
                "local LocalTier.evict)",
                Mechanism.DRAM_RANKING: "agent.tier_eviction: predicted "
                "(kvprefetch.agents.stores.eviction PredictedNextUsePolicy)",
                Mechanism.TRIMS: "the agent's trim advice keeps a prefix "
                "(kvprefetch.agents.stores.local)",
            })),
    )
})

#: What ``kvprefetch sim`` and ``sim-grid`` run unless told otherwise: what the shipped
#: deployment runs.
DEFAULT_ENGINE = "vllm-lmcache"


def engine_profile(name: str) -> EngineProfile:
    """The profile ``name``; a :class:`ConfigError` that lists the known ones otherwise."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigError(f"unknown engine profile {name!r}; known: "
                          f"{', '.join(ENGINES)}") from None


def on_engine(policy: PolicySpec, engine: EngineProfile) -> PolicySpec:
    """``policy`` as it runs on ``engine``: the engine's hierarchy and load mechanisms for
    every policy; a DRAM ranking, trims or an engine load at queue time that the engine lacks
    fall back to what it has (LRU, whole sessions, the load at GPU start). ``ADAPTIVE``
    loads are the scheduler's own timed orders and run on every profile; HBM retention is
    a peer's own engine change (:attr:`PolicySpec.hbm_retention`) and is kept. A policy
    whose forecasts are off ranks by recency and prefetches nothing. Idempotent."""
    eviction = policy.eviction
    if eviction is EvictionKind.PREDICTED_USE and not (
            policy.forecasts and engine.offers(Mechanism.DRAM_RANKING)):
        eviction = EvictionKind.LRU
    load_start = policy.load_start
    if load_start is LoadStart.ON_ARRIVAL and not engine.offers(Mechanism.QUEUED_LOAD):
        load_start = LoadStart.ON_SCHEDULE
    prefetch = policy.prefetch and policy.forecasts
    return replace(
        policy,
        eviction=eviction,
        load_start=load_start,
        prefetch=prefetch,
        suffix_eviction=policy.suffix_eviction and engine.offers(Mechanism.TRIMS),
        evict_advice=policy.evict_advice and prefetch and engine.offers(Mechanism.EVICT_ADVICE),
        demote_on_evict=policy.dram_tier and engine.offers(Mechanism.DEMOTE_ON_EVICT),
        async_load=policy.remote and engine.offers(Mechanism.ASYNC_LOAD),
        engine=engine.name,
    )

