"""The files of a node-local tier: one per object named by a hash of its key, hidden
temporary files while written, and spare files kept for reuse with their memory mappings
(see :mod:`kvprefetch.agents.stores.local`). Capacity is the tier's: the methods that keep
or create spares take the bytes the tier has in use."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import uuid
from pathlib import Path

import xxhash

from kvprefetch.agents.stores.errors import StoreConfigError

log = logging.getLogger(__name__)
SUFFIX = ".kvp"
TMP_PREFIX = ".tmp-"
SPARE_PREFIX = ".spare-"
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def tier_file_name(key: str) -> str:
    """The file that holds ``key`` in a tier's folder: its xxh3-128 hex digest and the
    tier's suffix (the tier's one naming rule, shared with readers of the same folder)."""
    return xxhash.xxh3_128_hexdigest(key.encode("utf-8")) + SUFFIX


def close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a caller still holds a view; the GC unmaps it later
        log.debug("a tier mapping is still exported")


class TierFiles:
    """Spare files and kept mappings of one tier's folder. ``lock`` is the tier's: methods
    named ``*_locked`` expect the caller to hold it, the others take it.

    Invariants: spare bytes stay within the capacity the tier's objects and reservations
    leave free; a kept mapping belongs to a file that exists (closed when it is unlinked);
    a writer takes its file's mapping out while it writes.
    """

    def __init__(self, root: Path, name: str, capacity_bytes: int, *, recycle: bool,
                 lock: threading.Lock) -> None:
        self.root = root
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.recycle = recycle
        self._lock = lock
        #: Whether writers may leave their mappings here (between start and close).
        self.open = False
        self.spares: list[tuple[int, Path]] = []  # (size, path) of reusable files
        self.spare_bytes = 0
        #: Mappings of the tier's files kept for reuse (recycling on), by inode.
        self.maps: dict[int, mmap.mmap] = {}

    def mkdir(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreConfigError(f"{self.name}: cannot create {self.root}: {exc}") from exc

    def path_of(self, key: str) -> Path:
        return self.root / tier_file_name(key)

    def tmp_path(self, token: str) -> Path:
        return self.root / f"{TMP_PREFIX}{token}"

    def prewarm(self, budget: int, size: int) -> None:
        """Create spare files of ``size`` bytes (mapped when recycling) up to ``budget``."""
        while budget >= size:
            path = self.root / f"{SPARE_PREFIX}{uuid.uuid4().hex}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size, flags=MAP_FLAGS) if self.recycle else None
                inode = os.fstat(fd).st_ino
            except OSError as exc:
                os.close(fd)
                path.unlink(missing_ok=True)
                log.warning("%s: prewarm stopped: %s", self.name, exc)
                break
            os.close(fd)
            with self._lock:
                self.spares.append((size, path))
                self.spare_bytes += size
                if mapping is not None:
                    self.maps[inode] = mapping
            budget -= size

    def take_map(self, inode: int, size: int) -> mmap.mmap | None:
        """The kept mapping of file ``inode`` if it covers ``size`` bytes (for a writer)."""
        with self._lock:
            mapping = self.maps.pop(inode, None)
        if mapping is not None and len(mapping) < size:
            close_map(mapping)
            return None
        return mapping

    def keep_map(self, inode: int, mapping: mmap.mmap) -> bool:
        """Keep a writer's mapping of file ``inode`` for its next write (recycling on)."""
        if not self.recycle or not self.open:
            return False
        with self._lock:
            old = self.maps.get(inode)
            if old is not None and old is not mapping:
                return False
            self.maps[inode] = mapping
        return True

    def unlink_locked(self, path: Path) -> None:
        """Unlink one of the tier's files and close its kept mapping (frees its memory)."""
        if self.maps:
            try:
                inode = path.stat().st_ino
            except FileNotFoundError:
                return
            mapping = self.maps.pop(inode, None)
            if mapping is not None:
                close_map(mapping)
        path.unlink(missing_ok=True)

    def take_spare(self, size: int, dest: Path) -> bool:
        """Move a reusable file to ``dest`` (the smallest that fits, else the largest)."""
        with self._lock:
            if not self.spares:
                return False
            fitting = [s for s in self.spares if s[0] >= size]
            choice = min(fitting) if fitting else max(self.spares)
            self.spares.remove(choice)
            self.spare_bytes -= choice[0]
        os.replace(choice[1], dest)
        return True

    def recycle_locked(self, path: Path, size: int, used_bytes: int) -> None:
        """Keep ``path`` for reuse if the tier has room for it beside ``used_bytes``, else
        delete it."""
        if self.recycle and used_bytes + self.spare_bytes + size <= self.capacity_bytes:
            spare = self.root / f"{SPARE_PREFIX}{uuid.uuid4().hex}"
            try:
                os.replace(path, spare)
            except FileNotFoundError:
                return
            self.spares.append((size, spare))
            self.spare_bytes += size
        else:
            self.unlink_locked(path)

    def trim_spares_locked(self, used_bytes: int) -> None:
        """Delete spares until they fit beside ``used_bytes``."""
        while self.spares and used_bytes + self.spare_bytes > self.capacity_bytes:
            size, path = self.spares.pop()
            self.spare_bytes -= size
            self.unlink_locked(path)

    def trim_for_write_locked(self, used_bytes: int) -> None:
        """Delete spares until all but the last fit beside ``used_bytes`` (which counts a
        new reservation): the write may take that one."""
        while self.spares and (used_bytes + self.spare_bytes - self.spares[-1][0]
                               > self.capacity_bytes):
            spare_size, spare_path = self.spares.pop()
            self.spare_bytes -= spare_size
            self.unlink_locked(spare_path)

    def fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove_all(self) -> None:
        """Delete every file of the tier's naming (objects, spares, partial writes) and
        the folder if nothing else is left in it. After :meth:`close`."""
        if not self.root.is_dir():
            return
        for path in list(self.root.iterdir()):
            if path.name.endswith(SUFFIX) or path.name.startswith((TMP_PREFIX, SPARE_PREFIX)):
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # something else lives there: keep the folder
            self.root.rmdir()

    def close(self) -> None:
        """Close every kept mapping (the files stay)."""
        self.open = False
        with self._lock:
            maps, self.maps = self.maps, {}
        for mapping in maps.values():
            close_map(mapping)
