"""Node-local tiers: DRAM (files in ``/dev/shm``) and disk (an NVMe directory).

One file per object, in the shared object format, named by a hash of the key. A write goes
to a hidden temporary file that is space-reserved up front (``posix_fallocate``: a full tier
fails before any payload byte is written, and tmpfs allocates its pages in one go rather
than as the file grows write by write), then is renamed into place
(atomic publish): readers see the whole object or nothing. ``start`` removes temporary files
left by a killed process and re-indexes the published ones.

Writers fill the file through a shared memory mapping. With file recycling on (the DRAM
default) the tier keeps each file's mapping for as long as the file exists, through renames
(tmp -> published -> spare -> tmp ...), so a write into a recycled file costs only the copy:
mapping and unmapping tmpfs per chunk (page-table setup, then teardown with TLB flushes)
would cost a large share of a loopback transfer (``kvprefetch bench store`` writes through
this path). A mapping is closed when its file is unlinked, so it never holds memory the tier
does not account for. The files, spares and mappings are
:class:`~kvprefetch.agents.stores.local_files.TierFiles`; the tier books the objects.

Capacity is accounted in bytes on disk (header + payload), reservations included. The
objects are booked in a :class:`~kvprefetch.controlplane.base.tiers.Tier` (the project's one tier
vocabulary, shared with the scheduler's books) and room is made by the configured
:mod:`eviction <kvprefetch.agents.stores.eviction>` policy: ``lru``, or ``predicted``, which follows
the scheduler's advice that the agent passes to :meth:`LocalTier.advise`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    GetResult,
    MemorySink,
    MemoryWriter,
    OpResult,
    PayloadSink,
    PayloadWriter,
    StatsCounter,
    StoreLifecycle,
    check_cancel,
)
from kvprefetch.agents.stores.errors import (
    CorruptObjectError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreConfigError,
    StoreError,
    TierFullError,
)
from kvprefetch.agents.stores.eviction import EvictionPolicy, make_policy
from kvprefetch.agents.stores.format import (
    PREFIX_BYTES,
    ObjectHeader,
    decode_header,
    header_length,
    make_header,
    validate_key,
)
from kvprefetch.agents.stores.local_files import (
    MAP_FLAGS,
    SPARE_PREFIX,
    SUFFIX,
    TMP_PREFIX,
    TierFiles,
    close_map,
    tier_file_name,
)
from kvprefetch.controlplane.base.tiers import Tier, TierEntry

log = logging.getLogger(__name__)
MIB = 1 << 20


class LocalTierConfig(BaseModel):
    """A node-local tier."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Directory of the tier; for DRAM, a directory under ``/dev/shm``.
    path: str
    capacity_bytes: int = Field(gt=0)
    kind: Literal["dram", "disk"] = "dram"
    #: ``never``: no fsync (DRAM; a crash loses the tier anyway); ``file``: fsync each object
    #: before publishing; ``file+dir``: also fsync the directory after the rename (disk).
    fsync: Literal["never", "file", "file+dir"] | None = None
    #: ``lru``, or ``predicted``: furthest predicted next use first, as the scheduler
    #: advises through the node's agent (its orders' deadlines and its evict advice).
    eviction: Literal["lru", "predicted"] = "lru"
    #: Part size of checksums for objects written with ``put``.
    part_bytes: int = Field(4 * MIB, ge=4096)
    max_object_bytes: int | None = Field(None, gt=0)
    #: Keep the files of evicted and deleted objects (up to the free capacity) and reuse
    #: them for new objects: writing into memory the tier already holds is a plain copy,
    #: while fresh tmpfs pages must be allocated and zeroed first (several times slower).
    #: None = on for DRAM, off for disk.
    recycle_files: bool | None = None
    #: Files of ``prewarm_file_bytes`` created at start (up to this total) for new objects
    #: to reuse, as an LMCache L1 preallocates its buffer. 0 = none.
    prewarm_bytes: int = Field(0, ge=0)
    prewarm_file_bytes: int = Field(32 * MIB + 64 * 1024, gt=0)
    #: Delete the tier's files when it is closed (a clean stop: the agent's ``close``, the
    #: deployment's shutdown), so a DRAM tier gives its memory back; a process that dies
    #: leaves them, and an agent restarted in its place indexes them again. Only for the
    #: tier's owner (``kvprefetch serve`` sets it on its agents' DRAM tiers): a reader of
    #: the same folder (SGLang's backend) never removes what the agent wrote.
    remove_on_close: bool = False

    @property
    def recycle(self) -> bool:
        return self.recycle_files if self.recycle_files is not None else self.kind == "dram"

    @property
    def fsync_policy(self) -> str:
        if self.fsync is not None:
            return self.fsync
        return "never" if self.kind == "dram" else "file+dir"


