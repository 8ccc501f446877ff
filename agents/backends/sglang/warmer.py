"""The ``sglang`` backend's warmer: orders warm the node-local DRAM tier that kvprefetch's
SGLang HiCache storage backend (:mod:`kvprefetch.agents.sglang.backend`) reads first, with
SGLang's own page objects.

An order names a session's chunks by position; SGLang names pages by a hash chain over
token ids. So per order the warmer reads the session's token ids from the remote store
(written by whoever stores the session's KV: :mod:`kvprefetch.agents.backends.tokens`), cuts them to
the order's token count, computes the object names of every full page for every TP rank
(:class:`~kvprefetch.agents.sglang.keys.PageKeyScheme`), and copies those objects from the remote
store into the tier with the agent's transfer engine (checksummed, atomic publish). The
result is reported in the order's own keys (pages moved, present, missed, failed in
proportion), so the scheduler's books are those of the other backends; ``bytes_moved`` is
the pages' real bytes.

Evict advice deletes the session's pages from the tier (the remote store keeps them). The
warmer remembers each session's pages from its last warm (bounded), so it can evict
without the token ids.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.backends.common import OrderPool
from kvprefetch.agents.backends.tokens import get_session_tokens, tokens_key
from kvprefetch.agents.sglang.keys import PageKeyScheme
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.stores.local import LocalTier
from kvprefetch.agents.transfer import TransferEngine, TransferResult
from kvprefetch.controlplane.base.keys import tenant_cache_salt
from kvprefetch.controlplane.base.types import DEFAULT_TENANT, SessionKey
from kvprefetch.controlplane.base.wire import TransferOrder

log = logging.getLogger(__name__)
#: Sessions whose page names are remembered for evict advice (oldest forgotten first).
SESSION_MEMORY = 10_000


class SGLangWarmConfig(BaseModel):
    """How the node's SGLang names its pages (must match its server arguments)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: SGLang's ``--model-path`` (or served model name), as its storage config has it.
    model_name: str = Field(min_length=1)
    #: SGLang's ``--page-size`` (tokens per page).
    page_size: int = Field(64, gt=0)
    tp_size: int = Field(1, ge=1)
    #: MLA models keep one object per page for all TP ranks.
    is_mla: bool = False
    #: Warms running at once.
    max_in_flight: int = Field(4, ge=1, le=64)
    #: The base of the tenants' cache salts (SGLang's per-request ``cache_salt``; "" =
    #: none): the default tenant's pages are named with it (none: as SGLang names a
    #: request without a salt), every other tenant's with
    #: :func:`~kvprefetch.controlplane.base.keys.tenant_cache_salt` of it, which the tenant's SGLang
    #: requests must carry.
    cache_salt: str = ""


class SGLangWarmer(OrderPool):
    """Runs transfer orders as copies of SGLang page objects into the node's tier."""

    def __init__(self, config: SGLangWarmConfig, store: ObjectStore, tier: LocalTier,
                 engine: TransferEngine, *, name: str = "sglang") -> None:
        super().__init__(name)
        self.config = config
        self._store = store
        self._tier = tier
        self._engine = engine
        self._schemes = [PageKeyScheme(config.model_name, tp_rank=0, tp_size=config.tp_size,
                                       is_mla=True)] if config.is_mla else [
            PageKeyScheme(config.model_name, tp_rank=r, tp_size=config.tp_size)
            for r in range(config.tp_size)]
        self._lock = threading.Lock()
        #: "tenant/session" -> page object names of its last warm.
        self._warm: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    def start(self) -> SGLangWarmer:
        self._open_pool(self.config.max_in_flight)
        return self

    def close(self) -> None:
        self._close_pool()

    def page_names(self, token_ids: list[int], tenant: str = DEFAULT_TENANT) -> list[str]:
        """Every rank's objects for the full pages of ``token_ids`` of ``tenant``'s, page by
        page (named under the tenant's cache salt)."""
        salt = tenant_cache_salt(tenant, self.config.cache_salt) or None
        per_rank = [s.object_names(token_ids, self.config.page_size, cache_salt=salt)
                    for s in self._schemes]
        return [name for page in zip(*per_rank, strict=True) for name in page]

    def _run(self, tid: int, order: TransferOrder, cancelled: threading.Event
             ) -> TransferResult:
        started = time.perf_counter()
        total = len(order.keys)
        key = SessionKey.parse(order.session_id)
        try:
            tokens = get_session_tokens(self._store, key.tenant, key.session_id)
        except StoreError as exc:
            return _result(tid, total, started, cancelled,
                           failed=((order.session_id, f"token ids: {exc}"),))
        if tokens is None:
            return _result(tid, total, started, cancelled,
                           missed=(tokens_key(key.tenant, key.session_id),))
        names = self.page_names(tokens[: order.tokens], key.tenant)
        if not names:  # shorter than a page: SGLang stores nothing to warm
            return _result(tid, total, started, cancelled, present=total)
        handle = self._engine.submit(names, priority=order.priority)
        if cancelled.is_set():
            handle.cancel("cancelled by the scheduler")
        r = handle.result()
        with self._lock:
            self._warm[order.session_id] = tuple(names)
            self._warm.move_to_end(order.session_id)
            while len(self._warm) > SESSION_MEMORY:
                self._warm.popitem(last=False)
        # Pages -> the order's keys, in proportion (the scheduler books order keys).
        moved = total * r.keys_moved // len(names)
        present = total * r.keys_present // len(names)
        failed = total * r.keys_failed // len(names)
        if r.keys_moved + r.keys_present == len(names):
            present = total - moved
        return TransferResult(
            transfer_id=tid, keys_total=total, keys_moved=moved, keys_present=present,
            keys_missed=total - moved - present - failed, keys_failed=failed,
            bytes_moved=r.bytes_moved, ttlb_s=time.perf_counter() - started,
            cancelled=r.cancelled or cancelled.is_set(), missed=r.missed, failed=r.failed)

    def evict_sessions(self, sessions: list[tuple[str, str]]) -> int:
        """Delete these (tenant, session id) sessions' pages from the tier; returns how
        many objects went."""
        gone = 0
        for tenant, session_id in sessions:
            with self._lock:
                names = self._warm.pop(SessionKey(tenant, session_id).wire, ())
            if names:
                gone += sum(1 for r in self._tier.delete(list(names)) if r.ok)
        return gone

    def warm_keys(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(k for names in self._warm.values() for k in names)

    def usage(self) -> tuple[int, int]:
        return self._tier.used_bytes, self._tier.capacity_bytes


def _result(tid: int, total: int, started: float, cancelled: threading.Event, *,
            present: int = 0, missed: tuple[str, ...] = (),
            failed: tuple[tuple[str, str], ...] = ()) -> TransferResult:
    n_failed = total - present if failed else 0
    return TransferResult(
        transfer_id=tid, keys_total=total, keys_moved=0, keys_present=present,
        keys_missed=total - present - n_failed, keys_failed=n_failed, bytes_moved=0,
        ttlb_s=time.perf_counter() - started, cancelled=cancelled.is_set(), missed=missed,
        failed=failed)
