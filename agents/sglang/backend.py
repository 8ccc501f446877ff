"""kvprefetch as an SGLang HiCache L3 storage backend (``HiCacheStorage``).

Load it into SGLang with its dynamic backend (``--hicache-storage-backend dynamic``)::

    --hicache-storage-backend-extra-config '{"backend_name": "kvprefetch",
        "module_path": "kvprefetch.agents.sglang.backend", "class_name": "KvPrefetchHiCacheStorage",
        "interface_v1": 1,
        "kvprefetch": {"local": {"path": "/dev/shm/kvp-node", "capacity_bytes": 68719476736},
                       "remote": {"valkey": {"host": "10.0.0.5"},
                                  "s3": {"bucket": "kv", "region": "us-east-1"}}}}'

Who calls what (SGLang's cache controller, from its prefetch and backup threads): per
request on arrival ``batch_exists`` (up to 128 page hashes per call, answer: how many
consecutive pages from the first are present), then ``batch_get_v1`` (``interface_v1``) or
``batch_get`` for those pages; per finished request ``batch_set_v1``/``batch_set`` for the
pages it wrote back. Keys are SGLang's page hashes (:mod:`kvprefetch.agents.sglang.keys`); objects
are named by :class:`~kvprefetch.agents.sglang.keys.PageKeyScheme` from the storage config (model,
ranks).

Reads: the node-local DRAM tier the agent warms first (a file per object, opened by name:
:class:`~kvprefetch.agents.sglang.node_tier.NodeTierReader`: one copy into the destination, hashed
chunk by chunk from cache, a batch's pages on ``local_read_threads`` threads), then the
remote store (Valkey, then S3, S3 hits promoted into Valkey). Every object is checksummed
(:mod:`kvprefetch.agents.stores.format`) and verified part by part as it lands; a local object that
fails its checksum is read from the remote store instead (counted as ``local_bad``). With
``interface_v1`` and a page-first host layout the payload lands straight in SGLang's host
pool (each page is its K and V regions, in the order of the pool's flat data page); other
layouts go through one flat page and a copy.
``batch_exists`` answers from the local tier's files first and asks the remote store only
about the pages after the local prefix.
Per-page counters (:meth:`KvPrefetchHiCacheStorage.counters`: local tier, Valkey, S3,
missed) are also published to files with ``stats_dir`` (:mod:`kvprefetch.agents.sglang.stats`), for
a process outside SGLang's.

Writes go to the remote store with the tiered store's write policy
(:class:`~kvprefetch.agents.stores.tiered.TieredStoreConfig`: write-through or write-back); never to
the local tier, which is the agent's to fill and evict. SGLang's factory gives a backend
no start hook, so the constructor connects (the one exception to "constructors do no
I/O"); :meth:`KvPrefetchHiCacheStorage.close` disconnects.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.sglang.keys import PageKeyScheme
from kvprefetch.agents.sglang.node_tier import NodeTierReader, TierRead
from kvprefetch.agents.sglang.stats import COUNTERS, StatsPublisher
from kvprefetch.agents.stores.base import Buffer, ObjectStore
from kvprefetch.agents.stores.errors import StoreError
from kvprefetch.agents.stores.format import ObjectHeader
from kvprefetch.agents.stores.local import LocalTierConfig

log = logging.getLogger(__name__)

#: Host layouts whose pages are two contiguous regions (K, V): received in place.
_DIRECT_LAYOUTS = ("page_first", "page_first_direct")


class SGLangStorageConfig(BaseModel):
    """The ``kvprefetch`` section of SGLang's ``--hicache-storage-backend-extra-config``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The node-local tier the agent warms (same ``path`` as the agent's ``dram``); None:
    #: remote store only.
    local: LocalTierConfig | None = None
    #: Threads that copy and verify one batch's pages from the local tier at once (the
    #: calling thread is one of them).
    local_read_threads: int = Field(4, ge=1, le=64)
    remote: RemoteStoreConfig
    #: A directory where each rank publishes its counters for other processes (one JSON
    #: file per rank, :mod:`kvprefetch.agents.sglang.stats`); None: not published.
    stats_dir: str | None = None


