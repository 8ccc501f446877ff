"""The ``local`` node backend: orders are copies from the remote store into the node's own
DRAM/disk tier (:class:`~kvprefetch.agents.stores.local.LocalTier`) by the transfer engine
(atomic publish: a chunk is visible whole or not at all, also when the agent is killed
mid-transfer). Each order's ``deadline_s`` goes to the tier's eviction policy as its keys'
predicted next use (``eviction: predicted``); keys that evict advice names but a running
order keeps are advised as never needed again."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvprefetch.agents.backends.base import BackendContext, OrderGuard, WarmHandleLike
from kvprefetch.agents.backends.common import TierCopier
from kvprefetch.agents.stores.local import LocalTier
from kvprefetch.agents.transfer import TransferEngine
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.wire import TransferOrder


class LocalBackend:
    """See the module docstring; a :class:`~kvprefetch.agents.backends.base.NodeBackend`."""

    def __init__(self, context: BackendContext) -> None:
        if context.dram is None:
            raise ConfigError("backend 'local' needs 'dram' (the node's local tier)")
        self._copier = TierCopier(context)

    @property
    def tier(self) -> LocalTier | None:
        return self._copier.tier

    def start(self) -> None:
        """Open the tier (dropping partial writes of a killed predecessor) and start the
        transfer engine."""
        self._copier.start()

    def close(self) -> None:
        self._copier.close()

    def describe(self) -> str:
        return self._copier.describe()

    def _started(self) -> tuple[LocalTier, TransferEngine]:
        return self._copier.started()

    def warm(self, order: TransferOrder) -> WarmHandleLike:
        tier, engine = self._started()
        # The deadline is when the scheduler predicts the keys are read. A demand load is
        # needed at once: its deadline is the scheduler's present, so older advice is spent.
        tier.advise(dict.fromkeys(order.keys, order.deadline_s),
                    now_s=None if order.prefetch else order.deadline_s)
        return engine.submit(order.keys, priority=order.priority)

    def evict(self, prefixes: Sequence[str], keys: Sequence[str], guard: OrderGuard) -> int:
        tier, _ = self._started()
        pre = tuple(prefixes)
        # Under the guard from choosing to deleting: an order admitted meanwhile either
        # claims its keys first (kept) or starts after they are gone (loads them again).
        with guard() as busy:
            victims = set(keys)
            if pre:
                held = tier.keys()
                victims.update(k for k in held if k.startswith(pre))
            kept = {k for k in busy if k in victims or (pre and k.startswith(pre))}
            if kept:
                tier.advise(dict.fromkeys(kept, math.inf))
            victims -= busy
            return sum(1 for r in tier.delete(sorted(victims)) if r.ok) if victims else 0

    def write(self, items: Sequence[tuple[str, bytes]]) -> int:
        tier, _ = self._started()
        return sum(1 for r in tier.put(list(items)) if r.ok)

    def trim(self, keys: Sequence[str], guard: OrderGuard) -> None:
        tier, _ = self._started()
        with guard() as busy:  # as in evict: no order starts between choosing and deleting
            victims = sorted(set(keys) - busy)
            if victims:
                tier.delete(victims)

    def listing(self) -> tuple[str, ...]:
        tier, _ = self._started()
        return tuple(tier.keys())

    def has(self, keys: Sequence[str]) -> list[bool]:
        return self.holds(keys)

    def holds(self, keys: Sequence[str]) -> list[bool]:
        tier, _ = self._started()
        return [r.ok for r in tier.exists(list(keys))]

    def stats(self) -> tuple[int, int, int]:
        tier, _ = self._started()
        return tier.used_bytes, tier.capacity_bytes, len(tier.keys())

    def engine_ready(self) -> bool:
        return True  # the tier is there once started

    def events(self) -> None:
        """The local tier follows no engine's events."""
        return None
