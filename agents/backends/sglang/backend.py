"""The ``sglang`` node backend: the node's local tier (as the ``local`` backend keeps it)
filled with SGLang's page objects by the warmer
(:class:`~kvprefetch.agents.backends.sglang.warmer.SGLangWarmer`), which kvprefetch's SGLang
HiCache backend reads first. Evict advice deletes the sessions' pages; SGLang writes its own
pages through its HiCache backend, so the agent's write-through and trim have nothing to
do."""

from __future__ import annotations

from collections.abc import Sequence

from kvprefetch.agents.backends.base import BackendContext, OrderGuard, WarmHandleLike
from kvprefetch.agents.backends.common import TierCopier
from kvprefetch.agents.backends.sglang.warmer import SGLangWarmConfig, SGLangWarmer
from kvprefetch.agents.stores.local import LocalTier
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.keys import parse_session_prefix
from kvprefetch.controlplane.base.wire import TransferOrder


class SGLangBackend:
    """See the module docstring; a :class:`~kvprefetch.agents.backends.base.NodeBackend`."""

    def __init__(self, context: BackendContext) -> None:
        if context.dram is None or not isinstance(context.settings, SGLangWarmConfig):
            raise ConfigError("backend 'sglang' needs 'dram' (the tier SGLang's kvprefetch "
                              "backend reads first) and 'sglang' (model_name, page_size ...)")
        self._context = context
        self._config: SGLangWarmConfig = context.settings
        self._copier = TierCopier(context)
        self._warmer: SGLangWarmer | None = None

    @property
    def tier(self) -> LocalTier | None:
        return self._copier.tier

    def start(self) -> None:
        self._copier.start()
        tier, engine = self._copier.started()
        self._warmer = SGLangWarmer(self._config, self._context.store, tier, engine,
                                    name=f"agent{self._context.node}-sglang")
        self._warmer.start()

    def close(self) -> None:
        if self._warmer is not None:  # before the engine: a warm waits on it
            self._warmer.close()
            self._warmer = None
        self._copier.close()

    def describe(self) -> str:
        return f"{self._copier.describe()}, SGLang pages of {self._config.model_name}"

    def _started(self) -> tuple[LocalTier, SGLangWarmer]:
        tier, _ = self._copier.started()
        if self._warmer is None:
            raise ConfigError(f"agent {self._context.node} is not started")
        return tier, self._warmer

    def warm(self, order: TransferOrder) -> WarmHandleLike:
        return self._started()[1].submit(order)

    def evict(self, prefixes: Sequence[str], keys: Sequence[str], guard: OrderGuard) -> int:
        """The sessions under ``prefixes`` lose the pages of their last warm."""
        warmer = self._started()[1]
        return warmer.evict_sessions([parse_session_prefix(p) for p in prefixes])

    def write(self, items: Sequence[tuple[str, bytes]]) -> int:
        return 0

    def trim(self, keys: Sequence[str], guard: OrderGuard) -> None:
        return None

    def listing(self) -> tuple[str, ...]:
        return self._started()[1].warm_keys()

    def has(self, keys: Sequence[str]) -> list[bool]:
        warm = set(self.listing())
        return [k in warm for k in keys]

    def holds(self, keys: Sequence[str]) -> list[bool]:
        return [r.ok for r in self._started()[0].exists(list(keys))]

    def stats(self) -> tuple[int, int, int]:
        tier, warmer = self._started()
        return tier.used_bytes, tier.capacity_bytes, len(warmer.warm_keys())

    def engine_ready(self) -> bool:
        return True  # the tier is there once started

    def events(self) -> None:
        """SGLang's events are not followed."""
        return None
