"""Where a node's prompt tokens were served from, by vLLM's and LMCache's own counters.

One :class:`EngineCounters` snapshot reads both engines of a node (or of several nodes,
summed): vLLM's ``GET /metrics`` (:meth:`kvprefetch.agents.vllm.server.VLLMServer.counters`) and the
node's LMCache server's lookup counters (:meth:`kvprefetch.agents.lmcache.warm.LMCacheWarmClient.
lookup_hits`). The difference of two snapshots attributes the requests in between:

- ``vllm_prefix_hit_tokens``: prompt tokens found in vLLM's own prefix cache (its KV
  blocks, the "HBM" of a CPU node);
- ``vllm_external_hit_tokens``: prompt tokens vLLM's KV connector loaded (from LMCache);
- ``lmcache_l1_hit_tokens``: tokens LMCache's lookups found in L1 already (a warmed or
  still-resident session);
- ``lmcache_l2_hit_tokens``: tokens LMCache's lookups had to load from L2 (our adapter over
  Valkey + S3) while the request waited: the on-demand path.

Both engines count off the request path (vLLM when a request finishes, LMCache after a
lookup): :func:`wait_for_requests` waits until they caught up. Used by the vLLM CPU tests
and ``kvprefetch demo --engine vllm``; imports neither vLLM nor LMCache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient
    from kvprefetch.agents.vllm.server import VLLMServer

#: The four counters a report names, in report order.
REPORTED = ("vllm_prefix_hit_tokens", "vllm_external_hit_tokens", "lmcache_l1_hit_tokens",
            "lmcache_l2_hit_tokens")


@dataclass(frozen=True)
class EngineCounters:
    """Cumulative counters of one or more nodes' engines (tokens unless named otherwise);
    subtract two snapshots for what happened in between."""

    vllm_prefix_hit_tokens: int = 0
    vllm_external_hit_tokens: int = 0
    lmcache_l1_hit_tokens: int = 0
    lmcache_l2_hit_tokens: int = 0
    vllm_prompt_tokens: int = 0
    #: Requests vLLM finished.
    vllm_requests: int = 0
    #: Lookups LMCache answered (one per request that reached its connector).
    lmcache_lookups: int = 0

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(*(getattr(self, f.name) + getattr(other, f.name)
                                for f in fields(self)))

    def __sub__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(*(getattr(self, f.name) - getattr(other, f.name)
                                for f in fields(self)))

    def reported(self) -> dict[str, int]:
        """The four counters of a report (:data:`REPORTED`)."""
        return {name: int(getattr(self, name)) for name in REPORTED}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


def read_counters(vllm: VLLMServer, lmcache: LMCacheWarmClient, model_name: str,
                  cache_salt: str = "") -> EngineCounters:
    """One node's counters now. ``model_name`` is the name vLLM registered its KV layout
    under at LMCache (the model's path as given to vLLM)."""
    v = vllm.counters()
    lm = lmcache.lookup_hits(model_name, cache_salt)
    return EngineCounters(
        vllm_prefix_hit_tokens=v.prefix_hit_tokens,
        vllm_external_hit_tokens=v.external_hit_tokens,
        lmcache_l1_hit_tokens=lm.l1_tokens, lmcache_l2_hit_tokens=lm.l2_tokens,
        vllm_prompt_tokens=v.prompt_tokens, vllm_requests=v.requests,
        lmcache_lookups=lm.lookups)


def read_fleet(nodes: Sequence[tuple[VLLMServer, LMCacheWarmClient]], model_name: str,
               cache_salt: str = "") -> EngineCounters:
    """The counters of several nodes, summed (LMCache's for one cache salt: the tenant's
    whose requests are counted)."""
    total = EngineCounters()
    for vllm, lmcache in nodes:
        total = total + read_counters(vllm, lmcache, model_name, cache_salt)
    return total


def wait_for_requests(read: Any, before: EngineCounters, *, requests: int, lookups: int = 0,
                      timeout_s: float = 30.0, poll_s: float = 0.1) -> EngineCounters:
    """Read (``read()`` returns an :class:`EngineCounters`) until at least ``requests``
    finished requests and ``lookups`` LMCache lookups were counted since ``before``;
    returns the difference. Raises TimeoutError naming what was missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        diff: EngineCounters = read() - before
        if diff.vllm_requests >= requests and diff.lmcache_lookups >= lookups:
            return diff
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"engine counters did not catch up within {timeout_s} s: vLLM counted "
                f"{diff.vllm_requests} of {requests} requests, LMCache {diff.lmcache_lookups} "
                f"of {lookups} lookups")
        time.sleep(poll_s)
