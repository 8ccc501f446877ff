"""The ``lmcache-mp`` backend's warmer: orders run as warm prefetches of the node's LMCache
MP server (L2 -> L1), instead of copies into the project's own local tier.

An order names a session's chunks by position; LMCache names content by token ids. So per
order the warmer reads the session's token ids from the remote store (written there by
whoever stored its KV: :mod:`kvprefetch.agents.backends.tokens`), cuts them to the order's
token count, and submits ``POST /cache/prefetches`` through
:class:`~kvprefetch.agents.lmcache.warm.LMCacheWarmClient`.
The result comes back as a :class:`~kvprefetch.agents.transfer.TransferResult` (one key per chunk:
found chunks moved, missing ones missed, a trailing partial chunk counted present because
LMCache never keys one), so the agent's order book, reports and metrics are the same for
both backends.

Start-up compares chunk size and hash algorithm with the server's ``/config``
(:class:`~kvprefetch.agents.lmcache.errors.LMCacheConfigMismatchError` names the field), so a node
whose keys could never match fails loudly instead of warming nothing.

Evict advice deletes the session's objects from L1 (``DELETE /cache/objects``); L2 keeps
them. What is warm is LMCache's to know: the backend remembers the chunks of the orders it
completed (:class:`~kvprefetch.agents.lmcache.l1_residency.L1Residency`, for
``inventory``/``has``) and forgets a session on evict advice. LMCache's own L1 eviction
drops chunks too: with ``kv_events`` on, the backend follows the server's KV events
(:class:`~kvprefetch.agents.lmcache.kv_events.KVEventSubscriber`) and hands the chunk keys
each removal takes out of a warmed session to ``on_evict``, the agent's report of the
tier's own evictions. After a gap in those events (lost records, a server restart) it
cannot tell which sessions L1 still holds: LMCache 0.5.6 lists L2 only (``GET
/cache/objects`` refuses ``tier=l1``) and its lookups load from L2 as they look, so every
session it believed warm is forgotten and reported, and the scheduler plans them again (a
warm of chunks L1 still holds loads nothing). Without the events the engine's lookup is the
only truth.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.backends.common import OrderPool
from kvprefetch.agents.backends.tokens import get_session_tokens, tokens_key
from kvprefetch.agents.lmcache.errors import (
    LMCacheConfigMismatchError,
    LMCacheError,
    LMCacheUnavailableError,
)
from kvprefetch.agents.lmcache.keys import LMCacheKeySettings, chunk_hashes
from kvprefetch.agents.lmcache.kv_events import (
    KVEventStats,
    KVEventSubscriber,
    ResyncReason,
    request_url,
)
from kvprefetch.agents.lmcache.l1_residency import MAX_CHUNKS, L1Residency, ResidencyStats
from kvprefetch.agents.lmcache.warm import LMCacheWarmClient, ServerSettings, object_keys
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.transfer import TransferResult
from kvprefetch.controlplane.base.keys import tenant_cache_salt
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import TransferOrder

log = logging.getLogger(__name__)

#: Whether the backend follows the server's KV events: see ``LMCacheBackendConfig.kv_events``.
KVEventsMode = Literal["auto", "required", "off"]
#: Called with chunk keys that left L1 by LMCache's own doing (the agent's eviction path).
EvictionCallback = Callable[[list[str]], None]


class LMCacheBackendConfig(BaseModel):
    """Where the node's LMCache MP server is and how its engine keys KV (must match the
    server: checked at start)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The server's HTTP API, e.g. ``http://127.0.0.1:8080``.
    http_url: str = Field(min_length=1)
    #: The model name the engine registered (vLLM: the served model's name or path).
    model_name: str = Field(min_length=1)
    world_size: int = Field(1, ge=1)
    chunk_size: int = Field(256, gt=0)
    hash_algorithm: str = "blake3"
    #: The base of the tenants' LMCache cache salts ("" = none): the default tenant's KV
    #: is keyed with it, every other tenant's with
    #: :func:`~kvprefetch.controlplane.base.keys.tenant_cache_salt` of it, which the engine's
    #: requests must carry as their ``cache_salt`` (the gateway sets it).
    cache_salt: str = ""
    #: Longest one warm may take before the order is reported failed (wall seconds).
    warm_timeout_s: float = Field(60.0, gt=0)
    #: Longest one HTTP call may take.
    http_timeout_s: float = Field(10.0, gt=0)
    #: Warm prefetches submitted at once.
    max_in_flight: int = Field(4, ge=1, le=64)
    #: Bytes of one chunk object of one rank (LMCache does not report sizes): for the
    #: bytes in reports; 0 = unknown.
    chunk_bytes: int = Field(0, ge=0)
    #: Follow the server's KV events, so that the chunks LMCache's L1 drops on its own
    #: (its eviction policy, a delete or clear by someone else) reach the scheduler as the
    #: tier's evictions: ``auto`` = when the server publishes them (else a warning at
    #: start), ``required`` = refuse to start unless it does, ``off`` = never (the
    #: scheduler's books then keep what L1 dropped until its own advice evicts it). The
    #: server publishes them unless started with ``--kv-event-log-size 0`` or
    #: ``--disable-observability``.
    kv_events: KVEventsMode = "auto"
    #: The server's request endpoint the events come from (``tcp://host:port``); "" = the
    #: one in its ``GET /config``, at ``http_url``'s host when it is bound to all addresses.
    request_url: str = ""
    #: (session, chunk) entries kept to tell which sessions a removed chunk belonged to;
    #: past it the sessions warmed longest ago are reported evicted.
    max_tracked_chunks: int = Field(MAX_CHUNKS, ge=1)


