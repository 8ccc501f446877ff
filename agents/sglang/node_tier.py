"""A reader of the node-local DRAM tier that the agent writes (no SGLang, no torch).

The agent's :class:`~kvprefetch.agents.stores.local.LocalTier` and SGLang's storage backend live in
different processes, so the backend does not open the tier (its ``start`` would drop the
agent's in-flight writes, and its index is per process). Objects are published by atomic
rename, one file per key at :meth:`LocalTier.path_of`, so a reader that opens the file by
name sees a whole, checksummed object or nothing. ``exists`` is one ``stat`` per key.

Reads land straight in the caller's memory (SGLang's host pages): the payload is read with
``preadv`` into the destination in chunks of :data:`CHUNK_BYTES`, and each chunk is hashed
while it is still in the CPU's cache, into the running digest of its checksummed part, so
the bytes are copied once and hashed once, from cache. A part whose digest differs (a
damaged file, or a file the tier recycled under the reader: the tier reuses evicted files
for new objects) fails the whole object, and the caller reads it elsewhere: a damaged page
is never reported as served. A batch is spread over ``read_threads`` threads (the calling
thread and a small pool): ``preadv`` and xxhash release the GIL, so pages are copied and
verified on several cores at once.
"""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kvprefetch.agents.stores.errors import CorruptObjectError, StoreError
from kvprefetch.agents.stores.format import (
    ALGO_XXH3_64,
    ALGO_XXH64,
    ObjectHeader,
    decode_header,
    header_length,
)
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig, tier_file_name

#: Bytes read (and hashed) per ``preadv``: small enough to be hashed from the L2 cache.
CHUNK_BYTES = 256 * 1024
#: First read of an object: its header (prefix, key, part digests) in one system call.
_HEAD_BYTES = 4096

_HASHERS: dict[int, Callable[[], xxhash.xxh3_64 | xxhash.xxh64]] = {
    ALGO_XXH3_64: xxhash.xxh3_64, ALGO_XXH64: xxhash.xxh64}


class TierRead(enum.Enum):
    """What reading one object from the tier gave."""

    HIT = "hit"  # every byte in place and verified
    MISS = "miss"  # no such object
    BAD = "bad"  # damaged, truncated, of another size, or unreadable: not served


#: One object to read: its key and the memory its payload goes to, in payload order
#: (for SGLang's page-first host pool, a page's K region then its V region).
ReadItem = tuple[str, Sequence[memoryview]]


class NodeTierReader:
    """Reads published objects of a node-local tier directory. Thread-safe; ``close``
    stops its reader threads."""

    def __init__(self, config: LocalTierConfig, *, read_threads: int = 1,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if read_threads < 1 or chunk_bytes < 4096:
            raise StoreError("read_threads >= 1 and chunk_bytes >= 4096")
        self.config = config
        self.read_threads = read_threads
        self._chunk = chunk_bytes
        self._names = LocalTier(config, name="sglang-view")  # no I/O: only path_of
        self._root = os.fspath(config.path)
        # The calling thread reads one share of a batch itself: the pool has the rest.
        self._pool = (ThreadPoolExecutor(read_threads - 1, thread_name_prefix="kvp-tier-read")
                      if read_threads > 1 else None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def path_of(self, key: str) -> Path:
        return self._names.path_of(key)

    def _path(self, key: str) -> str:  # path_of without pathlib (per page, per call)
        return os.path.join(self._root, tier_file_name(key))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self._path(k)) for k in keys]

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are in the tier."""
        for i, key in enumerate(keys):
            if not os.path.exists(self._path(key)):
                return i
        return len(keys)

    def read_batch(self, items: Sequence[ReadItem]) -> list[TierRead]:
        """:meth:`read_into` for each item, spread over the reader threads."""
        n = len(items)
        shares = min(self.read_threads, n)
        if self._pool is None or shares <= 1:
            return [self.read_into(key, dest) for key, dest in items]
        out = [TierRead.MISS] * n
        # Each thread takes the next item when it is free (next() on a count is atomic
        # under the GIL): a thread the OS leaves waiting holds up one page, not a share.
        taken = itertools.count()

        def work() -> None:
            while (i := next(taken)) < n:
                out[i] = self.read_into(*items[i])

        futures = [self._pool.submit(work) for _ in range(1, shares)]
        try:
            work()
        finally:
            for f in futures:
                f.result()
        return out

    def read_into(self, key: str, destination: Sequence[memoryview]) -> TierRead:
        """Read object ``key``'s payload into ``destination`` (byte views whose lengths add
        up to the payload's) and verify every part. On anything but :attr:`TierRead.HIT`
        the destination holds unspecified bytes; a damaged file is left for the agent's
        tier to drop."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return TierRead.MISS
        except OSError:
            return TierRead.BAD
        try:
            head = os.pread(fd, _HEAD_BYTES, 0)
            length = header_length(head)
            if length > len(head):
                head += os.pread(fd, length - len(head), len(head))
            header = decode_header(head, expected_key=key)
            if header.payload_bytes != sum(len(d) for d in destination):
                return TierRead.BAD  # another model or page layout
            self._fill(fd, header, destination)
            return TierRead.HIT
        except (StoreError, OSError):
            return TierRead.BAD
        finally:
            os.close(fd)

    def _fill(self, fd: int, header: ObjectHeader, destination: Sequence[memoryview]) -> None:
        """Copy the payload chunk by chunk, each chunk hashed into its part's digest right
        after it lands; raise :class:`CorruptObjectError` at the first part that differs."""
        new_hasher = _HASHERS.get(header.algo)
        if new_hasher is None:
            raise CorruptObjectError(f"{header.key!r}: unknown checksum algorithm")
        offset = header.header_bytes  # in the file
        seg, at = 0, 0  # destination segment and offset in it
        for part in range(header.parts):
            start, end = header.part_range(part)
            need = end - start
            hasher = new_hasher()
            while need:
                view = destination[seg]
                if at == len(view):  # an empty segment
                    seg, at = seg + 1, 0
                    continue
                n = min(need, len(view) - at, self._chunk)
                chunk = view[at : at + n]
                got = os.preadv(fd, [chunk], offset)
                while got < n:  # a short read: the rest, or the file ended early
                    more = os.preadv(fd, [chunk[got:]], offset + got)
                    if more <= 0:
                        raise CorruptObjectError(f"{header.key!r}: truncated in part {part}")
                    got += more
                hasher.update(chunk)
                offset += n
                need -= n
                at += n
                if at == len(view):
                    seg, at = seg + 1, 0
            if hasher.intdigest() != header.digests[part]:
                raise CorruptObjectError(f"{header.key!r}: checksum mismatch in part {part}")
