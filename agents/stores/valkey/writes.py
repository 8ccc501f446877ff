"""The Valkey store's write path: puts (pipelined on bulk connections in standalone mode,
key by key on valkey-py in a cluster), repairs, fill leases and their fills, and deletes.

Every write keeps the store's versioning: a new version's parts go under a fresh tag before
its head is swapped in, and only then are the parts of the head it replaced deleted; a write
that fails deletes its own parts, never a head (that may be another writer's version).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import wait
from functools import partial

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    KeyPool,
    OpResult,
    StatsCounter,
    check_cancel,
)
from kvprefetch.agents.stores.errors import ObjectTooLargeError, StoreError
from kvprefetch.agents.stores.format import (
    MAX_KEY_BYTES,
    PREFIX_BYTES,
    ObjectHeader,
    make_header,
    part_count,
    part_digest,
    validate_key,
)
from kvprefetch.agents.stores.valkey.client import ValkeyClient
from kvprefetch.agents.stores.valkey.config import ValkeyStoreConfig, translate_valkey_errors
from kvprefetch.agents.stores.valkey.layout import (
    TAG_BYTES,
    KeyLayout,
    is_lease_marker,
    new_lease_marker,
    new_tag,
)

log = logging.getLogger(__name__)


class ValkeyWriter:
    """Writes and deletes objects for one
    :class:`~kvprefetch.agents.stores.valkey.store.ValkeyStore`. Thread-safe; the pools are
    the store's (``parts``: part and lane writes, ``keys``: one object each) and so are the
    counters."""

    def __init__(self, config: ValkeyStoreConfig, name: str, conn: ValkeyClient,
                 layout: KeyLayout, stats: StatsCounter, *, parts: KeyPool,
                 keys: KeyPool) -> None:
        self.config = config
        self.name = name
        self._conn = conn
        self._layout = layout
        self._stats = stats
        self._parts = parts
        self._keys = keys
        #: Bytes of a replaced head read back on a put: room for the header and tag of the
        #: largest object this store writes (or 64 KiB: 8,000-odd parts, for other writers).
        max_parts = -(-config.max_object_bytes // config.part_bytes)
        self._peek = max(64 * 1024, PREFIX_BYTES + MAX_KEY_BYTES + 8 * max_parts + 8 + TAG_BYTES)

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
        pinned: bool = False,
    ) -> list[OpResult]:
        """The work of :meth:`ValkeyStore.put` (its docstring holds the contract).
        ``pinned``: no expiry, whatever ``ttl_s`` and the configured TTL say
        (:meth:`ValkeyStore.put_pinned`)."""
        limit = self.config.max_object_bytes
        for key, payload in items:
            validate_key(key)
            if len(payload) > limit:
                raise ObjectTooLargeError(
                    f"{key!r}: {len(payload)} bytes exceed max_object_bytes={limit}"
                )
        check_cancel(cancel)
        px = None if pinned else self._conn.px(ttl_s)
        if not self.config.cluster:
            return self._put_pipelined(items, px, cancel)
        return self._keys.map(lambda item: self._put_one(item[0], item[1], px, cancel), items)

    def repair(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None
               ) -> list[OpResult]:
        """The work of :meth:`ValkeyStore.repair` (its docstring holds the contract)."""
        px = self._conn.px(ttl_s)
        for key, _ in items:
            validate_key(key)
        return self._keys.map(lambda it: self._put_one(it[0], it[1], px, None, absent=True),
                              items)

    def lease(self, keys: Sequence[str], *, ttl_s: float) -> list[bytes | None]:
        """The work of :meth:`ValkeyStore.lease` (its docstring holds the contract)."""
        if not keys:
            return []
        markers = [new_lease_marker() for _ in keys]
        px = self._conn.px(ttl_s)
        try:
            with translate_valkey_errors("lease"):
                pipe = self._conn.client.pipeline(transaction=False)
                for k, marker in zip(keys, markers, strict=True):
                    pipe.set(self._layout.head_key(k), marker, px=px, nx=True)
                taken = pipe.execute()
        except StoreError as exc:
            log.debug("%s: no fill leases for %d keys: %s", self.name, len(keys), exc)
            return [None] * len(keys)
        return [m if ok else None for m, ok in zip(markers, taken, strict=True)]

    def fill(self, items: Sequence[tuple[str, Buffer, bytes]], *, ttl_s: float | None = None
             ) -> list[OpResult]:
        """The work of :meth:`ValkeyStore.fill` (its docstring holds the contract)."""
        px = self._conn.px(ttl_s)
        for key, _, _ in items:
            validate_key(key)
        return self._keys.map(
            lambda it: self._put_one(it[0], it[1], px, None, lease=it[2]), items)

    @staticmethod
    def _new_version(header: ObjectHeader, view: memoryview) -> tuple[bytes, str | None]:
        """The head value of a new version and the tag of its parts (None: no parts)."""
        if header.parts <= 1:
            return header.encode() + bytes(view), None
        tag = new_tag()
        return header.encode() + tag, tag.hex()

    def _drop_replaced(self, replaced: Sequence[tuple[str, bytes | None]]) -> None:
        """Delete the parts of the versions new heads replaced (their readers miss cleanly),
        ``(key, old head)`` each, all in one pipelined round trip."""
        names = [n for key, old in replaced for n in self._layout.parts_of(key, old)]
        try:
            self._conn.delete_names(names)
        except StoreError as exc:
            log.warning("%s: parts of %d replaced versions (e.g. of %r) not dropped: %s",
                        self.name, len(replaced), replaced[0][0], exc)

    def _put_pipelined(self, items: Sequence[tuple[str, Buffer]], px: int | None,
                       cancel: CancelToken | None) -> list[OpResult]:
        """A batch in a few round trips: every part of every striped object and every
        inline object (its header, then its payload: one value) spread over ``connections``
        lanes, each lane one pipeline written straight from the payloads' memory; then the
        striped objects' heads in one pipeline (heads last as always). Every head is swapped
        in with :meth:`BulkConnection.swap_many`, which hands back what it replaced.

        Each lane hashes a part or an inline payload just before it sends it (the bytes are
        then in cache for the send), so the first bytes go out at once and the hashing is
        spread over the lanes; the striped headers are built from those digests once every
        part is written. Inline heads are sent from the payload's memory too, spread over
        the lanes, instead of built as one ``bytes`` on one valkey-py pipeline (two copies of
        each payload, one connection); ``kvprefetch bench store`` compares this path with a
        plain pipelined SET."""
        part_bytes = self.config.part_bytes
        views = [memoryview(payload).cast("B") for _, payload in items]
        counts = [part_count(len(view), part_bytes) for view in views]
        tags = [new_tag().hex() if n > 1 else None for n in counts]
        digests: list[list[int]] = [[0] * n if n > 1 else [] for n in counts]
        headers: list[ObjectHeader | None] = [None] * len(items)
        olds: dict[int, bytes | None] = {}
        failed: dict[int, StoreError] = {}
        # Object-major, so that lanes finish objects in the order they were given; part -1
        # is an inline object (its head holds the payload).
        jobs = [(i, j) for i, n in enumerate(counts) for j in (range(n) if n > 1 else (-1,))]

        def lane(chunk: list[tuple[int, int]]) -> list[tuple[int, StoreError]]:
            def parts() -> Iterator[tuple[bytes, Sequence[memoryview]]]:
                for i, j in chunk:
                    if j >= 0:
                        start = j * part_bytes
                        part = views[i][start : start + part_bytes]
                        digests[i][j] = part_digest(part)
                        name = self._layout.part_name(items[i][0], tags[i] or "", j)
                        yield name.encode(), (part,)

            inline = [i for i, j in chunk if j < 0]

            def heads() -> Iterator[tuple[bytes, Sequence[memoryview]]]:
                for i in inline:
                    header = headers[i] = make_header(items[i][0], views[i], part_bytes)
                    yield (self._layout.head_key(items[i][0]).encode(),
                           (memoryview(header.encode()), views[i]))
            try:
                check_cancel(cancel)
                with translate_valkey_errors("put"), self._conn.bulk.connection() as conn:
                    if len(inline) < len(chunk):
                        conn.set_many(parts(), px)
                    if inline:
                        olds.update(zip(inline, conn.swap_many(heads(), px, self._peek),
                                        strict=True))
            except StoreError as exc:
                return [(i, exc) for i, _ in chunk]
            return []

        if jobs:
            lanes = min(self.config.connections, len(jobs))
            chunks = [jobs[n::lanes] for n in range(lanes)]
            futures = [self._parts.submit(partial(lane, c)) for c in chunks[1:]]
            try:
                errors = lane(chunks[0])
            finally:
                wait(futures)  # every lane is done with the payloads' memory
            for f in futures:
                errors += f.result()
            for i, exc in errors:
                failed.setdefault(i, exc)
        striped = [i for i, n in enumerate(counts) if n > 1 and i not in failed]
        for i in striped:
            headers[i] = ObjectHeader(key=items[i][0], payload_bytes=len(views[i]),
                                      part_bytes=part_bytes, digests=tuple(digests[i]))

        def striped_heads() -> Iterator[tuple[bytes, Sequence[memoryview]]]:
            for i in striped:
                head, tag = headers[i], tags[i]
                assert head is not None and tag is not None
                yield (self._layout.head_key(head.key).encode(),
                       (memoryview(head.encode() + bytes.fromhex(tag)),))
        try:
            check_cancel(cancel)
            if striped:
                with translate_valkey_errors("put"), self._conn.bulk.connection() as conn:
                    olds.update(zip(striped, conn.swap_many(striped_heads(), px, self._peek),
                                    strict=True))
        except StoreError as exc:
            for i in striped:
                failed[i] = exc
        # One round trip for every replaced version of the batch, not one per key.
        self._drop_replaced([(items[i][0], old) for i, old in olds.items() if i not in failed])
        # A failed item's own parts go (never a head: that may be another writer's version).
        self._drop_own_parts([(ObjectHeader(key=items[i][0], payload_bytes=len(views[i]),
                                            part_bytes=part_bytes, digests=tuple(digests[i])),
                               tags[i]) for i in failed if tags[i] is not None])
        out = []
        for i, (key, _) in enumerate(items):
            if i in failed:
                self._stats.add(errors=1)
                out.append(OpResult(key, False, failed[i]))
            else:
                self._stats.add(puts=1, bytes_written=len(views[i]))
                out.append(OpResult(key, True))
        return out

    def _drop_own_parts(self, versions: Sequence[tuple[ObjectHeader, str | None]]) -> None:
        names = [n for h, tag in versions for n in self._layout.parts_of_version(h, tag)]
        with contextlib.suppress(StoreError):
            self._conn.delete_names(names)

    def _put_one(self, key: str, payload: Buffer, px: int | None, cancel: CancelToken | None,
                 *, absent: bool = False, lease: bytes | None = None) -> OpResult:
        view = memoryview(payload).cast("B")
        header = make_header(key, view, self.config.part_bytes)
        value, tag = self._new_version(header, view)
        try:
            if tag is not None:
                self._put_parts(header, tag, view, px, cancel)
            try:
                check_cancel(cancel)
                with translate_valkey_errors("put"):
                    head_key = self._layout.head_key(key)
                    if lease is not None:  # published only over the reader's own lease
                        old = None
                        if not self._conn.fill_if_leased(head_key, lease, value, px):
                            self._drop_own_parts([(header, tag)])
                            return OpResult(key, False)
                    elif absent:  # SET NX: published only where nothing is
                        old = None
                        client = self._conn.client
                        if not client.set(head_key, value, px=px, nx=True):
                            self._drop_own_parts([(header, tag)])
                            return OpResult(key, False)
                    else:
                        # SET ... GET: the head is swapped and the replaced one read in
                        # one round trip (its parts are then dropped).
                        old = self._conn.client.set(head_key, value, px=px, get=True)
            except BaseException:
                self._drop_own_parts([(header, tag)])
                raise
        except StoreError as exc:
            self._stats.add(errors=1)
            return OpResult(key, False, exc)
        self._drop_replaced([(key, old)])
        self._stats.add(puts=1, bytes_written=len(view))
        return OpResult(key, True)

    def _put_parts(self, header: ObjectHeader, tag: str, view: memoryview, px: int | None,
                   cancel: CancelToken | None) -> None:
        client = self._conn.client

        def put(index: int) -> None:
            check_cancel(cancel)
            start, end = header.part_range(index)
            with translate_valkey_errors("put part"):
                client.set(self._layout.part_name(header.key, tag, index), view[start:end], px=px)

        futures = [self._parts.submit(partial(put, i)) for i in range(header.parts)]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            self._drop_own_parts([(header, tag)])
            raise

    # -- delete ------------------------------------------------------------------------------

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        """The work of :meth:`ValkeyStore.delete` (its docstring holds the contract)."""
        check_cancel(cancel)
        try:
            with translate_valkey_errors("delete"):
                pipe = self._conn.client.pipeline(transaction=False)
                for k in keys:
                    pipe.getdel(self._layout.head_key(k))
                olds = pipe.execute()
        except StoreError as exc:
            return [OpResult(k, False, exc) for k in keys]
        names = [n for k, old in zip(keys, olds, strict=True)
                 for n in self._layout.parts_of(k, old)]
        try:
            self._conn.delete_names(names)
        except StoreError as exc:  # the heads are gone: the objects are, too
            log.warning("%s: parts of deleted objects not dropped: %s", self.name, exc)
        out = []
        for k, old in zip(keys, olds, strict=True):
            found = old is not None and not is_lease_marker(old)
            if found:
                self._stats.add(deletes=1)
            out.append(OpResult(k, found))
        return out