@dataclass(frozen=True)
class _EvictionFeed:
    """The :class:`~kvprefetch.agents.lmcache.kv_events.KVEventSink` of a warmer: LMCache's
    removals, as the warmed chunk keys they take out, to ``report``."""

    residency: L1Residency
    report: EvictionCallback
    name: str

    def removed(self, chunk_hashes: Sequence[bytes]) -> None:
        self.report(self.residency.removed(chunk_hashes))

    def resync(self, reason: ResyncReason) -> None:
        gone = self.residency.withdraw_all()
        if gone:
            log.warning("%s: %s: reporting the %d chunks believed warm as evicted (L1 "
                        "cannot be listed)", self.name, reason.replace("_", " "), len(gone))
        self.report(gone)


class LMCacheWarmer(OrderPool):
    """Runs transfer orders as LMCache warm prefetches (see the module docstring).

    ``store`` is the remote token store holding the sessions' token ids; ``on_evict`` is
    called with the chunk keys that left L1 by LMCache's own doing (from the event thread,
    and from the pool's threads for warms that a removal overtook). Thread-safe.
    """

    def __init__(self, config: LMCacheBackendConfig, store: ObjectStore, *,
                 name: str = "lmcache", on_evict: EvictionCallback | None = None) -> None:
        super().__init__(name)
        self.config = config
        self._store = store
        self._client = LMCacheWarmClient(config.http_url, config.http_timeout_s)
        self._on_evict = on_evict
        #: The sessions of completed warms, by chunk key and by LMCache chunk hash.
        self._residency = L1Residency(config.max_tracked_chunks)
        self._events: KVEventSubscriber | None = None

    def start(self) -> LMCacheWarmer:
        """Check the server's settings against ours and, with ``kv_events``, subscribe to
        its KV events before the first order runs.

        Raises:
            LMCacheConfigMismatchError: keys could not match, or ``kv_events: required``
                and the server publishes none.
            LMCacheUnavailableError: ``kv_events: required`` and no subscription within
                ``http_timeout_s``.
        """
        cfg = self.config
        settings = self._client.check_compatible(
            chunk_size=cfg.chunk_size, hash_algorithm=cfg.hash_algorithm,
            model_name=cfg.model_name, world_size=cfg.world_size)
        self._events = self._follow_events(settings)
        self._open_pool(cfg.max_in_flight)
        log.info("%s: warming LMCache at %s (model %s, chunk %d, %s, KV events %s)",
                 self.name, cfg.http_url, cfg.model_name, cfg.chunk_size, cfg.hash_algorithm,
                 self._events.url if self._events else "not followed")
        return self

    def close(self) -> None:
        self._close_pool()
        if self._events is not None:
            self._events.close()
            self._events = None
        self._client.close()

    def engine_ready(self) -> bool:
        """Whether an engine registered the model's KV layout (``model_name``,
        ``world_size``) with the server: until then every warm answers 503."""
        cfg = self.config
        return (cfg.model_name, cfg.world_size) in self._client.registered_layouts()

    def event_stats(self) -> KVEventStats | None:
        """The KV-event subscription's counters (None when not following)."""
        return self._events.stats() if self._events is not None else None

    def residency_stats(self) -> ResidencyStats:
        """What the backend believes warm, and what removals, gaps and the bound took."""
        return self._residency.stats()

    def _follow_events(self, settings: ServerSettings) -> KVEventSubscriber | None:
        cfg = self.config
        if cfg.kv_events == "off":
            return None
        enabled = self._client.kv_events_enabled()
        if not enabled:
            why = ("its LMCache has no KV-event channel" if enabled is None else
                   "it publishes no KV events (started with --kv-event-log-size 0 or "
                   "--disable-observability)")
            if cfg.kv_events == "required":
                raise LMCacheConfigMismatchError(
                    "kv_events.enabled", True, enabled, where=cfg.http_url,
                    hint=f"{why}; kv_events: required needs them")
            log.warning("%s: the LMCache server at %s: %s, so the scheduler will not learn "
                        "of L1's own evictions (kv_events: off silences this)", self.name,
                        cfg.http_url, why)
            return None
        url = cfg.request_url or request_url(settings.transport, settings.host,
                                             settings.port, cfg.http_url)
        feed = _EvictionFeed(self._residency, self._report_evicted, self.name)
        events = KVEventSubscriber(url, cfg.model_name, feed, timeout_s=cfg.http_timeout_s,
                                   name=f"{self.name}-events")
        if not events.start() and cfg.kv_events == "required":
            events.close()
            raise LMCacheUnavailableError(
                f"{self.name}: no KV events from {url} within {cfg.http_timeout_s:g} s "
                "(kv_events: required)")
        return events

    def _report_evicted(self, keys: list[str]) -> None:
        if keys and self._on_evict is not None:
            self._on_evict(keys)

    def _chunk_hashes(self, tokens: list[int]) -> list[bytes]:
        """LMCache's hashes of the complete chunks of ``tokens`` (what its removals name)."""
        cfg = self.config
        settings = LMCacheKeySettings(model_name=cfg.model_name, chunk_size=cfg.chunk_size,
                                      hash_algorithm=cfg.hash_algorithm,
                                      world_size=cfg.world_size)
        return [bytes.fromhex(h) for h in chunk_hashes(settings, tokens)]

    # ------------------------------------------------------------------ orders
    def _not_started(self) -> Exception:
        return LMCacheError(f"{self.name} is not started")

    def _run(self, tid: int, order: TransferOrder, cancelled: threading.Event
             ) -> TransferResult:
        cfg = self.config
        started = time.perf_counter()
        total = len(order.keys)
        key = SessionKey.parse(order.session_id)
        tenant, session_id = key.tenant, key.session_id
        try:
            tokens = get_session_tokens(self._store, tenant, session_id)
        except StoreError as exc:
            return self._result(tid, total, 0, 0, started, cancelled,
                                failed=((order.session_id, f"token ids: {exc}"),))
        if tokens is None:
            return self._result(tid, total, 0, 0, started, cancelled,
                                missed=(tokens_key(tenant, session_id),))
        tokens = tokens[:order.tokens]
        full = min(total, len(tokens) // cfg.chunk_size)
        since = self._residency.mark()
        result = self._client.prefetch(cfg.model_name, cfg.world_size, tokens,
                                       cache_salt=tenant_cache_salt(tenant, cfg.cache_salt),
                                       timeout_s=cfg.warm_timeout_s)
        found = min(full, result.found_chunks)
        if found == full:
            hashes = (self._chunk_hashes(tokens[:full * cfg.chunk_size])
                      if self._events is not None else [])
            self._report_evicted(self._residency.add(order.session_id, order.keys, hashes,
                                                     since=since))
        # Chunks LMCache never keys (a partial tail, tokens the store lacks) have nothing
        # to move: counted present.
        return self._result(tid, total, found, total - full, started, cancelled,
                            missed=tuple(order.keys[found:full]))

    def _result(self, tid: int, total: int, moved: int, present: int, started: float,
                cancelled: threading.Event, *, missed: tuple[str, ...] = (),
                failed: tuple[tuple[str, str], ...] = ()) -> TransferResult:
        n_failed = total - moved - present if failed else 0
        return TransferResult(
            transfer_id=tid, keys_total=total, keys_moved=moved, keys_present=present,
            keys_missed=total - moved - present - n_failed, keys_failed=n_failed,
            bytes_moved=moved * self.config.chunk_bytes * self.config.world_size,
            ttlb_s=time.perf_counter() - started, cancelled=cancelled.is_set(),
            missed=missed, failed=failed)

    # ------------------------------------------------------------------ the tier
    def evict_sessions(self, sessions: list[tuple[str, str]]) -> int:
        """Delete these (tenant, session id) sessions' chunks from L1; returns how many
        objects went."""
        cfg = self.config
        gone = 0
        for tenant, session_id in sessions:
            self._residency.forget(SessionKey(tenant, session_id).wire)
            tokens = get_session_tokens(self._store, tenant, session_id)
            if not tokens:
                continue
            keys = object_keys(tokens, model_name=cfg.model_name, world_size=cfg.world_size,
                               chunk_size=cfg.chunk_size, hash_algorithm=cfg.hash_algorithm,
                               cache_salt=tenant_cache_salt(tenant, cfg.cache_salt))
            if keys:
                gone += self._client.delete(keys, tier="l1").deleted
        return gone

    def warm_keys(self) -> tuple[str, ...]:
        """The chunk keys of completed warms that LMCache has not reported dropped."""
        return self._residency.keys()

    def holds(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is among :meth:`warm_keys`."""
        return self._residency.holds(keys)

    def usage(self) -> tuple[int, int]:
        """L1's (used, total) bytes."""
        u = self._client.l1_usage()
        return u.used_bytes, u.total_bytes