class _SegmentWriter:
    """Writes one object's payload into a list of memory segments (in payload order)."""

    def __init__(self, segments: Sequence[memoryview]) -> None:
        self._segments = segments
        self._starts: list[int] = []
        offset = 0
        for seg in segments:
            self._starts.append(offset)
            offset += len(seg)
        self.ok = False

    def _locate(self, offset: int) -> int:
        i = len(self._starts) - 1
        while self._starts[i] > offset:
            i -= 1
        return i

    def write_at(self, offset: int, data: Buffer) -> None:
        src = memoryview(data).cast("B")
        done = 0
        while done < len(src):
            i = self._locate(offset + done)
            seg = self._segments[i]
            at = offset + done - self._starts[i]
            n = min(len(seg) - at, len(src) - done)
            seg[at : at + n] = src[done : done + n]
            done += n

    def target(self, offset: int, length: int) -> memoryview | None:
        i = self._locate(offset)
        at = offset - self._starts[i]
        seg = self._segments[i]
        return seg[at : at + length] if at + length <= len(seg) else None

    def written(self, offset: int, length: int) -> None:
        return None

    def commit(self) -> None:
        self.ok = True

    def abort(self) -> None:
        self.ok = False


class _PageSink:
    """Opens a :class:`_SegmentWriter` per key onto that key's destination pages."""

    def __init__(self, destinations: dict[str, Sequence[memoryview]]) -> None:
        self._destinations = destinations
        self.writers: dict[str, _SegmentWriter] = {}

    def open(self, header: ObjectHeader) -> _SegmentWriter:
        segments = self._destinations.get(header.key)
        if segments is None:
            raise StoreError(f"{header.key!r}: not asked for")
        expected = sum(len(s) for s in segments)
        if header.payload_bytes != expected:
            raise StoreError(f"{header.key!r}: object of {header.payload_bytes} bytes, the "
                             f"page holds {expected} (another model or layout?)")
        writer = _SegmentWriter(segments)
        self.writers[header.key] = writer
        return writer


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise StoreError("destination pages must be contiguous host tensors")
    array: Any = tensor.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _address_bytes(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


class KvPrefetchHiCacheStorage(HiCacheStorage):
    """See the module docstring. Thread-safe: SGLang's prefetch and backup threads call
    it at once."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None, *,
                 store: ObjectStore | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = SGLangStorageConfig.model_validate(extra.get("kvprefetch") or {})
        self.storage_config = storage_config
        self.scheme = PageKeyScheme.from_storage_config(storage_config)
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.local = (NodeTierReader(self.config.local,
                                     read_threads=self.config.local_read_threads)
                      if self.config.local else None)
        self.store = store if store is not None else self.config.remote.build()
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._stats = (StatsPublisher(self.config.stats_dir, self.scheme)
                       if self.config.stats_dir else None)
        self.store.start()
        self._count()  # publishes the (zero) counters and the model name SGLang gave us
        log.info("kvprefetch HiCache storage: rank suffix %s, local tier %s",
                 self.scheme.suffix, self.config.local.path if self.config.local else None)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        self.store.close()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counts[k] += v
            if self._stats is not None:
                self._stats.publish(self.counts)

    def counters(self) -> dict[str, int]:
        """Pages served from the local tier, from the remote store (``remote_hits``, of
        them ``valkey_hits`` and ``s3_hits``), missed, damaged locally, written."""
        with self._lock:
            return dict(self.counts)

    def get_stats(self) -> None:
        """SGLang's metrics hook: with ``--enable-metrics`` its cache calls this every
        scheduler step and expects its own ``StorageMetrics`` or None
        (``sglang/srt/mem_cache/unified_radix_cache.py``); our counters are
        :meth:`counters`."""
        return None

    # ------------------------------------------------------------------ reads
    def _read(self, destinations: dict[str, Sequence[memoryview]]) -> dict[str, bool]:
        """Fill each object's destination: local tier first, then the remote store."""
        done: dict[str, bool] = dict.fromkeys(destinations, False)
        rest = list(destinations)
        if self.local is not None:
            reads = self.local.read_batch(list(destinations.items()))
            for name, outcome in zip(destinations, reads, strict=True):
                done[name] = outcome is TierRead.HIT
            rest = [n for n in destinations if not done[n]]
            self._count(local_hits=len(destinations) - len(rest),
                        local_bad=sum(r is TierRead.BAD for r in reads))
        if rest:
            sink = _PageSink({n: destinations[n] for n in rest})
            sources: list[str] = []
            for r in self.store.get(rest, sink=sink):
                writer = sink.writers.get(r.key)
                done[r.key] = r.ok and writer is not None and writer.ok
                if done[r.key]:
                    sources.append(r.source)
            self._count(remote_hits=len(sources), misses=len(rest) - len(sources),
                        valkey_hits=sources.count("valkey"), s3_hits=sources.count("s3"))
        return done

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        [page] = self.batch_get([key], [target_location])
        return page

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Into the given flat host pages (SGLang's generic path)."""
        if target_locations is None:
            raise StoreError("batch_get needs destination pages")
        names = [self.scheme.object_name(k) for k in keys]
        done = self._read({n: [_tensor_bytes(t)] for n, t in zip(names, target_locations,
                                                                  strict=True)})
        return [t if done[n] else None for n, t in zip(names, target_locations, strict=True)]

    def _page_segments(self, host_indices: torch.Tensor, pages: int
                       ) -> list[list[memoryview]]:
        pool = self.mem_pool_host
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        per_page = len(ptrs) // pages
        return [[_address_bytes(int(p), int(s))
                 for p, s in zip(ptrs[i * per_page:(i + 1) * per_page],
                                 sizes[i * per_page:(i + 1) * per_page], strict=True)]
                for i in range(pages)]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Into SGLang's host pool at ``host_indices`` (page_size indices per key)."""
        pool = self.mem_pool_host
        if pool is None:
            raise StoreError("batch_get_v1 before register_mem_pool_host")
        names = [self.scheme.object_name(k) for k in keys]
        if pool.layout in _DIRECT_LAYOUTS:
            segments = self._page_segments(host_indices, len(keys))
            done = self._read(dict(zip(names, segments, strict=True)))
            return [done[n] for n in names]
        flats = [pool.get_dummy_flat_data_page() for _ in keys]
        done = self._read({n: [_tensor_bytes(f)] for n, f in zip(names, flats, strict=True)})
        out = []
        for i, n in enumerate(names):
            if done[n]:
                pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]), flats[i])
            out.append(done[n])
        return out

    # ------------------------------------------------------------------ presence
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Consecutive present pages from the first: the local tier's files first, the
        remote store only for the pages after the local prefix."""
        names = [self.scheme.object_name(k) for k in keys]
        local = self.local.prefix_hits(names) if self.local is not None else 0
        if local == len(names):
            return local
        answers = self.store.exists(names[local:])
        for i, a in enumerate(answers):
            if not a.ok:
                return local + i
        return len(names)

    # ------------------------------------------------------------------ writes
    def _write(self, items: list[tuple[str, Buffer]]) -> list[bool]:
        if not self.is_writer:  # MLA replicas: one writer rank per shard
            return [True] * len(items)
        results = self.store.put(items)
        ok = [r.ok for r in results]
        self._count(pages_written=sum(ok))
        return ok

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None:
            raise StoreError("batch_set needs values")
        items: list[tuple[str, Buffer]] = [
            (self.scheme.object_name(k), _tensor_bytes(v.contiguous()))
            for k, v in zip(keys, values, strict=True)]
        return all(self._write(items))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        if pool is None:
            raise StoreError("batch_set_v1 before register_mem_pool_host")
        items: list[tuple[str, Buffer]] = []
        if pool.layout in _DIRECT_LAYOUTS:
            for k, segs in zip(keys, self._page_segments(host_indices, len(keys)),
                               strict=True):
                items.append((self.scheme.object_name(k), b"".join(segs)))
        else:
            for i, k in enumerate(keys):
                page = pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True)
                items.append((self.scheme.object_name(k),
                              _tensor_bytes(page.contiguous())))
        return self._write(items)

    def clear(self) -> None:
        """SGLang's "clear storage" admin call: a shared store is not cleared by one
        engine; logged and ignored."""
        log.warning("kvprefetch HiCache storage: clear() ignored (shared store)")


def _reveal(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: _reveal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_reveal(v) for v in value]
    return value


def dynamic_extra_config(config: SGLangStorageConfig, *, interface_v1: bool = True,
                         backend_name: str = "kvprefetch") -> dict[str, Any]:
    """SGLang's ``--hicache-storage-backend-extra-config`` for this backend (JSON-able;
    secrets in clear, as SGLang needs them: keep the result out of logs)."""
    return {"backend_name": backend_name, "module_path": __name__,
            "class_name": KvPrefetchHiCacheStorage.__name__,
            "interface_v1": int(interface_v1),
            "kvprefetch": _reveal(config.model_dump(mode="python"))}
