"""The prefetch agent's ``lmcache-mp`` backend: orders run as warm prefetches of the node's
LMCache MP server (L2 -> L1), instead of copies into the project's own local tier.

An order names a session's chunks by position; LMCache names content by token ids. So per
order the backend reads the session's token ids from the remote store (written there by
whoever stored its KV: :mod:`kvprefetch.agents.lmcache.tokens`), cuts them to the order's token
count, and submits ``POST /cache/prefetches`` through
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
completed (for ``inventory``/``has``) and forgets a session on evict advice, while LMCache's
own L1 eviction may drop chunks sooner; the engine's lookup is the truth.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.lmcache.errors import LMCacheError
from kvprefetch.agents.lmcache.tokens import get_session_tokens, tokens_key
from kvprefetch.agents.lmcache.warm import LMCacheWarmClient, object_keys
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.transfer import TransferResult
from kvprefetch.controlplane.base.keys import tenant_cache_salt
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import TransferOrder

log = logging.getLogger(__name__)

#: Where a node's agent lands orders and its engine finds KV: the project's own DRAM/disk
#: tier, or the node's LMCache MP server.
Backend = Literal["local", "lmcache-mp"]


def require_backend_settings(backend: Backend, *, dram: object | None, lmcache: object | None,
                             dram_is: str, lmcache_is: str) -> None:
    """A config's cross-field rule: each backend needs its own section (pydantic
    validators call it; ``ValueError`` names the missing section)."""
    if backend == "local" and dram is None:
        raise ValueError(f"backend 'local' needs 'dram' ({dram_is})")
    if backend == "lmcache-mp" and lmcache is None:
        raise ValueError(f"backend 'lmcache-mp' needs 'lmcache' ({lmcache_is})")


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


@dataclass
class WarmHandle:
    """A submitted warm: the agent waits on it like on a transfer handle."""

    transfer_id: int
    future: Future[TransferResult]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self, reason: str = "cancelled") -> None:
        """LMCache cannot stop a submitted warm; a cancelled one is reported cancelled
        (what it loaded stays in L1 for LMCache's eviction to judge)."""
        self.cancelled.set()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout_s: float | None = None) -> TransferResult:
        return self.future.result(timeout_s)


class OrderPool:
    """What the warmers (LMCache's L1 here, SGLang's pages in :mod:`kvprefetch.agents.sglang.warm`)
    share: orders run on a pool of threads, one :class:`WarmHandle` each; a subclass
    implements :meth:`_run`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._ids = count(1)

    def _open_pool(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=self.name)

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _not_started(self) -> Exception:
        return StoreError(f"{self.name} is not started")

    def submit(self, order: TransferOrder) -> WarmHandle:
        if self._pool is None:
            raise self._not_started()
        tid = next(self._ids)
        handle = WarmHandle(tid, Future())
        handle.future = self._pool.submit(self._run, tid, order, handle.cancelled)
        return handle

    def _run(self, tid: int, order: TransferOrder, cancelled: threading.Event
             ) -> TransferResult:
        raise NotImplementedError


class LMCacheWarmer(OrderPool):
    """Runs transfer orders as LMCache warm prefetches (see the module docstring).

    ``store`` is the remote token store holding the sessions' token ids. Thread-safe.
    """

    def __init__(self, config: LMCacheBackendConfig, store: ObjectStore, *,
                 name: str = "lmcache") -> None:
        super().__init__(name)
        self.config = config
        self._store = store
        self._client = LMCacheWarmClient(config.http_url, config.http_timeout_s)
        self._lock = threading.Lock()
        #: "tenant/session" -> chunk keys of its last completed warm.
        self._warm: dict[str, tuple[str, ...]] = {}

    def start(self) -> LMCacheWarmer:
        cfg = self.config
        self._client.check_compatible(chunk_size=cfg.chunk_size,
                                      hash_algorithm=cfg.hash_algorithm,
                                      model_name=cfg.model_name, world_size=cfg.world_size)
        self._open_pool(cfg.max_in_flight)
        log.info("%s: warming LMCache at %s (model %s, chunk %d, %s)", self.name,
                 cfg.http_url, cfg.model_name, cfg.chunk_size, cfg.hash_algorithm)
        return self

    def close(self) -> None:
        self._close_pool()
        self._client.close()

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
        result = self._client.prefetch(cfg.model_name, cfg.world_size, tokens,
                                       cache_salt=tenant_cache_salt(tenant, cfg.cache_salt),
                                       timeout_s=cfg.warm_timeout_s)
        found = min(full, result.found_chunks)
        if found == full:
            with self._lock:
                self._warm[order.session_id] = order.keys
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
            with self._lock:
                self._warm.pop(SessionKey(tenant, session_id).wire, None)
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
        with self._lock:
            return tuple(k for keys in self._warm.values() for k in keys)

    def usage(self) -> tuple[int, int]:
        """L1's (used, total) bytes."""
        u = self._client.l1_usage()
        return u.used_bytes, u.total_bytes
