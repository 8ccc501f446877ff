"""The seam between a node's prefetch agent and the tier its engine reads: the
:class:`NodeBackend` protocol, which the agent drives and each backend implements.

Who calls what: the agent (:class:`~kvprefetch.agents.agent.PrefetchAgent`) builds one
backend per node from the registry (:mod:`kvprefetch.agents.backends.registry`), starts it
once and closes it once. ``warm`` runs once per transfer order the scheduler sends (a few
per second per node); ``evict`` once per evict advice; ``write`` and ``trim`` once per
engine request (the engine's write-through); ``listing``, ``has``, ``holds`` and ``stats``
on greetings, status reports and the engine's lookups; ``events`` on monitoring. Every
method may be called from several threads at once.

Order bookkeeping (which keys a starting or running order claims) is the agent's: a
backend that deletes from a tier the agent's orders write into takes the agent's
:data:`OrderGuard` around choosing and deleting, so that no order starts in between.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvprefetch.agents.transfer import TransferConfig, TransferResult
from kvprefetch.controlplane.base.wire import TransferOrder

if TYPE_CHECKING:
    from kvprefetch.agents.stores.base import ObjectStore
    from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig

#: Held around choosing and deleting keys; yields the keys of every order starting or
#: running, which a delete must leave alone.
OrderGuard = Callable[[], AbstractContextManager[set[str]]]
#: Called with chunk keys the tier evicted by its own order (the agent's eviction report).
EvictionCallback = Callable[[list[str]], None]


class WarmHandleLike(Protocol):
    """One running order: the agent waits on it, or cancels it."""

    def cancel(self, reason: str = "cancelled") -> None: ...

    def done(self) -> bool: ...

    def result(self, timeout_s: float | None = None) -> TransferResult: ...


@dataclass(frozen=True)
class BackendContext:
    """What the agent hands a backend it builds: the node, the remote token store, the
    node's local tier settings (``dram``), the transfer settings, the backend's own config
    section (``settings``, None for a backend without one) and the agent's eviction report."""

    node: int
    store: ObjectStore
    on_evict: EvictionCallback
    dram: LocalTierConfig | None
    transfer: TransferConfig
    settings: Any


class NodeBackend(Protocol):
    """Where one node's agent lands the scheduler's orders and how it reports that tier.

    Keys are the scheduler's chunk keys (``tenant/session/position``); a backend that
    stores other names (LMCache's chunk hashes, SGLang's page objects) answers in these.
    """

    #: The node's local tier when the backend keeps one the engine maps (None otherwise).
    tier: LocalTier | None

    def start(self) -> None:
        """Open the tier or connect to the engine's server; raise a
        :class:`~kvprefetch.controlplane.base.errors.KvPrefetchError` subclass that names
        the mismatch when the engine's keys could never match ours. Called once."""
        ...

    def close(self) -> None:
        """Stop running orders and release the tier. Idempotent."""
        ...

    def describe(self) -> str:
        """Where orders land, for the agent's start-up log line."""
        ...

    def warm(self, order: TransferOrder) -> WarmHandleLike:
        """Start moving the order's chunks into the tier; returns at once."""
        ...

    def evict(self, prefixes: Sequence[str], keys: Sequence[str], guard: OrderGuard) -> int:
        """Evict advice: delete these keys and the sessions under these prefixes from the
        tier, leaving the keys of running orders; returns how many objects went."""
        ...

    def write(self, items: Sequence[tuple[str, bytes]]) -> int:
        """The engine's write-through of new KV; returns how many objects were stored (0
        where the engine stores through its own server)."""
        ...

    def trim(self, keys: Sequence[str], guard: OrderGuard) -> None:
        """Delete chunks a newer context superseded (a previous turn's partial last chunk),
        leaving the keys of running orders."""
        ...

    def listing(self) -> tuple[str, ...]:
        """Every chunk key the tier holds (or is believed to hold)."""
        ...

    def has(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in :meth:`listing`."""
        ...

    def holds(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held now: a key the tier evicted and that a newer write or
        warm brought back is held."""
        ...

    def stats(self) -> tuple[int, int, int]:
        """The tier's (used bytes, capacity bytes, keys held)."""
        ...

    def engine_ready(self) -> bool:
        """Whether the node's engine can take warm orders now (LMCache: an engine
        registered the model's KV layout with the node's server). The agent's actor says
        hello, and so joins the fleet, once it can: a node that joins while its engine
        still loads would fail its warm-up."""
        ...

    def events(self) -> object | None:
        """The engine's KV-event subscription counters, in the engine integration's own
        record (LMCache's :class:`~kvprefetch.agents.lmcache.kv_events.KVEventStats`);
        None where none is followed."""
        ...
