"""The ``lmcache-mp`` node backend: orders run as warm prefetches of the node's LMCache MP
server (L2 -> L1) by :class:`~kvprefetch.agents.backends.lmcache.warmer.LMCacheWarmer`; evict
advice deletes the sessions' objects from L1 (L2 keeps them); the engine stores through
LMCache itself, so the agent's write-through and trim have nothing to do; what L1 drops on
its own reaches the agent's eviction report from the server's KV events."""

from __future__ import annotations

from collections.abc import Sequence

from kvprefetch.agents.backends.base import BackendContext, OrderGuard, WarmHandleLike
from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig, LMCacheWarmer
from kvprefetch.agents.lmcache.kv_events import KVEventStats
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.keys import parse_session_prefix
from kvprefetch.controlplane.base.wire import TransferOrder


class LMCacheBackend:
    """See the module docstring; a :class:`~kvprefetch.agents.backends.base.NodeBackend`."""

    tier = None

    def __init__(self, context: BackendContext) -> None:
        config = context.settings
        if not isinstance(config, LMCacheBackendConfig):
            raise ConfigError("backend 'lmcache-mp' needs 'lmcache' (the node's LMCache "
                              "server: http_url, model_name ...)")
        self._config = config
        self._warmer = LMCacheWarmer(config, context.store, name=f"agent{context.node}",
                                     on_evict=context.on_evict)

    def start(self) -> None:
        """Check the server's settings against ours (refuses a server whose keys cannot
        match) and follow its KV events."""
        self._warmer.start()

    def close(self) -> None:
        self._warmer.close()

    def describe(self) -> str:
        return f"LMCache L1 at {self._config.http_url}"

    def warm(self, order: TransferOrder) -> WarmHandleLike:
        return self._warmer.submit(order)

    def evict(self, prefixes: Sequence[str], keys: Sequence[str], guard: OrderGuard) -> int:
        """The sessions under ``prefixes`` leave L1 (LMCache deletes whole sessions)."""
        return self._warmer.evict_sessions([parse_session_prefix(p) for p in prefixes])

    def write(self, items: Sequence[tuple[str, bytes]]) -> int:
        return 0

    def trim(self, keys: Sequence[str], guard: OrderGuard) -> None:
        return None

    def listing(self) -> tuple[str, ...]:
        return self._warmer.warm_keys()

    def has(self, keys: Sequence[str]) -> list[bool]:
        warm = set(self._warmer.warm_keys())
        return [k in warm for k in keys]

    def holds(self, keys: Sequence[str]) -> list[bool]:
        return self._warmer.holds(keys)

    def stats(self) -> tuple[int, int, int]:
        used, capacity = self._warmer.usage()
        return used, capacity, len(self._warmer.warm_keys())

    def engine_ready(self) -> bool:
        return self._warmer.engine_ready()

    def events(self) -> KVEventStats | None:
        return self._warmer.event_stats()
