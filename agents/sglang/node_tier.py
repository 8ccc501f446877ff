"""A reader of the node-local DRAM tier that the agent writes (no SGLang, no torch).

The agent's :class:`~kvprefetch.agents.stores.local.LocalTier` and SGLang's storage backend live in
different processes, so the backend does not open the tier (its ``start`` would drop the
agent's in-flight writes, and its index is per process). Objects are published by atomic
rename, one file per key at :meth:`LocalTier.path_of`, so a reader that opens the file by
name sees a whole, checksummed object or nothing. ``exists`` is one ``stat`` per key.

Reads land straight in the caller's memory (SGLang's host pages): the payload is read with
``preadv`` into the destination in chunks of :data:`CHUNK_BYTES`, and each chunk is hashed
while it is still in the CPU's cache, into the running digest of its checksummed part, so
the bytes are copied once from the tier and hashed once, from cache. The kernel copies
fastest when the file offset and the memory address agree modulo a cache line, which an
object's payload (after a header of any length) and a host page seldom do: where a short
move by less than a line is fast (:func:`short_moves_fast`), a chunk is read
:data:`LINE_BYTES`-aligned a few bytes past its place, hashed there, and moved into place
while it is still in cache. A part whose digest differs (a
damaged file, or a file the tier recycled under the reader: the tier reuses evicted files
for new objects) fails the whole object, and the caller reads it elsewhere: a damaged page
is never reported as served. A batch is spread over ``read_threads`` threads (the calling
thread and a small pool): ``preadv`` and xxhash release the GIL, so pages are copied and
verified on several cores at once.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
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

#: Bytes read (and hashed) per ``preadv``: few system calls and GIL hand-overs per page
#: (the threads of a batch take turns at the GIL after each call), still hashed from cache.
CHUNK_BYTES = 1024 * 1024
#: The alignment (bytes) at which the kernel's copy from the page cache runs at full speed.
LINE_BYTES = 64
#: Chunks shorter than this are read in place (a move would cost more than it saves).
_REALIGN_MIN_BYTES = 1024
#: First read of an object: its header (prefix, key, part digests) in one system call.
_HEAD_BYTES = 4096

_HASHERS: dict[int, Callable[[], xxhash.xxh3_64 | xxhash.xxh64]] = {
    ALGO_XXH3_64: xxhash.xxh3_64, ALGO_XXH64: xxhash.xxh64}


def short_moves_fast(libc_version: str | None, cpu_flags: Iterable[str]) -> bool:
    """Whether ``memmove`` by fewer than :data:`LINE_BYTES` bytes runs as a vector loop:
    glibc 2.33 and later avoid ``rep movsb`` for such short distances on CPUs with FSRM,
    where that instruction is slow for them. ``libc_version`` is
    ``os.confstr("CS_GNU_LIBC_VERSION")`` (``"glibc 2.36"``; None or another C library:
    False), ``cpu_flags`` the flags of ``/proc/cpuinfo``."""
    if not libc_version:
        return False
    name, _, version = libc_version.partition(" ")
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return name == "glibc" and (major, minor) >= (2, 33) and "fsrm" in set(cpu_flags)


@functools.cache
def _platform_moves_fast() -> bool:
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except (OSError, ValueError):
        return False
    return short_moves_fast(libc, flags)


def _address(view: memoryview) -> int | None:
    """The address of a writable, non-empty byte view; None for any other."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


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
                 chunk_bytes: int = CHUNK_BYTES, realign: bool | None = None) -> None:
        """``realign``: read chunks line-aligned and move them into place (see the module
        docstring); None: where :func:`short_moves_fast` holds for this machine."""
        if read_threads < 1 or chunk_bytes < 4096:
            raise StoreError("read_threads >= 1 and chunk_bytes >= 4096")
        self.config = config
        self.read_threads = read_threads
        self._chunk = chunk_bytes
        self.realign = _platform_moves_fast() if realign is None else realign
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
        addresses = ([_address(view) for view in destination] if self.realign
                     else [None] * len(destination))
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
                address = addresses[seg]
                skew = (offset - address - at) % LINE_BYTES if address is not None else 0
                if address is not None and skew and n >= _REALIGN_MIN_BYTES:
                    # Land the chunk ``skew`` bytes late, where its file offset and address
                    # agree modulo a line; the last chunk of a segment leaves its final
                    # ``skew`` bytes to a small read in place, as the segment ends there.
                    moved = n if at + n + skew <= len(view) else n - skew
                    landed = view[at + skew : at + skew + moved]
                    _read_exact(fd, landed, offset, header.key, part)
                    hasher.update(landed)
                    ctypes.memmove(address + at, address + at + skew, moved)
                    if moved < n:
                        rest = view[at + moved : at + n]
                        _read_exact(fd, rest, offset + moved, header.key, part)
                        hasher.update(rest)
                else:
                    chunk = view[at : at + n]
                    _read_exact(fd, chunk, offset, header.key, part)
                    hasher.update(chunk)
                offset += n
                need -= n
                at += n
                if at == len(view):
                    seg, at = seg + 1, 0
            if hasher.intdigest() != header.digests[part]:
                raise CorruptObjectError(f"{header.key!r}: checksum mismatch in part {part}")


def _read_exact(fd: int, into: memoryview, offset: int, key: str, part: int) -> None:
    """Fill ``into`` from ``offset`` of the file; a file that ends early is corrupt."""
    got = os.preadv(fd, [into], offset)
    while got < len(into):  # a short read: the rest, or the file ended early
        more = os.preadv(fd, [into[got:]], offset + got)
        if more <= 0:
            raise CorruptObjectError(f"{key!r}: truncated in part {part}")
        got += more
