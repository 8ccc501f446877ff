"""The Valkey store's read path: heads in one pipelined round trip, then the parts of the
striped objects, each verified against its checksum, straight into the caller's sink.

Two ways through. The *direct* path (``direct_reads``, standalone mode) receives values on
bulk RESP connections with ``recv_into`` into the sink's memory; with ``get_lanes`` the parts
of every striped object of a call are read on that many connections at once. The *checked*
path (valkey-py, and whatever the direct path could not finish) reads one object at a time,
reads a replaced head again once, and drops damage with compare-and-delete: a broken object
is deleted only while its head is still the one read, so a newer version is never touched.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from functools import partial
from typing import Any

from kvprefetch.agents.stores.base import (
    CancelToken,
    GetResult,
    KeyPool,
    MemorySink,
    PayloadSink,
    check_cancel,
)
from kvprefetch.agents.stores.errors import CorruptObjectError, ObjectNotFoundError, StoreError
from kvprefetch.agents.stores.format import (
    PREFIX_BYTES,
    ObjectHeader,
    decode_header,
    header_length,
)
from kvprefetch.agents.stores.valkey.client import ValkeyClient
from kvprefetch.agents.stores.valkey.config import ValkeyStoreConfig, translate_valkey_errors
from kvprefetch.agents.stores.valkey.layout import Head, KeyLayout
from kvprefetch.agents.stores.valkey.resp import BulkConnection

log = logging.getLogger(__name__)


class ValkeyReader:
    """Reads objects for one :class:`~kvprefetch.agents.stores.valkey.store.ValkeyStore`
    (its ``get``). Thread-safe; the pools are the store's (``parts``: part fetches, ``keys``:
    one object each)."""

    def __init__(self, config: ValkeyStoreConfig, name: str, conn: ValkeyClient,
                 layout: KeyLayout, *, parts: KeyPool, keys: KeyPool) -> None:
        self.config = config
        self.name = name
        self._conn = conn
        self._layout = layout
        self._parts = parts
        self._keys = keys

    def _heads(self, keys: Sequence[str]) -> list[bytes | StoreError | None]:
        try:
            with translate_valkey_errors("get"):
                if len(keys) == 1:
                    return [self._conn.client.get(self._layout.head_key(keys[0]))]
                pipe = self._conn.client.pipeline(transaction=False)
                for k in keys:
                    pipe.get(self._layout.head_key(k))
                return list(pipe.execute())
        except StoreError as exc:
            return [exc] * len(keys)

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]:
        """The work of :meth:`ValkeyStore.get` (its docstring holds the contract)."""
        check_cancel(cancel)
        keep = sink is None
        use = sink if sink is not None else MemorySink()
        out: list[GetResult | bytes | StoreError | None]
        if self.config.direct_reads and not self.config.cluster and keys:
            out = self._heads_direct(keys, use, keep)
            striped = []
            for i, (key, raw) in enumerate(zip(keys, out, strict=True)):
                if isinstance(raw, bytes) and self.config.get_lanes:
                    with contextlib.suppress(StoreError):  # the checked path decides
                        head = self._layout.parse_head(key, raw)
                        if head.tag is not None:
                            striped.append((i, head))
            if striped:
                for i, result in self._fetch_striped(striped, use, keep, cancel).items():
                    out[i] = result
        else:
            out = list(self._heads(keys))
        rest = [(i, k, h) for i, (k, h) in enumerate(zip(keys, out, strict=True))
                if not isinstance(h, GetResult)]
        if len(rest) == 1:
            i, k, h = rest[0]
            out[i] = self._get_one(k, h, use, keep, cancel)
        elif rest:
            futures = [(i, self._keys.submit(partial(self._get_one, k, h, use, keep, cancel)))
                       for i, k, h in rest]
            for i, f in futures:
                out[i] = f.result()
        return out  # type: ignore[return-value]

    def _fetch_striped(self, heads: list[tuple[int, Head]], sink: PayloadSink, keep: bool,
                       cancel: CancelToken | None) -> dict[int, GetResult]:
        """The parts of every object in ``heads`` (``(index, head)``) over up to
        ``get_lanes`` lanes (this thread takes the first), each lane one ``GET`` at a time,
        each part received straight into its object's writer and verified. Returns the
        result of every object read whole or whose writer could not open; the others'
        writers are aborted and they are left out (for the checked path).

        One GET at a time: a lane's GETs sent all at once make Valkey queue the replies in
        its output buffers, which costs it several times the CPU per GiB (the Valkey CPU
        that ``kvprefetch bench lmcache`` reports)."""
        out: dict[int, GetResult] = {}
        writers: dict[int, Any] = {}
        for i, head in heads:
            try:
                writers[i] = sink.open(head.header)
            except StoreError as exc:
                out[i] = GetResult(head.header.key, header=head.header, error=exc)
        if not writers:
            return out
        by_index = dict(heads)
        jobs = [(i, j) for i in writers for j in range(by_index[i].header.parts)]
        failed: set[int] = set()

        def lane(chunk: list[tuple[int, int]]) -> None:
            at = 0
            try:
                with translate_valkey_errors("get part"), self._conn.bulk.connection() as conn:
                    for i, j in chunk:
                        check_cancel(cancel)
                        head = by_index[i]
                        conn.send_gets([self._layout.part_name(head.header.key, head.tag or "", j)])
                        if not self._receive_part(conn, head.header, j, writers[i]):
                            failed.add(i)
                        at += 1
            except StoreError:
                failed.update(i for i, _ in chunk[at:])

        lanes = max(1, min(self.config.get_lanes, len(jobs)))
        chunks = [jobs[n::lanes] for n in range(lanes)]
        futures = [self._parts.submit(partial(lane, c)) for c in chunks[1:]]
        try:
            lane(chunks[0])
        finally:
            wait(futures)  # nothing may write into the writers after this returns
        for f in futures:
            f.result()
        for i, writer in writers.items():
            header = by_index[i].header
            if i in failed:
                writer.abort()
                continue
            try:
                writer.commit()
            except StoreError as exc:
                writer.abort()
                out[i] = GetResult(header.key, header=header, error=exc)
                continue
            data = memoryview(writer.buffer) if keep and hasattr(writer, "buffer") else None
            out[i] = GetResult(header.key, header=header, data=data, source=self.name)
        return out

    @staticmethod
    def _receive(conn: BulkConnection, writer: Any, start: int, size: int,
                 verify: Callable[[memoryview], None]
                 ) -> tuple[bytes, CorruptObjectError] | None:
        """Receive the next ``size`` bytes of ``conn``'s current bulk reply (and its CRLF)
        into ``writer`` at ``start`` (straight into its memory where it offers a target),
        checked by ``verify``. None: written; else the bytes and what ``verify`` raised
        (nothing was written)."""
        view = writer.target(start, size) if size else None
        data = view if view is not None else memoryview(bytearray(size))
        try:
            conn.read_into(data)
            conn.skip(2)
            try:
                verify(data)
            except CorruptObjectError as exc:
                return bytes(data), exc
            if view is None:
                if size:
                    writer.write_at(start, data)
            else:
                writer.written(start, size)
        finally:
            if view is not None:
                view.release()
        return None

    def _receive_part(self, conn: BulkConnection, header: ObjectHeader, index: int,
                      writer: Any) -> bool:
        """Receive the next reply of ``conn``, part ``index`` of ``header``'s object, into
        ``writer``; False (the bytes read and dropped) when it is gone, of another size or
        damaged."""
        start, end = header.part_range(index)
        n = conn.reply_size()
        if n != end - start:
            if n >= 0:
                conn.skip(n + 2)
            return False
        return self._receive(conn, writer, start, n, partial(header.verify_part, index)) is None

    def _heads_direct(self, keys: Sequence[str], sink: PayloadSink, keep: bool
                      ) -> list[GetResult | bytes | StoreError | None]:
        """Every head, ``GET`` pipelined on one bulk connection. An inline object is
        received straight into its writer and comes back as its :class:`GetResult`; any
        other head comes back as its value (None: absent; a :class:`StoreError`: the
        connection failed before it) for :meth:`_get_one`. One connection, not lanes: the
        heads of striped objects are small, and lanes for them queue behind the part fetches
        (``kvprefetch bench lmcache`` shows the difference); callers that read many inline
        objects at once split their keys (the LMCache adapter's ``load_batch_keys``)."""
        out: list[GetResult | bytes | StoreError | None] = [None] * len(keys)
        done = 0
        try:
            with translate_valkey_errors("get"), self._conn.bulk.connection() as conn:
                conn.send_gets([self._layout.head_key(k) for k in keys])
                for i, key in enumerate(keys):
                    out[i] = self._read_head(conn, key, sink, keep)
                    done += 1
        except StoreError as exc:
            out[done:] = [exc] * (len(keys) - done)
        return out

    def _read_head(self, conn: BulkConnection, key: str, sink: PayloadSink, keep: bool
                   ) -> GetResult | bytes | None:
        """Read the next reply of ``conn``, the head of ``key``: an inline object goes
        straight into its writer (verified); a striped head or one that does not decode
        comes back as bytes, whole."""
        n = conn.reply_size()
        if n < 0:
            return None
        head = bytearray(min(n, PREFIX_BYTES))
        conn.read_into(memoryview(head))
        header = None
        try:
            length = min(n, header_length(head))
            head += bytes(length - len(head))
            conn.read_into(memoryview(head)[PREFIX_BYTES:])
            header = decode_header(head, expected_key=key)
        except CorruptObjectError:
            pass
        if header is None or header.parts > 1 or n != len(head) + header.payload_bytes:
            rest = bytearray(n - len(head))
            conn.read_into(memoryview(rest))
            conn.skip(2)
            return bytes(head + rest)
        try:
            writer = sink.open(header)
        except StoreError as exc:
            conn.skip(header.payload_bytes + 2)
            return GetResult(key, header=header, error=exc)
        try:
            damaged = self._receive(conn, writer, 0, header.payload_bytes,
                                    header.verify_payload)
            if damaged is not None:
                bad, error = damaged
                writer.abort()
                self.drop_if_unchanged(key, bytes(head) + bad, None, error)
                return GetResult(key, header=header, error=error)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        data = memoryview(writer.buffer) if keep and hasattr(writer, "buffer") else None
        return GetResult(key, header=header, data=data, source=self.name)

    def _get_one(
        self,
        key: str,
        raw: bytes | StoreError | None,
        sink: PayloadSink,
        keep: bool,
        cancel: CancelToken | None,
    ) -> GetResult:
        result = self._read_version(key, raw, sink, keep, cancel)
        if isinstance(result, GetResult):
            return result
        # A part vanished because a writer replaced the head meanwhile: read the new one.
        try:
            with translate_valkey_errors("get"):
                raw = self._conn.client.get(self._layout.head_key(key))
        except StoreError as exc:
            raw = exc
        again = self._read_version(key, raw, sink, keep, cancel)
        return again if isinstance(again, GetResult) else GetResult(key, error=again)

    def _read_version(
        self,
        key: str,
        raw: bytes | StoreError | None,
        sink: PayloadSink,
        keep: bool,
        cancel: CancelToken | None,
    ) -> GetResult | ObjectNotFoundError:
        """Read the version whose head is ``raw``; an :class:`ObjectNotFoundError` returned
        (not in a result) means a part was gone and the head had changed since it was read:
        the caller may read the new head."""
        if isinstance(raw, StoreError):
            return GetResult(key, error=raw)
        if raw is None:
            return GetResult(key, error=ObjectNotFoundError(f"{key!r} not in {self.name}"))
        try:
            head = self._layout.parse_head(key, raw)
        except CorruptObjectError as exc:
            self.drop_if_unchanged(key, raw, None, exc)
            return GetResult(key, error=exc)
        except ObjectNotFoundError as exc:  # no version tag, or a lease: a miss, left alone
            return GetResult(key, error=exc)
        header = head.header
        try:
            writer = sink.open(header)
        except StoreError as exc:
            return GetResult(key, header=header, error=exc)
        try:
            if header.parts <= 1:
                inline = memoryview(raw)[header.header_bytes :]
                header.verify_payload(inline)
                if header.parts:
                    writer.write_at(0, inline)
            else:
                self._fetch_parts(head, writer, cancel)
            writer.commit()
        except CorruptObjectError as exc:
            writer.abort()
            self.drop_if_unchanged(key, raw, head, exc)
            return GetResult(key, header=header, error=exc)
        except ObjectNotFoundError as exc:
            writer.abort()
            if self.drop_if_unchanged(key, raw, head, exc) is False:
                return exc  # replaced while read: not broken, just gone
            return GetResult(key, header=header, error=exc)
        except StoreError as exc:
            writer.abort()
            return GetResult(key, header=header, error=exc)
        except BaseException:
            writer.abort()
            raise
        data = None
        if keep:
            data = memoryview(writer.buffer) if hasattr(writer, "buffer") else None
        return GetResult(key, header=header, data=data, source=self.name)

    def _fetch_parts(self, head: Head, writer: Any, cancel: CancelToken | None) -> None:
        client = self._conn.client
        header, tag = head.header, head.tag
        assert tag is not None  # a striped head always has one (see KeyLayout.parse_head)

        direct = self.config.direct_reads and not self.config.cluster

        def fetch(index: int) -> None:
            check_cancel(cancel)
            start, end = header.part_range(index)
            name = self._layout.part_name(header.key, tag, index)
            view = writer.target(start, end - start) if direct else None
            if view is not None:
                try:
                    with translate_valkey_errors("get part"), self._conn.bulk.connection() as conn:
                        found = conn.get_into(name, view)
                    if not found:
                        raise ObjectNotFoundError(f"{header.key!r}: part {index} is gone")
                    header.verify_part(index, view)
                finally:
                    view.release()
                writer.written(start, end - start)
                return
            with translate_valkey_errors("get part"):
                value = client.get(name)
            if value is None:
                raise ObjectNotFoundError(f"{header.key!r}: part {index} is gone")
            header.verify_part(index, value)
            writer.write_at(start, value)

        # Lanes: the calling thread and up to ``connections - 1`` pool threads each take the
        # next part until none is left, so a chunk costs at most that many thread hand-offs
        # (not one per part) and the caller fetches instead of waiting.
        next_part = itertools.count()
        failed = threading.Event()

        def lane() -> None:
            try:
                while not failed.is_set():
                    i = next(next_part)
                    if i >= header.parts:
                        return
                    fetch(i)
            except BaseException:
                failed.set()  # the other lanes stop after the part they are on
                raise

        helpers = min(self.config.connections, header.parts) - 1
        futures: list[Future[None]] = [self._parts.submit(lane) for _ in range(helpers)]
        try:
            lane()
        finally:
            if failed.is_set():
                for f in futures:
                    f.cancel()
            wait(futures)  # nothing may write into the destination after this returns
        for f in futures:
            if not f.cancelled():
                f.result()

    def drop_if_unchanged(self, key: str, raw: bytes, head: Head | None,
                           exc: StoreError) -> bool | None:
        """Delete a broken object, but only if its head is still ``raw`` (compare-and-delete),
        then its parts. True: dropped; False: the head had changed (a newer version, never
        touched); None: the check itself failed (nothing deleted)."""
        try:
            with translate_valkey_errors("drop broken object"):
                dropped = self._conn.delete_if_unchanged(self._layout.head_key(key), raw)
            if dropped and head is not None:
                self._conn.delete_names(self._layout.parts_of_version(head.header, head.tag))
        except StoreError as err:
            log.warning("%s: broken object %r not dropped (%s): %s", self.name, key, err, exc)
            return None
        if dropped:
            log.warning("%s: broken object %r dropped: %s", self.name, key, exc)
        return dropped
