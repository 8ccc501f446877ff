"""Our tiered Valkey + S3 store as an LMCache L2 adapter (``--l2-adapter`` plugin).

LMCache's multiprocess server (and ``lmcache bench l2``) loads it from JSON::

    {"type": "plugin", "module_path": "kvprefetch.agents.lmcache.l2.adapter",
     "class_name": "KvPrefetchL2Adapter",
     "adapter_params": {"valkey": {"host": "10.0.0.5", "port": 6379},
                        "s3": {"bucket": "kv", "endpoint_url": "http://10.0.0.6:8333",
                               "access_key_id": "...", "secret_access_key": "..."}}}

:func:`plugin_adapter_json` builds (and validates) that JSON. ``adapter_params`` is
:class:`KvPrefetchL2Params`: a ``valkey`` section (:class:`ValkeyStoreConfig`), an ``s3``
section (:class:`S3StoreConfig`), or both (Valkey in front of S3, :class:`TieredStore`),
plus the key namespace, the worker threads and the capacity to report.

How LMCache drives an adapter (``lmcache.v1.distributed.l2_adapters.base``): the store
controller and the prefetch controller (two threads) submit store, lookup-and-lock, load,
unlock and delete calls; each ``submit_*`` must return at once with a task id; when a task
completes the adapter writes its result and then signals that operation's event fd (three
distinct fds, polled by the controllers); ``pop_completed_store_tasks`` answers per task,
``query_*_result`` answers once per task with a bitmap (bit i = key i hit / loaded).

Here every submitted task runs on one of ``workers`` threads (lookups on their own thread,
so they never queue behind loads and stores: :mod:`~kvprefetch.agents.lmcache.l2.tasks`)
and calls the batched store once for all of its keys; the store answers per key
(:mod:`~kvprefetch.agents.lmcache.l2.stores`).

Lookups (before every request's prefill) are answered from memory: a :class:`KeyIndex` of
what the tiers hold, kept on store, load and delete and reconciled with full listings of
S3 and Valkey in the background; keys it does not know are asked of Valkey in one
pipelined round trip for the whole task, never of S3. A stale "present" is safe: the load
falls back from Valkey to S3 and answers a miss for a key neither holds (dropping it from
the index).

Stores (after every request), with both tiers: write-back by default -- acknowledged once
Valkey holds the objects and the upload journal names them; a
:class:`~kvprefetch.agents.stores.write_back.WriteBackQueue` copies them to S3 in the background
(bounded backlog with back-pressure, journaled in Valkey so a restart finishes the uploads,
metrics in ``report_status``). ``"tiered": {"write_mode": "write-through"}`` waits for S3.

Loads are received straight into LMCache's memory objects: the Valkey tier reads each
stripe with ``recv_into`` into the object's memory
(:class:`~kvprefetch.agents.stores.valkey.store.ValkeyStore` with ``direct_reads``),
S3 ranged GETs the same way, so the kernel's copy is the only one; every part is verified
against its xxh3 checksum before the bit is set.

Object names: an :class:`ObjectKey` becomes ``<key_prefix><model>@<kv_rank:08x>@<group:x>@
<chunk hash hex>[@<cache salt>]`` -- the field layout LMCache's own remote adapters use, so
names read the same everywhere -- stored in Valkey under the Valkey section's prefix and in
S3 under the S3 section's. The prefix keeps our objects listable (``GET /cache/objects``,
:meth:`KvPrefetchL2Adapter.list_l2_keys`, :mod:`~kvprefetch.agents.lmcache.l2.listing`) and
deletable apart from anything else in the bucket or database. The parameters and the plugin
JSON live in :mod:`~kvprefetch.agents.lmcache.l2.params` (re-exported here).

This module imports LMCache (it is the edge that needs it); importing
:mod:`kvprefetch.agents.lmcache` does not.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

from kvprefetch.agents.lmcache.l2.listing import (
    SEP,
    key_page,
    list_entries,
    object_key_name,
    parse_object_key_name,
)
from kvprefetch.agents.lmcache.l2.params import (
    CLASS_NAME,
    DEFAULT_VALKEY_PART_BYTES,
    GIB,
    MODULE_PATH,
    VALKEY_DEFAULTS,
    KvPrefetchL2Params,
    load_params,
    plugin_adapter_json,
)
from kvprefetch.agents.lmcache.l2.stores import L2Stores, ObjectSink, bytes_of, check_lengths
from kvprefetch.agents.lmcache.l2.tasks import L2Tasks
from kvprefetch.agents.stores.base import Buffer, ObjectStore
from kvprefetch.agents.stores.errors import StoreError

log = logging.getLogger(__name__)


class KvPrefetchL2Adapter(L2AdapterInterface):
    """An LMCache L2 adapter over :class:`TieredStore` (or one of its tiers).

    Built by LMCache's plugin factory as ``KvPrefetchL2Adapter(adapter_params,
    l1_memory_desc=...)``. LMCache has no separate start call, so the constructor validates
    the parameters and connects (bad credentials or an unreachable single tier raise
    :class:`StoreConfigError` / :class:`StoreConnectionError` here, so that the server fails
    at start-up; with two tiers an unreachable one is skipped and retried later).

    Thread-safe: ``submit_*``, ``pop``/``query``, ``submit_unlock``, ``delete`` and
    ``list_l2_keys`` may be called from any thread. ``submit_*`` only enqueues; the
    controllers learn of completion through the event fds. The adapter keeps LMCache's
    bookkeeping (lock counts, stored sizes, the listener's notifications); the tiers are
    :class:`L2Stores`, the task protocol :class:`L2Tasks`.
    """

    def __init__(self, params: KvPrefetchL2Params | Mapping[str, Any] | None = None,
                 l1_memory_desc: Any = None) -> None:
        self.params = load_params(params)
        super().__init__(max_capacity_bytes=int(self.params.max_capacity_gb * GIB))
        p = self.params
        self._stores = L2Stores(p)
        self._lock = threading.Lock()
        self._locks: dict[ObjectKey, int] = defaultdict(int)
        #: Sizes of the keys this adapter stored (usage accounting, sizes for deletes).
        self._sizes: dict[ObjectKey, int] = {}
        self._tasks = L2Tasks(p.workers, self._stores.foreground)
        try:
            self._stores.start()
        except BaseException:
            self._release()
            raise
        log.info("kvprefetch L2 adapter ready: %s, prefix %r, %d workers", p.describe(),
                 p.key_prefix, p.workers)

    @property
    def store(self) -> ObjectStore:
        """The store behind the adapter: :class:`TieredStore`, or the one tier given."""
        return self._stores.store

    # -- names -------------------------------------------------------------------------------

    def name_of(self, key: ObjectKey) -> str:
        """The store key of an LMCache object key."""
        return self.params.key_prefix + object_key_name(key)

    # -- event fds ---------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._tasks.store_fd()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._tasks.lookup_fd()

    def get_load_event_fd(self) -> int:
        return self._tasks.load_fd()

    # -- store -------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        """Store each object under its key (one batched ``put``). Task-level result: success
        only if every key was stored; bytes = payload bytes of the keys stored.

        Write-back (the default with two tiers): done once Valkey holds the objects and the
        upload journal names them; S3 follows in the background. The task waits while the
        upload backlog is full (back-pressure) and fails if no room comes in time."""
        check_lengths(keys, objects)
        keys, objects = list(keys), list(objects)
        return self._tasks.submit(
            "store", lambda task_id: self._store(task_id, keys, objects),
            lambda task_id: self._tasks.publish_store(task_id, L2StoreResult(False, 0)))

    def _store(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        items: list[tuple[str, Buffer]] = [
            (self.name_of(k), bytes_of(o)) for k, o in zip(keys, objects, strict=True)]
        answers = self._stores.put(items)
        stored = [(k, len(item[1])) for k, item, a in zip(keys, items, answers, strict=True)
                  if a.ok]
        for a in answers:
            if not a.ok:
                log.warning("kvprefetch L2 store of %s failed: %s", a.key, a.error)
        new_keys, new_sizes = [], []
        with self._lock:
            for key, size in stored:
                if key not in self._sizes:
                    new_keys.append(key)
                    new_sizes.append(size)
                self._sizes[key] = size
        # Usage first: whoever sees the task complete sees the usage that includes it.
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)
        self._tasks.publish_store(task_id, L2StoreResult(len(stored) == len(keys),
                                                         sum(s for _, s in stored)))

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        return self._tasks.pop_stores()

    # -- lookup and lock ---------------------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: Mapping[int, Any] | None = None) -> int:
        """Which keys are stored (in any tier); the ones found are locked (a refcount that
        keeps :meth:`delete` away from them until :meth:`submit_unlock`). The layout hint is
        not needed: objects are opaque bytes here.

        Answered from the adapter's index of what the tiers hold; keys it does not know are
        asked of Valkey in one pipelined round trip for the whole task. Never S3 (objects
        only S3 holds are known from the index's listings) unless ``lookup_index`` is off.
        Runs on its own thread, so it never waits behind loads and stores."""
        keys = list(keys)
        return self._tasks.submit(
            "lookup", lambda task_id: self._lookup(task_id, keys),
            lambda task_id: self._tasks.publish_lookup(task_id, Bitmap(len(keys))),
            lookup=True)

    def _lookup(self, task_id: int, keys: list[ObjectKey]) -> None:
        hits = self._stores.lookup([self.name_of(k) for k in keys])
        bitmap = Bitmap(len(keys))
        locked = []
        with self._lock:
            for i, (key, hit) in enumerate(zip(keys, hits, strict=True)):
                if hit:
                    bitmap.set(i)
                    self._locks[key] += 1
                    locked.append(key)
        # The listener hears of the access before the controller of the result.
        if locked:
            self._notify_keys_accessed(locked)
        self._tasks.publish_lookup(task_id, bitmap)

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        return self._tasks.pop_lookup(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Drop one lock per key (synchronous: it only touches a counter, so it cannot fail)."""
        with self._lock:
            for key in keys:
                count = self._locks.get(key, 0)
                if count <= 1:
                    self._locks.pop(key, None)
                else:
                    self._locks[key] = count - 1

    # -- load --------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        """Load each key into its memory object (one batched ``get`` with a sink that hands
        the store the objects' memory). Bit i is set only when key i arrived whole and
        verified, with exactly the object's size."""
        check_lengths(keys, objects)
        keys, objects = list(keys), list(objects)
        return self._tasks.submit(
            "load", lambda task_id: self._load(task_id, keys, objects),
            lambda task_id: self._tasks.publish_load(task_id, Bitmap(len(keys))))

    def _load(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        names = [self.name_of(k) for k in keys]
        views = [bytes_of(o) for o in objects]
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        sink = ObjectSink({name: views[i] for name, i in first.items()})
        ok = self._stores.load(list(first), sink)
        bitmap = Bitmap(len(keys))
        loaded = []
        loaded_bytes = 0
        for i, name in enumerate(names):
            if name not in ok:
                continue
            j = first[name]
            if j != i:  # the same key twice in one task: copy the first one's bytes
                if len(views[i]) != len(views[j]):
                    continue
                views[i][:] = views[j]
            bitmap.set(i)
            loaded.append(keys[i])
            loaded_bytes += len(views[i])
        self._stores.pace(loaded_bytes)  # the emulated link: done when it would be
        # The listener hears of the access before the controller of the result.
        if loaded:
            self._notify_keys_accessed(loaded)
        self._tasks.publish_load(task_id, bitmap)

    def query_load_result(self, task_id: int) -> Bitmap | None:
        return self._tasks.pop_load(task_id)

    # -- delete, list, usage -----------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete keys from every tier (synchronous; called by LMCache's eviction and by
        ``DELETE /cache/objects``). Locked keys are skipped: a load may be reading them."""
        if self._tasks.closed:
            return
        with self._lock:
            deletable = [k for k in keys if self._locks.get(k, 0) == 0]
        if not deletable:
            return
        answers = self._stores.delete([self.name_of(k) for k in deletable])
        gone, sizes = [], []
        with self._lock:
            for key, a in zip(deletable, answers, strict=True):
                if a.error is not None:
                    log.warning("kvprefetch L2 delete of %s failed: %s", a.key, a.error)
                if a.ok:
                    gone.append(key)
                    sizes.append(self._sizes.pop(key, 0))
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:
        """List the LMCache objects in our namespace, a page at a time.

        From S3 when it is configured and up (the durable tier holds every object), then
        the write-back uploads not yet in S3; else from Valkey (standalone only). A listing
        begun in one tier continues there (the cursor says which). Sizes are payload bytes.
        ``cursor`` is the previous page's ``next_page_token``.
        """
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        prefix = self.params.key_prefix + (f"{model_name}{SEP}" if model_name else "")
        s = self._stores
        try:
            entries, token = list_entries(prefix, page_size, cursor, s3=s.s3, valkey=s.valkey,
                                          uploads=s.uploads, cold_up=s.tier_up("cold"))
        except StoreError as exc:
            raise RuntimeError(f"kvprefetch L2 adapter: listing failed: {exc}") from exc
        return key_page(entries, token, len(self.params.key_prefix))

    def report_status(self) -> dict[str, Any]:
        """Health and counters (LMCache shows it under the server's status)."""
        usage = self.get_usage()
        closed = self._tasks.closed
        tiers = self._stores.tiers(closed)
        with self._lock:
            locked = len(self._locks)
            known = len(self._sizes)
        return {
            "is_healthy": not closed and any(tiers.values()),
            "type": "kvprefetch",
            "tiers": tiers,
            "mode": self.params.describe(),
            "key_prefix": self.params.key_prefix,
            "workers": self.params.workers,
            "locked_keys": locked,
            "stored_keys": known,
            "current_size_bytes": usage.total_bytes_used,
            "max_capacity_bytes": usage.total_capacity_bytes,
            "usage_fraction": usage.usage_fraction,
            **self._stores.status(),
        }

    # -- the index's reconciliation and the write-back backlog --------------------------------

    def write_back_stats(self) -> Any:
        """The upload backlog (:class:`~kvprefetch.agents.stores.write_back.WriteBackStats`),
        or None when stores write through."""
        uploads = self._stores.uploads
        return uploads.stats() if uploads is not None else None

    def drain_uploads(self, timeout_s: float | None = None) -> bool:
        """Wait until every acknowledged store is in S3 (True at once without write-back)."""
        uploads = self._stores.uploads
        return uploads.drain(timeout_s) if uploads is not None else True

    def reconcile_index(self) -> bool:
        """List both tiers and make the index what they hold (what changed meanwhile is
        kept). False when a listing failed (the index is left as it was)."""
        return self._stores.reconcile_index()

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting tasks, finish the running ones (queued ones are dropped), close the
        stores (a write-back tier flushes first) and the event fds. Idempotent."""
        if not self._tasks.refuse():
            return
        self._stores.stop()
        self._tasks.finish()
        try:
            self._stores.close()
        finally:
            self._release()
        log.info("kvprefetch L2 adapter closed")

    def _release(self) -> None:
        self._stores.release()
        self._tasks.release()


__all__ = [
    "CLASS_NAME",
    "DEFAULT_VALKEY_PART_BYTES",
    "MODULE_PATH",
    "VALKEY_DEFAULTS",
    "KvPrefetchL2Adapter",
    "KvPrefetchL2Params",
    "load_params",
    "object_key_name",
    "parse_object_key_name",
    "plugin_adapter_json",
]