@dataclass(frozen=True, slots=True)
class _Reservation:
    token: str
    size_bytes: int


class LocalWriter:
    """Writes one object into a temporary file mapped in memory; ``commit`` publishes it by
    rename. Stores that can receive straight into memory use :meth:`target`."""

    def __init__(self, tier: LocalTier, header: ObjectHeader, reservation: _Reservation) -> None:
        self._tier = tier
        self.header = header
        self._reservation = reservation
        self._offset = header.header_bytes
        self.tmp_path = tier.files.tmp_path(reservation.token)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._inode = -1
        self._view: memoryview | None = None
        self._done = False

    def _open(self) -> None:
        size = self.header.total_bytes
        try:
            reused = self._tier.files.take_spare(size, self.tmp_path)
            fd = os.open(self.tmp_path, os.O_RDWR if reused else os.O_CREAT | os.O_EXCL | os.O_RDWR,
                         0o644)
            self._fd = fd
            if reused:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)
            else:
                os.posix_fallocate(fd, 0, size)
            self._inode = os.fstat(fd).st_ino
            cached = self._tier.files.take_map(self._inode, size) if reused else None
            self._map = cached if cached is not None else mmap.mmap(fd, size, flags=MAP_FLAGS)
            self._view = memoryview(self._map)[:size]
            self._view[: self._offset] = self.header.encode()
        except OSError as exc:
            self.abort()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(
                    f"{self._tier.name}: no space on {self._tier.root} for {size} bytes"
                ) from exc
            raise StoreError(f"{self._tier.name}: cannot create {self.tmp_path}: {exc}") from exc

    def write_at(self, offset: int, data: Buffer) -> None:
        if self._view is None:
            raise StoreError(f"{self._tier.name}: write to a closed writer")
        start = self._offset + offset
        self._view[start : start + len(data)] = data

    def target(self, offset: int, length: int) -> memoryview | None:
        if self._view is None:
            raise StoreError(f"{self._tier.name}: write to a closed writer")
        start = self._offset + offset
        return self._view[start : start + length]

    def written(self, offset: int, length: int) -> None:
        return None

    def _unmap(self, flush: bool) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            if flush:
                self._map.flush()
            mapping, self._map = self._map, None
            if not self._tier.files.keep_map(self._inode, mapping):
                close_map(mapping)

    def commit(self) -> None:
        if self._done or self._fd is None:
            raise StoreError(f"{self._tier.name}: commit of a closed writer")
        policy = self._tier.config.fsync_policy
        try:
            self._unmap(flush=policy != "never")
            if policy != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            final = self._tier.files.path_of(self.header.key)
            self._tier.publish(self.tmp_path, final, self.header, self._reservation)
            if policy == "file+dir":
                self._tier.files.fsync_dir()
        except OSError as exc:
            self.abort()
            raise StoreError(f"{self._tier.name}: publish failed: {exc}") from exc
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):
            self._unmap(flush=False)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._tier.release(self._reservation)
        self._tier.discard(self.tmp_path)


