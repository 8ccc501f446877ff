"""Our tiered Valkey + S3 store as an LMCache L2 adapter (``--l2-adapter`` plugin).

LMCache's multiprocess server (and ``lmcache bench l2``) loads it from JSON::

    {"type": "plugin", "module_path": "kvprefetch.agents.lmcache.l2_adapter",
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
so they never queue behind loads and stores) and calls the batched store once for all of
its keys; the store answers per key.

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
(:class:`~kvprefetch.agents.stores.valkey_store.ValkeyStore` with ``direct_reads``),
S3 ranged GETs the same way, so the kernel's copy is the only one; every part is verified
against its xxh3 checksum before the bit is set.

Object names: an :class:`ObjectKey` becomes ``<key_prefix><model>@<kv_rank:08x>@<group:x>@
<chunk hash hex>[@<cache salt>]`` -- the field layout LMCache's own remote adapters use, so
names read the same everywhere -- stored in Valkey under the Valkey section's prefix and in
S3 under the S3 section's. The prefix keeps our objects listable (``GET /cache/objects``,
:meth:`KvPrefetchL2Adapter.list_l2_keys`) and deletable apart from anything else in the
bucket or database.

This module imports LMCache (it is the edge that needs it); importing
:mod:`kvprefetch.agents.lmcache` does not.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict
from typing import Any, Final, Literal

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvprefetch.agents.lmcache.key_index import KeyIndex
from kvprefetch.agents.lmcache.keys import mp_wire_name
from kvprefetch.agents.stores.base import Buffer, GetResult, ObjectStore, OpResult, PayloadWriter
from kvprefetch.agents.stores.errors import StoreConfigError, StoreError, TierFullError
from kvprefetch.agents.stores.format import ObjectHeader, decode_header, header_length
from kvprefetch.agents.stores.s3_store import S3Store, S3StoreConfig, translate_boto_errors
from kvprefetch.agents.stores.tiered import TieredStore, TieredStoreConfig
from kvprefetch.agents.stores.valkey_store import (
    ValkeyStore,
    ValkeyStoreConfig,
    translate_valkey_errors,
)
from kvprefetch.agents.stores.write_back import WriteBackConfig, WriteBackQueue
from kvprefetch.agents.transfer import TokenBucket

log = logging.getLogger(__name__)

MIB: Final = 1 << 20
GIB: Final = 1 << 30
MODULE_PATH: Final = "kvprefetch.agents.lmcache.l2_adapter"
CLASS_NAME: Final = "KvPrefetchL2Adapter"
#: Valkey stripe size for LMCache chunks unless the ``valkey`` section sets ``part_bytes``.
#: A chunk larger than one stripe is fetched straight into the memory object, stripes in
#: parallel; one that fits a stripe travels inline with its header (one GET, one copy).
#: 1 MiB puts a 4 MiB chunk on the direct path (the store's own default, 4 MiB, is sized
#: for 32 MiB chunks).
DEFAULT_VALKEY_PART_BYTES: Final = 1 * MIB
#: The ``valkey`` section's defaults here, where it does not set them: the stripe above, and
#: each load batch's stripes read on the batch's own thread and connection (``get_lanes``
#: 1). The store's default hands each chunk to a pool thread and its stripes to more: 32 x
#: 4 MiB loads through LMCache's benchmark ran at 1,711 against 2,221 MiB/s median (6
#: interleaved runs each, one server), and in-process at 0.93-0.95 against 0.74-0.77 client
#: CPU seconds per GiB, Valkey's the same.
VALKEY_DEFAULTS: Final = {"part_bytes": DEFAULT_VALKEY_PART_BYTES, "get_lanes": 1}
_SEP: Final = "@"
_PREFIX_RE: Final = re.compile(r"[A-Za-z0-9._/:-]+")


# -- object names ---------------------------------------------------------------------------


def object_key_name(key: ObjectKey) -> str:
    """``<model>@<kv_rank:08x>@<object_group_id:x>@<chunk_hash hex>[@<cache_salt>]``.

    ``ObjectKey`` forbids ``@`` in the model name and the salt, so the name is unambiguous.
    """
    return mp_wire_name(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash,
                        key.cache_salt)


def parse_object_key_name(name: str) -> ObjectKey:
    """The inverse of :func:`object_key_name`; ``ValueError`` for anything else."""
    fields = name.split(_SEP)
    if len(fields) not in (4, 5):
        raise ValueError(f"not an LMCache object name: {name!r}")
    model, rank, group, chunk_hash = fields[:4]
    try:
        return ObjectKey(chunk_hash=bytes.fromhex(chunk_hash), model_name=model,
                         kv_rank=int(rank, 16), object_group_id=int(group, 16),
                         cache_salt=fields[4] if len(fields) == 5 else "")
    except ValueError as exc:
        raise ValueError(f"not an LMCache object name: {name!r}: {exc}") from None


# -- parameters -----------------------------------------------------------------------------


class KvPrefetchL2Params(BaseModel):
    """``adapter_params`` of the plugin JSON. At least one of ``valkey`` and ``s3``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The hot tier (see :class:`ValkeyStoreConfig`: host, port, password, tls, key_prefix,
    #: connections, part_bytes ...). ``part_bytes`` defaults to 1 MiB and ``get_lanes`` to 1
    #: here (:data:`VALKEY_DEFAULTS`).
    valkey: ValkeyStoreConfig | None = None
    #: The cold, durable tier (see :class:`S3StoreConfig`: bucket, endpoint_url, region,
    #: access_key_id, secret_access_key, key_prefix, connections ...).
    s3: S3StoreConfig | None = None
    #: How the two tiers cooperate when both are given: ``write_mode`` ``write-back`` (the
    #: default here: a store is acknowledged once Valkey has it, S3 follows through the
    #: ``write_back`` backlog) or ``write-through`` (S3, then Valkey, before the
    #: acknowledgement); promote, hot_ttl_s ...
    tiered: TieredStoreConfig = TieredStoreConfig(write_mode="write-back")
    #: The write-back backlog: bound (back-pressure), uploaders, journal, drain at close.
    write_back: WriteBackConfig = WriteBackConfig()
    #: Answer lookups from the in-memory index (keys it does not know: one pipelined Valkey
    #: round trip per task, never S3). False asks the stores on every lookup instead --
    #: Valkey, then one S3 HEAD per key Valkey lacks (tens of ms per 32-key task on
    #: loopback, added to the engine's time to first token) -- for deployments where other
    #: writers put objects into S3 alone and a lookup must see them before the next
    #: reconciliation.
    lookup_index: bool = True
    #: Keys the lookup index holds at most (least recently confirmed dropped beyond).
    index_max_keys: int = Field(2_000_000, ge=1)
    #: Reconcile the lookup index with full listings of S3 and Valkey this often (one at
    #: start, in the background); 0 = only the one at start.
    index_reconcile_s: float = Field(300.0, ge=0)
    #: Namespace of LMCache objects inside the stores (after each tier's own prefix).
    key_prefix: str = "lmcache/"
    #: Threads running submitted tasks (each task is one batched store call; the stores
    #: fan out across keys and stripes on their own bounded pools).
    workers: int = Field(4, ge=1, le=64)
    #: Keys per batched ``get`` when a load task is split (batches run side by side).
    load_batch_keys: int = Field(8, ge=1)
    #: Threads running the extra batches of load tasks.
    load_fanout_threads: int = Field(4, ge=1, le=64)
    #: Keys per batched Valkey ``put`` when a write-back store task is split (batches run
    #: side by side on the load fan-out threads, so one batch's checksums are computed while
    #: another's bytes are on the wire: checksums were ~40% of the submitting thread's
    #: samples in a 32 x 4 MiB store task, all before its first byte was sent); 0 = one
    #: ``put`` for the whole task.
    store_batch_keys: int = Field(8, ge=0)
    #: Capacity reported to LMCache; 0 = unknown (LMCache then never evicts from this L2
    #: by aggregate usage; Valkey's maxmemory policy and S3 lifecycle rules do).
    max_capacity_gb: float = Field(0.0, ge=0)
    #: Emulate the node's ingress link: loads complete no faster than this many MiB/s
    #: (one token bucket per adapter, i.e. per node); 0 = as fast as the stores answer.
    #: For CPU demos where the stores sit on loopback.
    load_bandwidth_mib_s: float = Field(0.0, ge=0)

    @field_validator("valkey", mode="before")
    @classmethod
    def _valkey_defaults(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {**VALKEY_DEFAULTS, **value}
        if isinstance(value, ValkeyStoreConfig):
            given = {name: getattr(value, name) for name in value.model_fields_set}
            return ValkeyStoreConfig(**{**VALKEY_DEFAULTS, **given})
        return value

    @field_validator("tiered", mode="before")
    @classmethod
    def _write_back_default(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and "write_mode" not in value:
            return {**value, "write_mode": "write-back"}
        return value

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not _PREFIX_RE.fullmatch(value):
            raise ValueError("must be non-empty and use only letters, digits and . _ / : -")
        return value

    @model_validator(mode="after")
    def _need_a_tier(self) -> KvPrefetchL2Params:
        if self.valkey is None and self.s3 is None:
            raise ValueError("give a 'valkey' section, an 's3' section, or both")
        return self

    def describe(self) -> str:
        tiers = [t for t, c in (("valkey", self.valkey), ("s3", self.s3)) if c is not None]
        mode = f" {self.tiered.write_mode}" if len(tiers) == 2 else ""
        return "+".join(tiers) + mode


def _error_text(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"adapter_params.{where}: {err['msg']}")
    return "; ".join(lines)


def load_params(params: KvPrefetchL2Params | Mapping[str, Any] | None) -> KvPrefetchL2Params:
    """Validate ``adapter_params``; :class:`StoreConfigError` names every bad field."""
    if isinstance(params, KvPrefetchL2Params):
        return params
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise StoreConfigError(
            f"adapter_params must be a JSON object, got {type(params).__name__}")
    try:
        return KvPrefetchL2Params.model_validate(dict(params))
    except ValidationError as exc:
        raise StoreConfigError(f"kvprefetch L2 adapter: {_error_text(exc)}") from None


def _plain(value: Any) -> Any:
    """JSON-ready values with secrets revealed (the plugin JSON must carry them)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        return _plain({name: getattr(value, name) for name in value.model_fields_set})
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def plugin_adapter_json(params: KvPrefetchL2Params | None = None, **fields: Any
                        ) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object that loads this adapter, e.g.
    ``plugin_adapter_json(valkey=valkey.store_config(), s3=s3.store_config())``.

    Validates first (a bad field raises :class:`StoreConfigError` here, not in LMCache).
    Only fields that were set are written; secrets are written in clear (it is a config).
    """
    if params is not None and fields:
        raise TypeError("give either params or fields, not both")
    checked = load_params(params if params is not None else fields)
    return {"type": "plugin", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "adapter_params": _plain(checked)}


# -- load sink ------------------------------------------------------------------------------


class _ObjectWriter:
    """Writes one payload into the memory of an LMCache memory object."""

    __slots__ = ("_view",)

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def write_at(self, offset: int, data: Buffer) -> None:
        n = len(data)
        self._view[offset : offset + n] = memoryview(data).cast("B")

    def target(self, offset: int, length: int) -> memoryview:
        return self._view[offset : offset + length]

    def written(self, offset: int, length: int) -> None:
        return None

    def commit(self) -> None:
        return None

    def abort(self) -> None:
        return None  # the load bit stays 0; LMCache ignores the buffer's content


class _ObjectSink:
    """Opens a writer on the memory object a key is loaded into; a stored object whose size
    differs from the destination is refused (a miss), before any byte is written."""

    def __init__(self, views: Mapping[str, memoryview]) -> None:
        self._views = views

    def open(self, header: ObjectHeader) -> PayloadWriter:
        view = self._views[header.key]
        if header.payload_bytes != len(view):
            raise StoreError(f"{header.key!r}: stored object has {header.payload_bytes} bytes, "
                             f"the memory object {len(view)}")
        return _ObjectWriter(view)


def _bytes_of(obj: Any) -> memoryview:
    """The logical bytes of a memory object, as a writable unsigned-byte view."""
    return memoryview(obj.byte_array).cast("B")


def _check_lengths(keys: Sequence[Any], objects: Sequence[Any]) -> None:
    """LMCache's convention (its adapters' tests look for the words "length mismatch")."""
    if len(keys) != len(objects):
        raise ValueError(f"length mismatch: {len(keys)} keys but {len(objects)} memory objects")


# -- the adapter ----------------------------------------------------------------------------


class KvPrefetchL2Adapter(L2AdapterInterface):
    """An LMCache L2 adapter over :class:`TieredStore` (or one of its tiers).

    Built by LMCache's plugin factory as ``KvPrefetchL2Adapter(adapter_params,
    l1_memory_desc=...)``. LMCache has no separate start call, so the constructor validates
    the parameters and connects (bad credentials or an unreachable single tier raise
    :class:`StoreConfigError` / :class:`StoreConnectionError` here, so that the server fails
    at start-up; with two tiers an unreachable one is skipped and retried later).

    Thread-safe: ``submit_*``, ``pop``/``query``, ``submit_unlock``, ``delete`` and
    ``list_l2_keys`` may be called from any thread. ``submit_*`` only enqueues; the
    controllers learn of completion through the event fds.
    """

    def __init__(self, params: KvPrefetchL2Params | Mapping[str, Any] | None = None,
                 l1_memory_desc: Any = None) -> None:
        self.params = load_params(params)
        super().__init__(max_capacity_bytes=int(self.params.max_capacity_gb * GIB))
        p = self.params
        self._valkey = ValkeyStore(p.valkey, name="valkey") if p.valkey else None
        self._s3 = S3Store(p.s3, name="s3") if p.s3 else None
        self.store: ObjectStore
        #: Write-back is ours (a bounded, journaled backlog read back from Valkey), so the
        #: tiered store only ever writes through (when Valkey is down, or as configured).
        self._uploads: WriteBackQueue | None = None
        if self._valkey is not None and self._s3 is not None:
            through = p.tiered.model_copy(update={"write_mode": "write-through"})
            self.store = TieredStore(self._valkey, self._s3, through, name="tiered")
            if p.tiered.write_mode == "write-back":
                self._uploads = WriteBackQueue(self._valkey, self._s3, p.write_back)
        else:
            only = self._valkey or self._s3
            assert only is not None
            self.store = only
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stores_done: dict[int, L2StoreResult] = {}
        self._lookups_done: dict[int, Bitmap] = {}
        self._loads_done: dict[int, Bitmap] = {}
        self._locks: dict[ObjectKey, int] = defaultdict(int)
        #: Sizes of the keys this adapter stored (usage accounting, sizes for deletes).
        self._sizes: dict[ObjectKey, int] = {}
        self._closed = False
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        self._pool = ThreadPoolExecutor(p.workers, thread_name_prefix="kvp-l2")
        #: Lookups never queue behind loads and stores (they gate every request's prefill).
        self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="kvp-l2-lookup")
        self._index = KeyIndex(p.index_max_keys)
        self._stop = threading.Event()
        self._reconciler: threading.Thread | None = None
        self._fanout = ThreadPoolExecutor(p.load_fanout_threads, thread_name_prefix="kvp-l2-get")
        self._link = (TokenBucket(p.load_bandwidth_mib_s * MIB, burst_bytes=64 * 1024)
                      if p.load_bandwidth_mib_s > 0 else None)
        try:
            self.store.start()
            if self._uploads is not None:
                self._uploads.start()  # re-queues what a previous process left journaled
        except BaseException:
            self._release()
            raise
        self._reconciler = threading.Thread(target=self._reconcile_loop, daemon=True,
                                            name="kvp-l2-index")
        self._reconciler.start()
        log.info("kvprefetch L2 adapter ready: %s, prefix %r, %d workers", p.describe(),
                 p.key_prefix, p.workers)

    # -- names -------------------------------------------------------------------------------

    def name_of(self, key: ObjectKey) -> str:
        """The store key of an LMCache object key."""
        return self.params.key_prefix + object_key_name(key)

    # -- event fds ---------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_fd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_fd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_fd.fileno())

    # -- task plumbing -----------------------------------------------------------------------

    def _submit(self, what: str, work: Callable[[int], None], fail: Callable[[int], None],
                pool: ThreadPoolExecutor | None = None) -> int:
        """Queue ``work(task_id)`` on a worker and return the id at once. If ``work`` raises,
        ``fail(task_id)`` publishes an all-failed result: the controller hears back about
        every task."""

        def guarded(task_id: int) -> None:
            try:
                if self._uploads is not None:
                    with self._uploads.foreground():  # S3 uploads yield meanwhile
                        work(task_id)
                else:
                    work(task_id)
            except Exception:
                log.exception("kvprefetch L2 %s task %d failed", what, task_id)
                fail(task_id)

        with self._lock:
            if self._closed:
                raise StoreError(f"kvprefetch L2 adapter is closed ({what} refused)")
            task_id = next(self._ids)
            (pool or self._pool).submit(guarded, task_id)
        return task_id

    def _publish_store(self, task_id: int, result: L2StoreResult) -> None:
        with self._lock:
            self._stores_done[task_id] = result
        self._store_fd.notify()

    def _publish_lookup(self, task_id: int, bitmap: Bitmap) -> None:
        with self._lock:
            self._lookups_done[task_id] = bitmap
        self._lookup_fd.notify()

    def _publish_load(self, task_id: int, bitmap: Bitmap) -> None:
        with self._lock:
            self._loads_done[task_id] = bitmap
        self._load_fd.notify()

    # -- store -------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        """Store each object under its key (one batched ``put``). Task-level result: success
        only if every key was stored; bytes = payload bytes of the keys stored.

        Write-back (the default with two tiers): done once Valkey holds the objects and the
        upload journal names them; S3 follows in the background. The task waits while the
        upload backlog is full (back-pressure) and fails if no room comes in time."""
        _check_lengths(keys, objects)
        keys, objects = list(keys), list(objects)
        return self._submit(
            "store", lambda task_id: self._store(task_id, keys, objects),
            lambda task_id: self._publish_store(task_id, L2StoreResult(False, 0)))

    def _store(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        items: list[tuple[str, Buffer]] = [
            (self.name_of(k), _bytes_of(o)) for k, o in zip(keys, objects, strict=True)]
        if self._uploads is not None and isinstance(self.store, TieredStore) \
                and self.store.tier_up("hot"):
            answers = self._store_write_back(self._uploads, items)
        else:
            answers = self.store.put(items)
        stored = [(k, len(item[1])) for k, item, a in zip(keys, items, answers, strict=True)
                  if a.ok]
        for a in answers:
            if not a.ok:
                log.warning("kvprefetch L2 store of %s failed: %s", a.key, a.error)
        self._index.add(a.key for a in answers if a.ok)
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
        self._publish_store(task_id, L2StoreResult(len(stored) == len(keys),
                                                   sum(s for _, s in stored)))

    def _store_write_back(self, uploads: WriteBackQueue, items: list[tuple[str, Buffer]]
                          ) -> list[OpResult]:
        """Valkey now (straight from LMCache's memory: the upload reads it back from Valkey,
        so nothing is copied), journaled for the upload to S3; keys Valkey refused are
        written through to S3 instead."""
        assert self._valkey is not None and self._s3 is not None
        total = sum(len(payload) for _, payload in items)
        if not uploads.admit(total):
            wb = self.params.write_back
            full = TierFullError(f"write-back backlog full ({wb.max_backlog_bytes} bytes) "
                                 f"for {wb.full_wait_s} s")
            return [OpResult(name, False, full) for name, _ in items]
        try:
            answers = self._put_hot(self._valkey, items)
            sizes = {name: len(payload) for name, payload in items}
            accepted = [(a.key, sizes[a.key]) for a in answers if a.ok]
            uploads.enqueue(accepted, reserved=total)
        except StoreError as exc:  # the journal is unwritable: not acknowledged
            uploads.release(total)
            log.warning("kvprefetch L2 write-back failed, writing through: %s", exc)
            return self._s3.put(items)
        except BaseException:
            uploads.release(total)
            raise
        refused = [i for i, a in enumerate(answers) if not a.ok]
        if refused:
            through = self._s3.put([items[i] for i in refused])
            for i, a in zip(refused, through, strict=True):
                answers[i] = a
        return answers

    def _put_hot(self, valkey: ValkeyStore, items: list[tuple[str, Buffer]]) -> list[OpResult]:
        """``valkey.put`` of a store task, in batches of ``store_batch_keys`` run side by
        side (this thread takes the first) when that is set."""
        ttl_s = self.params.tiered.hot_ttl_s
        size = self.params.store_batch_keys
        if size <= 0 or len(items) <= size:
            return valkey.put(items, ttl_s=ttl_s)
        batches = [items[i : i + size] for i in range(0, len(items), size)]
        futures = [self._fanout.submit(valkey.put, b, ttl_s=ttl_s) for b in batches[1:]]
        try:
            out = valkey.put(batches[0], ttl_s=ttl_s)
        finally:
            wait(futures)
        for f in futures:
            out += f.result()
        return out

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

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
        return self._submit(
            "lookup", lambda task_id: self._lookup(task_id, keys),
            lambda task_id: self._publish_lookup(task_id, Bitmap(len(keys))),
            self._lookup_pool)

    def _lookup(self, task_id: int, keys: list[ObjectKey]) -> None:
        names = [self.name_of(k) for k in keys]
        if not self.params.lookup_index:  # every tier asked, S3 included
            hits = [a.ok for a in self.store.exists(names)]
            self._index.add(n for n, hit in zip(names, hits, strict=True) if hit)
            unknown = []
        else:
            hits = self._index.present(names)
            unknown = [n for n, hit in zip(names, hits, strict=True) if not hit]
        if unknown and self._valkey is not None and self._tier_up("hot"):
            found = {a.key for a in self._valkey.exists(unknown) if a.ok}
            if found:
                self._index.add(found)
                hits = [hit or n in found for n, hit in zip(names, hits, strict=True)]
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
        self._publish_lookup(task_id, bitmap)

    def _tier_up(self, which: Literal["hot", "cold"]) -> bool:
        return self.store.tier_up(which) if isinstance(self.store, TieredStore) else True

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

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
        _check_lengths(keys, objects)
        keys, objects = list(keys), list(objects)
        return self._submit(
            "load", lambda task_id: self._load(task_id, keys, objects),
            lambda task_id: self._publish_load(task_id, Bitmap(len(keys))))

    def _load(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        names = [self.name_of(k) for k in keys]
        views = [_bytes_of(o) for o in objects]
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        sink = _ObjectSink({name: views[i] for name, i in first.items()})
        known = dict(zip(first, self._index.present(list(first)), strict=True))
        answers = self._fan_out(list(first), sink)
        ok = {a.key for a in answers if a.ok}
        self._index.add(ok)
        # A key the index called present that no tier has: a stale entry; the bit stays 0.
        self._index.discard((a.key for a in answers if a.miss and known[a.key]), stale=True)
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
        if self._link is not None and loaded_bytes:
            self._link.acquire(loaded_bytes)  # the emulated link: done when it would be
        # The listener hears of the access before the controller of the result.
        if loaded:
            self._notify_keys_accessed(loaded)
        self._publish_load(task_id, bitmap)

    def _fan_out(self, names: list[str], sink: _ObjectSink) -> list[GetResult]:
        """``store.get`` in batches of ``load_batch_keys`` run side by side (this thread
        takes the first): each batch's headers travel in their own pipelined round trip on
        their own connection, so small chunks (inline with their header) are not read one
        connection after another."""
        size = self.params.load_batch_keys
        batches = [names[i : i + size] for i in range(0, len(names), size)]
        if len(batches) == 1:
            return self.store.get(names, sink=sink)
        futures = [self._fanout.submit(self.store.get, b, sink=sink) for b in batches[1:]]
        try:
            out = self.store.get(batches[0], sink=sink)
        finally:
            wait(futures)  # no batch may write into the objects after the task completes
        for f in futures:
            out += f.result()
        return out

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    # -- delete, list, usage -----------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete keys from every tier (synchronous; called by LMCache's eviction and by
        ``DELETE /cache/objects``). Locked keys are skipped: a load may be reading them."""
        with self._lock:
            if self._closed:
                return
            deletable = [k for k in keys if self._locks.get(k, 0) == 0]
        if not deletable:
            return
        names = [self.name_of(k) for k in deletable]
        self._index.discard(names)
        if self._uploads is not None:
            self._uploads.forget(names)
        answers = self.store.delete(names)
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
        prefix = self.params.key_prefix + (f"{model_name}{_SEP}" if model_name else "")
        use_s3 = self._s3 is not None and (
            cursor.startswith("s3:") if cursor is not None
            else self._valkey is None or not isinstance(self.store, TieredStore)
            or self.store.tier_up("cold"))
        try:
            if cursor is not None and cursor.startswith("pending:") and self._uploads:
                entries, token = _page(self._uploads.pending_entries(prefix), cursor,
                                       page_size)
            elif use_s3:
                assert self._s3 is not None
                entries, token = _list_s3(self._s3, prefix, page_size, cursor)
                if token is None and self._uploads is not None:  # the rest of the page
                    more, token = _page(self._uploads.pending_entries(prefix), "pending:0",
                                        page_size - len(entries))
                    entries += more
            elif self._valkey is not None:
                entries, token = _list_valkey(self._valkey, prefix, page_size, cursor)
            else:
                raise ValueError(f"malformed cursor {cursor!r}")
        except StoreError as exc:
            raise RuntimeError(f"kvprefetch L2 adapter: listing failed: {exc}") from exc
        start = len(self.params.key_prefix)
        page = []
        for name, size in entries:
            try:
                key = parse_object_key_name(name[start:])
            except ValueError:
                continue  # not an LMCache object (something else under our prefix)
            page.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=size))
        return KeyListPage(entries=tuple(page), next_page_token=token)

    def report_status(self) -> dict[str, Any]:
        """Health and counters (LMCache shows it under the server's status)."""
        usage = self.get_usage()
        tiers: dict[str, bool] = {}
        if isinstance(self.store, TieredStore):
            tiers = {"valkey": self.store.tier_up("hot"), "s3": self.store.tier_up("cold")}
        else:
            tiers = {self.store.name: not self._closed}
        with self._lock:
            locked = len(self._locks)
            known = len(self._sizes)
        stats = getattr(self.store, "stats", None)
        return {
            "is_healthy": not self._closed and any(tiers.values()),
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
            "store_stats": asdict(stats()) if callable(stats) else {},
            "index": asdict(self._index.stats()),
            "write_back": asdict(self._uploads.stats()) if self._uploads is not None else {},
        }

    # -- the index's reconciliation and the write-back backlog --------------------------------

    def write_back_stats(self) -> Any:
        """The upload backlog (:class:`~kvprefetch.agents.stores.write_back.WriteBackStats`), or
        None
        when stores write through."""
        return self._uploads.stats() if self._uploads is not None else None

    def drain_uploads(self, timeout_s: float | None = None) -> bool:
        """Wait until every acknowledged store is in S3 (True at once without write-back)."""
        return self._uploads.drain(timeout_s) if self._uploads is not None else True

    def reconcile_index(self) -> bool:
        """List both tiers and make the index what they hold (what changed meanwhile is
        kept). False when a listing failed (the index is left as it was)."""
        token = self._index.begin_reconcile()
        try:
            names = self._listed_names()
        except (StoreError, NotImplementedError) as exc:
            self._index.abort_reconcile()
            log.warning("kvprefetch L2 index reconciliation skipped: %s", exc)
            return False
        self._index.finish_reconcile(token, names)
        return True

    def _listed_names(self) -> set[str]:
        prefix = self.params.key_prefix
        names: set[str] = set()
        if self._s3 is not None:
            cursor: str | None = None
            while True:
                entries, cursor = _list_s3(self._s3, prefix, 1000, cursor)
                names.update(n for n, _ in entries)
                if cursor is None:
                    break
        if self._valkey is not None and not self._valkey.config.cluster:
            names.update(_scan_valkey_names(self._valkey, prefix))
        elif self._valkey is not None and self._s3 is None:
            raise NotImplementedError("a Valkey cluster alone cannot be listed")
        if self._uploads is not None:  # in Valkey, not yet in S3 (and a cluster is unlisted)
            names.update(self._uploads.pending_names())
        return names

    def _reconcile_loop(self) -> None:
        interval = self.params.index_reconcile_s
        wait_s = 0.0
        while not self._stop.wait(wait_s):
            try:
                self.reconcile_index()
            except Exception:  # keep the loop alive: log and try again next time
                log.exception("kvprefetch L2 index reconciliation failed")
            if interval <= 0:
                return
            wait_s = interval

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting tasks, finish the running ones (queued ones are dropped), close the
        stores (a write-back tier flushes first) and the event fds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._lookup_pool.shutdown(wait=True, cancel_futures=True)
        self._fanout.shutdown(wait=True, cancel_futures=True)
        if self._reconciler is not None:
            self._reconciler.join()
        try:
            if self._uploads is not None:
                self._uploads.close()  # drains for up to close_drain_s; the rest journaled
            self.store.close()
        finally:
            self._release()
        log.info("kvprefetch L2 adapter closed")

    def _release(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._fanout.shutdown(wait=False, cancel_futures=True)
        for fd in (self._store_fd, self._lookup_fd, self._load_fd):
            fd.close()


# -- listing helpers ------------------------------------------------------------------------


def _payload_bytes(total: int, name: str, part_bytes: int) -> int:
    """Payload bytes of an S3 object of ``total`` bytes stored under ``name`` (its header:
    24-byte prefix, key, 8 bytes per part, 8-byte digest), assuming the configured part size;
    the object size when that does not add up (written with another part size)."""
    rest = total - 32 - len(name.encode("utf-8"))
    guess = max(0, rest // (part_bytes + 8))
    for parts in (guess, guess + 1, guess + 2):
        payload = rest - 8 * parts
        if payload >= 0 and -(-payload // part_bytes) == parts:
            return payload
    return total


def _list_s3(store: S3Store, prefix: str, page_size: int, cursor: str | None
             ) -> tuple[list[tuple[str, int]], str | None]:
    c = store.config
    kwargs: dict[str, Any] = {"Bucket": c.bucket, "Prefix": c.key_prefix + prefix,
                              "MaxKeys": min(page_size, 1000)}
    if cursor is not None:
        if not cursor.startswith("s3:") or len(cursor) < 4:
            raise ValueError(f"malformed cursor {cursor!r}")
        kwargs["ContinuationToken"] = cursor[3:]
    with translate_boto_errors("list"):
        resp = store.client.list_objects_v2(**kwargs)
    skip = len(c.key_prefix)
    entries = []
    for item in resp.get("Contents", []):
        name = str(item["Key"])[skip:]
        entries.append((name, _payload_bytes(int(item.get("Size", 0)), name, c.part_bytes)))
    token = resp.get("NextContinuationToken") if resp.get("IsTruncated") else None
    return entries, f"s3:{token}" if token else None


def _page(entries: list[tuple[str, int]], cursor: str, page_size: int
          ) -> tuple[list[tuple[str, int]], str | None]:
    """One page of a sorted in-memory listing; the cursor is ``pending:<offset>``."""
    m = re.fullmatch(r"pending:(\d+)", cursor)
    if m is None:
        raise ValueError(f"malformed cursor {cursor!r}")
    start = int(m.group(1))
    end = start + max(0, page_size)
    return entries[start:end], (f"pending:{end}" if end < len(entries) else None)


def _scan_valkey_names(store: ValkeyStore, prefix: str) -> list[str]:
    """Every object name under ``prefix`` in a standalone Valkey (SCAN over heads)."""
    head = store.head_key("")
    with translate_valkey_errors("list"):
        raw = store.client.scan_iter(match=_glob_escape(head + prefix) + "*", count=1000)
        return [(b.decode() if isinstance(b, bytes) else str(b))[len(head):] for b in raw]


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _list_valkey(store: ValkeyStore, prefix: str, page_size: int, cursor: str | None
                 ) -> tuple[list[tuple[str, int]], str | None]:
    """SCAN over object heads. The cursor is ``valkey:<scan cursor>:<entries to skip>``, so a
    page never holds more than ``page_size`` entries even when one SCAN step returns more."""
    if store.config.cluster:
        raise NotImplementedError("listing a Valkey cluster is not supported; add an s3 tier")
    scan, skip = 0, 0
    if cursor is not None:
        m = re.fullmatch(r"valkey:(\d+):(\d+)", cursor)
        if m is None:
            raise ValueError(f"malformed cursor {cursor!r}")
        scan, skip = int(m.group(1)), int(m.group(2))
    head = store.head_key("")
    match = _glob_escape(head + prefix) + "*"
    names: list[str] = []
    token: str | None = None
    with translate_valkey_errors("list"):
        while True:
            nxt, batch = store.client.scan(cursor=scan, match=match, count=max(page_size, 100))
            batch = [b.decode() if isinstance(b, bytes) else str(b) for b in batch][skip:]
            room = page_size - len(names)
            if len(batch) > room:
                names += batch[:room]
                token = f"valkey:{scan}:{skip + room}"
                break
            names += batch
            skip = 0
            scan = int(nxt)
            if scan == 0:
                break
            if len(names) == page_size:
                token = f"valkey:{scan}:0"
                break
        sizes = _valkey_payload_sizes(store, names)
    return [(n[len(head):], s) for n, s in zip(names, sizes, strict=True)], token


def _valkey_payload_sizes(store: ValkeyStore, heads: Sequence[str]) -> list[int]:
    """Payload bytes from each head's header (two pipelined round trips at most)."""
    pipe = store.client.pipeline(transaction=False)
    for h in heads:
        pipe.getrange(h, 0, 4095)
    firsts = pipe.execute()
    out: list[int] = [0] * len(heads)
    again: list[tuple[int, int]] = []
    for i, raw in enumerate(firsts):
        try:
            need = header_length(raw)
            if need > len(raw):
                again.append((i, need))
            else:
                out[i] = decode_header(raw).payload_bytes
        except StoreError:
            continue  # corrupt or vanished: listed with size 0
    if again:
        pipe = store.client.pipeline(transaction=False)
        for i, need in again:
            pipe.getrange(heads[i], 0, need - 1)
        for (i, _), raw in zip(again, pipe.execute(), strict=True):
            try:
                out[i] = decode_header(raw).payload_bytes
            except StoreError:
                continue
    return out


__all__ = [
    "KvPrefetchL2Adapter",
    "KvPrefetchL2Params",
    "load_params",
    "object_key_name",
    "parse_object_key_name",
    "plugin_adapter_json",
]
