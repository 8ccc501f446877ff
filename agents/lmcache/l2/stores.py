"""The tiers behind the L2 adapter and what each LMCache operation does to them: stores
(write-back or through), lookups (the in-memory index, then Valkey), loads (batched gets
straight into LMCache's memory objects), deletes, and the index's reconciliation with full
listings of the tiers. Knows nothing of LMCache's task protocol (:mod:`.tasks`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict
from typing import Any, Literal

from kvprefetch.agents.lmcache.key_index import KeyIndex
from kvprefetch.agents.lmcache.l2.listing import listed_names
from kvprefetch.agents.lmcache.l2.params import MIB, KvPrefetchL2Params
from kvprefetch.agents.stores.base import Buffer, GetResult, ObjectStore, OpResult, PayloadWriter
from kvprefetch.agents.stores.errors import StoreError, TierFullError
from kvprefetch.agents.stores.format import ObjectHeader
from kvprefetch.agents.stores.s3.store import S3Store
from kvprefetch.agents.stores.tiered import TieredStore
from kvprefetch.agents.stores.valkey.store import ValkeyStore
from kvprefetch.agents.stores.write_back import WriteBackQueue
from kvprefetch.agents.transfer import TokenBucket

log = logging.getLogger(__name__)


# -- load sink ------------------------------------------------------------------------------


class ObjectWriter:
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


class ObjectSink:
    """Opens a writer on the memory object a key is loaded into; a stored object whose size
    differs from the destination is refused (a miss), before any byte is written."""

    def __init__(self, views: Mapping[str, memoryview]) -> None:
        self._views = views

    def open(self, header: ObjectHeader) -> PayloadWriter:
        view = self._views[header.key]
        if header.payload_bytes != len(view):
            raise StoreError(f"{header.key!r}: stored object has {header.payload_bytes} bytes, "
                             f"the memory object {len(view)}")
        return ObjectWriter(view)


def bytes_of(obj: Any) -> memoryview:
    """The logical bytes of a memory object, as a writable unsigned-byte view."""
    return memoryview(obj.byte_array).cast("B")


def check_lengths(keys: Sequence[Any], objects: Sequence[Any]) -> None:
    """LMCache's convention (its adapters' tests look for the words "length mismatch")."""
    if len(keys) != len(objects):
        raise ValueError(f"length mismatch: {len(keys)} keys but {len(objects)} memory objects")


# -- the tiers ------------------------------------------------------------------------------


class L2Stores:
    """The stores of one adapter (Valkey, S3, or Valkey in front of S3), the write-back
    uploads, the lookup index and its reconciler. Thread-safe. The constructor does no
    I/O; :meth:`start` connects (a single unreachable tier raises there)."""

    def __init__(self, params: KvPrefetchL2Params) -> None:
        self.params = p = params
        self.valkey = ValkeyStore(p.valkey, name="valkey") if p.valkey else None
        self.s3 = S3Store(p.s3, name="s3") if p.s3 else None
        self.store: ObjectStore
        #: Write-back is ours (a bounded, journaled backlog read back from Valkey), so the
        #: tiered store only ever writes through (when Valkey is down, or as configured).
        self.uploads: WriteBackQueue | None = None
        if self.valkey is not None and self.s3 is not None:
            through = p.tiered.model_copy(update={"write_mode": "write-through"})
            self.store = TieredStore(self.valkey, self.s3, through, name="tiered")
            if p.tiered.write_mode == "write-back":
                self.uploads = WriteBackQueue(self.valkey, self.s3, p.write_back)
        else:
            only = self.valkey or self.s3
            assert only is not None
            self.store = only
        self.index = KeyIndex(p.index_max_keys)
        self._stop = threading.Event()
        self._reconciler: threading.Thread | None = None
        self._fanout = ThreadPoolExecutor(p.load_fanout_threads, thread_name_prefix="kvp-l2-get")
        self._link = (TokenBucket(p.load_bandwidth_mib_s * MIB, burst_bytes=64 * 1024)
                      if p.load_bandwidth_mib_s > 0 else None)

    def start(self) -> None:
        """Connect the stores, re-queue the uploads a previous process left journaled, and
        start the index's reconciler (one listing at once, then every
        ``index_reconcile_s``)."""
        self.store.start()
        if self.uploads is not None:
            self.uploads.start()
        self._reconciler = threading.Thread(target=self._reconcile_loop, daemon=True,
                                            name="kvp-l2-index")
        self._reconciler.start()

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Around each task: S3 uploads yield meanwhile."""
        if self.uploads is None:
            yield
            return
        with self.uploads.foreground():
            yield

    def tier_up(self, which: Literal["hot", "cold"]) -> bool:
        return self.store.tier_up(which) if isinstance(self.store, TieredStore) else True

    # -- store -------------------------------------------------------------------------------

    def put(self, items: list[tuple[str, Buffer]]) -> list[OpResult]:
        """Store each ``(name, payload)``: write-back when configured and Valkey is up, else
        through the store; the names stored join the index."""
        if self.uploads is not None and isinstance(self.store, TieredStore) \
                and self.store.tier_up("hot"):
            answers = self._store_write_back(self.uploads, items)
        else:
            answers = self.store.put(items)
        self.index.add(a.key for a in answers if a.ok)
        return answers

    def _store_write_back(self, uploads: WriteBackQueue, items: list[tuple[str, Buffer]]
                          ) -> list[OpResult]:
        """Valkey now (straight from LMCache's memory: the upload reads it back from Valkey,
        so nothing is copied), journaled for the upload to S3; keys Valkey refused are
        written through to S3 instead."""
        assert self.valkey is not None and self.s3 is not None
        total = sum(len(payload) for _, payload in items)
        if not uploads.admit(total):
            wb = self.params.write_back
            full = TierFullError(f"write-back backlog full ({wb.max_backlog_bytes} bytes) "
                                 f"for {wb.full_wait_s} s")
            return [OpResult(name, False, full) for name, _ in items]
        try:
            answers = self._put_hot(self.valkey, items)
            sizes = {name: len(payload) for name, payload in items}
            accepted = [(a.key, sizes[a.key]) for a in answers if a.ok]
            uploads.enqueue(accepted, reserved=total)
        except StoreError as exc:  # the journal is unwritable: not acknowledged
            uploads.release(total)
            log.warning("kvprefetch L2 write-back failed, writing through: %s", exc)
            return self.s3.put(items)
        except BaseException:
            uploads.release(total)
            raise
        refused = [i for i, a in enumerate(answers) if not a.ok]
        if refused:
            through = self.s3.put([items[i] for i in refused])
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

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, names: list[str]) -> list[bool]:
        """Which names are stored: from the index, the ones it does not know asked of Valkey
        in one pipelined round trip; every tier asked (S3 included) when ``lookup_index`` is
        off."""
        if not self.params.lookup_index:  # every tier asked, S3 included
            hits = [a.ok for a in self.store.exists(names)]
            self.index.add(n for n, hit in zip(names, hits, strict=True) if hit)
            unknown = []
        else:
            hits = self.index.present(names)
            unknown = [n for n, hit in zip(names, hits, strict=True) if not hit]
        if unknown and self.valkey is not None and self.tier_up("hot"):
            found = {a.key for a in self.valkey.exists(unknown) if a.ok}
            if found:
                self.index.add(found)
                hits = [hit or n in found for n, hit in zip(names, hits, strict=True)]
        return hits

    # -- load --------------------------------------------------------------------------------

    def load(self, names: list[str], sink: ObjectSink) -> set[str]:
        """Read distinct ``names`` into ``sink``'s memory objects; the names loaded whole.
        A name the index called present that no tier has is a stale entry: dropped."""
        known = dict(zip(names, self.index.present(names), strict=True))
        answers = self._fan_out(names, sink)
        ok = {a.key for a in answers if a.ok}
        self.index.add(ok)
        self.index.discard((a.key for a in answers if a.miss and known[a.key]), stale=True)
        return ok

    def pace(self, loaded_bytes: int) -> None:
        """With ``load_bandwidth_mib_s``: wait until the emulated link would have delivered
        ``loaded_bytes``."""
        if self._link is not None and loaded_bytes:
            self._link.acquire(loaded_bytes)

    def _fan_out(self, names: list[str], sink: ObjectSink) -> list[GetResult]:
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

    # -- delete ------------------------------------------------------------------------------

    def delete(self, names: list[str]) -> list[OpResult]:
        """Delete from every tier (and from the index and the upload backlog first)."""
        self.index.discard(names)
        if self.uploads is not None:
            self.uploads.forget(names)
        return self.store.delete(names)

    # -- the index's reconciliation ----------------------------------------------------------

    def reconcile_index(self) -> bool:
        """List both tiers and make the index what they hold (what changed meanwhile is
        kept). False when a listing failed (the index is left as it was)."""
        token = self.index.begin_reconcile()
        try:
            names = listed_names(self.params.key_prefix, s3=self.s3, valkey=self.valkey,
                                 uploads=self.uploads)
        except (StoreError, NotImplementedError) as exc:
            self.index.abort_reconcile()
            log.warning("kvprefetch L2 index reconciliation skipped: %s", exc)
            return False
        self.index.finish_reconcile(token, names)
        return True

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

    # -- status and lifecycle ----------------------------------------------------------------

    def tiers(self, closed: bool) -> dict[str, bool]:
        """Which tiers are up (a single store: up unless the adapter is ``closed``)."""
        if isinstance(self.store, TieredStore):
            return {"valkey": self.store.tier_up("hot"), "s3": self.store.tier_up("cold")}
        return {self.store.name: not closed}

    def status(self) -> dict[str, Any]:
        """The stores', the index's and the write-back backlog's counters."""
        stats = getattr(self.store, "stats", None)
        return {
            "store_stats": asdict(stats()) if callable(stats) else {},
            "index": asdict(self.index.stats()),
            "write_back": asdict(self.uploads.stats()) if self.uploads is not None else {},
        }

    def stop(self) -> None:
        """Stop the reconciler after its current listing."""
        self._stop.set()

    def close(self) -> None:
        """Finish the running load batches, stop the reconciler, drain the uploads (for up
        to ``close_drain_s``; the rest stays journaled) and close the stores."""
        self._stop.set()
        self._fanout.shutdown(wait=True, cancel_futures=True)
        if self._reconciler is not None:
            self._reconciler.join()
        if self.uploads is not None:
            self.uploads.close()
        self.store.close()

    def release(self) -> None:
        """Stop the background threads without waiting (a failed start, a failed close)."""
        self._stop.set()
        self._fanout.shutdown(wait=False, cancel_futures=True)