class LocalTier(StoreLifecycle):
    """A DRAM or disk tier on this node; an
    :class:`~kvprefetch.agents.stores.base.ObjectStore` and a
    :class:`~kvprefetch.agents.stores.base.PayloadSink` (``open``) for the transfer engine.
    Books the objects and reservations and evicts by policy; its files are
    :attr:`files`."""

    def __init__(
        self,
        config: LocalTierConfig,
        *,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str | None = None,
        on_evict: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.config = config
        #: Told the keys the tier's own policy evicted to make room (not deletes), under
        #: the tier's lock: it must not block nor call the tier.
        self._on_evict = on_evict
        self.name = name or config.kind
        self.root = Path(config.path)
        self.policy = policy if policy is not None else make_policy(config.eviction)
        self._clock = clock
        self._lock = threading.Lock()
        #: Published objects (chunk key -> size on disk); reservations are apart.
        self._books = Tier(self.name, config.capacity_bytes, self.policy)
        self._reserved: dict[str, int] = {}
        self._reserved_bytes = 0
        self._stats = StatsCounter()
        self._started = False
        #: The folder's files, spares and kept mappings (under this tier's lock).
        self.files = TierFiles(self.root, self.name, config.capacity_bytes,
                               recycle=config.recycle, lock=self._lock)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Create the directory, drop leftovers of killed writes, index published objects."""
        self.files.mkdir()
        now = self._clock()
        with self._lock:
            # A list: making room below may rename files into spares while we index.
            for path in list(self.root.iterdir()):
                if path.name.startswith((TMP_PREFIX, SPARE_PREFIX)):
                    self.files.unlink_locked(path)
                    continue
                if not path.name.endswith(SUFFIX):
                    continue
                try:
                    header = self._read_header(path)
                    if path.stat().st_size != header.total_bytes:
                        raise CorruptObjectError(f"{path}: truncated")
                except (CorruptObjectError, OSError) as exc:
                    log.warning("%s: dropping unreadable %s: %s", self.name, path, exc)
                    path.unlink(missing_ok=True)
                    continue
                # A tier restarted with a smaller capacity keeps what fits, by policy.
                if self._evict_locked(header.total_bytes, exclude=header.key):
                    self._books.put(TierEntry(header.key, 0, header.total_bytes, now))
                else:
                    path.unlink(missing_ok=True)
            self.files.trim_spares_locked(self._used_bytes)
            self._started = True
            self.files.open = True
        budget = min(self.config.prewarm_bytes, self.config.capacity_bytes - self.used_bytes)
        self.files.prewarm(budget, self.config.prewarm_file_bytes)

    def discard(self, tmp_path: Path) -> None:
        """Drop an aborted write's file (kept for reuse when possible)."""
        try:
            size = tmp_path.stat().st_size
        except FileNotFoundError:
            return
        with self._lock:
            self.files.recycle_locked(tmp_path, size, self._used_bytes)

    def publish(self, tmp: Path, final: Path, header: ObjectHeader,
                reservation: _Reservation) -> None:
        """Atomically replace ``final`` by ``tmp`` and index the object."""
        now = self._clock()
        with self._lock:
            old = self._books.remove(header.key)
            if old is not None:
                self.files.recycle_locked(final, old.nbytes, self._used_bytes)
            os.replace(tmp, final)
            if self._reserved.pop(reservation.token, None) is not None:
                self._reserved_bytes -= reservation.size_bytes
            # The reservation's room becomes the object's (it was counted all along).
            self._books.put(TierEntry(header.key, 0, reservation.size_bytes, now))
            self.files.trim_spares_locked(self._used_bytes)
        self._stats.add(puts=1, bytes_written=header.payload_bytes)

    def close(self) -> None:
        self._started = False
        self.files.close()
        if self.config.remove_on_close:
            self.files.remove_all()

    @property
    def _used_bytes(self) -> int:
        """Published objects and reservations (the caller holds the lock)."""
        return self._books.used_bytes + self._reserved_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    def keys(self) -> list[str]:
        with self._lock:
            return [e.key for e in self._books]

    def path_of(self, key: str) -> Path:
        """Where the published object lies (for readers that map it, e.g. an LMCache L1)."""
        return self.files.path_of(key)

    # -- capacity ----------------------------------------------------------------------------

    def advise(self, next_use_s: Mapping[str, float], *, now_s: float | None = None) -> None:
        """The scheduler's predicted next use of keys, for the ``predicted`` policy (see
        :class:`~kvprefetch.agents.stores.eviction.PredictedNextUsePolicy`; ``lru`` ignores it).
        Keys need not be in the tier yet: an order's advice precedes its bytes."""
        self.policy.advise(next_use_s, now_s=now_s)

    def _evict_locked(self, need: int, *, exclude: str | None = None) -> bool:
        """Evict by policy until ``need`` more bytes fit beside the objects and the
        reservations (never ``exclude``). Evicts nothing and returns False if they cannot."""
        victims = self._books.victims_for(need + self._reserved_bytes, self._clock(),
                                          exclude=exclude)
        if victims is None:
            return False
        for entry in victims:
            self._books.remove(entry.key)
            self.files.recycle_locked(self.files.path_of(entry.key), entry.nbytes,
                                      self._used_bytes)
        if victims:
            self.policy.forget(e.key for e in victims)
            self._stats.add(evictions=len(victims))
            if self._on_evict is not None:
                self._on_evict([e.key for e in victims])
            log.debug("%s: evicted %d objects (%s)", self.name, len(victims), self.policy.name)
        return True

    def _reserve(self, header: ObjectHeader) -> _Reservation:
        size = header.total_bytes
        limit = self.config.max_object_bytes
        if limit is not None and header.payload_bytes > limit:
            raise ObjectTooLargeError(
                f"{header.key!r}: {header.payload_bytes} bytes exceed max_object_bytes={limit}"
            )
        if not self._started:
            raise StoreConfigError(f"tier {self.name!r} is not started")
        with self._lock:
            if size > self.config.capacity_bytes:
                raise TierFullError(
                    f"{self.name}: object {header.key!r} of {size} bytes exceeds the tier's "
                    f"capacity of {self.config.capacity_bytes} bytes"
                )
            if not self._evict_locked(size, exclude=header.key):
                raise TierFullError(
                    f"{self.name}: no room for {header.key!r} ({size} bytes): "
                    f"{self._used_bytes} of {self.config.capacity_bytes} bytes in use by "
                    "objects being written"
                )
            token = uuid.uuid4().hex
            self._reserved[token] = size
            self._reserved_bytes += size
            # Spare files stay within the free capacity; the write may take one of them.
            self.files.trim_for_write_locked(self._used_bytes)
            return _Reservation(token, size)

    def release(self, reservation: _Reservation) -> None:
        with self._lock:
            if self._reserved.pop(reservation.token, None) is not None:
                self._reserved_bytes -= reservation.size_bytes

    # -- sink --------------------------------------------------------------------------------

    def open(self, header: ObjectHeader) -> PayloadWriter:
        """Reserve room (evicting if needed) and open a writer for ``header``'s object.

        Raises :class:`TierFullError` when room cannot be made; nothing is written then.
        """
        writer = LocalWriter(self, header, self._reserve(header))
        writer._open()
        return writer

    # -- ObjectStore -------------------------------------------------------------------------

    def exists(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        with self._lock:
            return [OpResult(k, k in self._books) for k in keys]

    def _read_header(self, path: Path) -> ObjectHeader:
        with open(path, "rb") as f:
            prefix = f.read(PREFIX_BYTES)
            rest = f.read(header_length(prefix) - PREFIX_BYTES)
        return decode_header(prefix + rest)

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]:
        """Read and verify each object (every part's checksum) into ``sink`` or memory."""
        out = []
        for key in keys:
            check_cancel(cancel)
            out.append(self._stats.count_get(self._get_one(key, sink)))
        return out

    def _get_one(self, key: str, sink: PayloadSink | None) -> GetResult:
        with self._lock:
            entry = self._books.get(key)
            if entry is not None:
                entry.last_use_s = self._clock()
        if entry is None:
            return GetResult(key, error=ObjectNotFoundError(f"{key!r} not in {self.name}"))
        path = self.files.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return GetResult(key, error=ObjectNotFoundError(f"{key!r} was just evicted"))
        header: ObjectHeader | None = None
        writer: PayloadWriter | None = None
        try:
            with os.fdopen(fd, "rb", buffering=0) as f:
                prefix = f.read(PREFIX_BYTES)
                head = prefix + f.read(header_length(prefix) - PREFIX_BYTES)
                header = decode_header(head, expected_key=key)
                writer = (sink or MemorySink()).open(header)
                if isinstance(writer, MemoryWriter):
                    view = memoryview(writer.buffer)
                    if f.readinto(view) != header.payload_bytes or f.read(1):
                        raise CorruptObjectError(f"{key!r}: file length mismatch")
                    header.verify_payload(view)
                else:
                    buf = bytearray(min(header.part_bytes, header.payload_bytes))
                    for i in range(header.parts):
                        start, end = header.part_range(i)
                        part = memoryview(buf)[: end - start]
                        if f.readinto(part) != end - start:
                            raise CorruptObjectError(f"{key!r}: truncated in part {i}")
                        header.verify_part(i, part)
                        writer.write_at(start, part)
                writer.commit()
        except CorruptObjectError as exc:
            if writer is not None:
                writer.abort()
            log.warning("%s: corrupt object %r deleted: %s", self.name, key, exc)
            self._remove(key)
            return GetResult(key, header=header, error=exc)
        except StoreError as exc:
            if writer is not None:
                writer.abort()
            return GetResult(key, header=header, error=exc)
        data = memoryview(writer.buffer) if isinstance(writer, MemoryWriter) else None
        return GetResult(key, header=header, data=data, source=self.name)

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
    ) -> list[OpResult]:
        """Write each object (atomic publish). ``ttl_s`` is ignored: local tiers evict by
        policy. Raises :class:`ObjectTooLargeError` before writing anything."""
        headers = []
        for key, payload in items:
            validate_key(key)
            headers.append(make_header(key, payload, self.config.part_bytes))
            limit = self.config.max_object_bytes
            if limit is not None and len(payload) > limit:
                raise ObjectTooLargeError(
                    f"{key!r}: {len(payload)} bytes exceed max_object_bytes={limit}"
                )
        out = []
        for (key, payload), header in zip(items, headers, strict=True):
            check_cancel(cancel)
            try:
                writer = self.open(header)
                try:
                    writer.write_at(0, payload)
                    writer.commit()
                except BaseException:
                    writer.abort()
                    raise
            except StoreError as exc:
                out.append(OpResult(key, False, exc))
                continue
            out.append(OpResult(key, True))
        return out

    def _remove(self, key: str) -> bool:
        with self._lock:
            entry = self._books.remove(key)
            if entry is not None:
                self.files.recycle_locked(self.files.path_of(key), entry.nbytes,
                                          self._used_bytes)
                self.policy.forget((key,))
        return entry is not None

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        out = []
        for key in keys:
            gone = self._remove(key)
            if gone:
                self._stats.add(deletes=1)
            out.append(OpResult(key, gone))
        return out


__all__ = ["LocalTier", "LocalTierConfig", "LocalWriter", "close_map", "tier_file_name"]
