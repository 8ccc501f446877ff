"""LMCache integration: the ``lmcache server`` launcher, our L2 adapter plugin, the warm
client and the subscriber to the server's KV events that the ``lmcache-mp`` node backend
(:mod:`kvprefetch.agents.backends.lmcache`) drives, and the engine emulator's LMCache
client.

Importing this package does not import LMCache (nor torch): the clients import it when
they connect. The L2 adapter (:mod:`kvprefetch.agents.lmcache.l2.adapter`, loaded by
``lmcache server`` itself) subclasses LMCache and is imported by name only (as is the
benchmark that drives it, :mod:`kvprefetch.controlplane.harness.lmcache_bench`).
"""

from kvprefetch.agents.lmcache.engine_kv import LMCacheEngineConfig, LMCacheEngineKV
from kvprefetch.agents.lmcache.errors import (
    LMCacheConfigMismatchError,
    LMCacheError,
    LMCacheNoLayoutError,
    LMCacheRequestError,
    LMCacheTimeoutError,
    LMCacheTransferError,
    LMCacheUnavailableError,
)
from kvprefetch.agents.lmcache.kv_events import KVEventStats, KVEventSubscriber
from kvprefetch.agents.lmcache.l1_residency import L1Residency
from kvprefetch.agents.lmcache.mp_client import KVLayout, LMCacheMPClient
from kvprefetch.agents.lmcache.server import LMCacheServer, find_lmcache
from kvprefetch.agents.lmcache.warm import LMCacheWarmClient, WarmResult, object_keys

__all__ = [
    "KVEventStats",
    "KVEventSubscriber",
    "KVLayout",
    "L1Residency",
    "LMCacheConfigMismatchError",
    "LMCacheEngineConfig",
    "LMCacheEngineKV",
    "LMCacheError",
    "LMCacheMPClient",
    "LMCacheNoLayoutError",
    "LMCacheRequestError",
    "LMCacheServer",
    "LMCacheTimeoutError",
    "LMCacheTransferError",
    "LMCacheUnavailableError",
    "LMCacheWarmClient",
    "WarmResult",
    "find_lmcache",
    "object_keys",
]
