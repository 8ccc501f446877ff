"""Appending to the event journal (the format: :mod:`kvprefetch.controlplane.journal.file`).

Crash safety: the writer appends each record as one unbuffered ``write`` of one complete
line, so a crash can only tear the *last* line. Every reader ignores a torn last line (one
without its final newline that does not check out) and logs a warning; on opening an
existing journal the writer first cuts such a torn tail, so appending never buries it.

Failed writes (a full disk, a file-size limit): the writer remembers the journal's size
before each record and, when the write fails part-way, truncates the file back to it, so a
record whose write raised never reaches the journal later; nothing stays buffered. Until
the cut succeeds the writer refuses to append (a partial line must not be buried).

File mode: the writer creates the journal with mode 0600 (:data:`JOURNAL_MODE`: events
name tenants and sessions).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

import pydantic_core

from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.base.types import SessionEvent
from kvprefetch.controlplane.journal.file import (
    CRC_KEY,
    HEADER_KEY,
    JOURNAL_MODE,
    JOURNAL_VERSION,
    EpochRecord,
    StopRecord,
    encode_checked,
    encode_line,
    event_to_dict,
    is_header_line,
    verify_checksum,
)

_log = logging.getLogger(__name__)


class JournalFile(Protocol):
    """The journal file as the writer uses it: unbuffered appends (``write`` returns how
    many bytes went to the OS), ``truncate`` to cut a failed write away, ``fileno`` for
    ``fsync``. A test wraps the real one to fail writes on demand."""

    def write(self, data: bytes | memoryview, /) -> int | None: ...

    def truncate(self, size: int, /) -> int: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


#: Opens the journal for appending (called by :meth:`JournalWriter.open`).
JournalOpener = Callable[[Path], JournalFile]


def open_journal_file(path: Path) -> JournalFile:
    """The journal opened for unbuffered appends, created with :data:`JOURNAL_MODE`."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, JOURNAL_MODE)
    return open(fd, "ab", buffering=0)


class JournalWriter:
    """Appends session events to a journal file, one checksummed line each.

    Called by the live control plane for every event it observes (often: once per request
    start and finish, plus hints), from any thread, and once per scheduler start
    (:meth:`write_epoch`) and clean stop (:meth:`write_stop`). The constructor does no I/O;
    :meth:`open` (or ``with``) creates the file with its header, or reopens an existing
    journal for appending after cutting a torn last line. Each record is one unbuffered
    ``write`` of one complete line, handed to the OS before the call returns; a write that
    fails raises :class:`OSError` with the file cut back to its size before the record
    (see the module docstring), and :attr:`failure` says why until a write succeeds.
    :meth:`flush` with ``sync=True`` fsyncs. ``opener`` opens the file (default
    :func:`open_journal_file`).
    """

    def __init__(self, path: str | Path, *, metadata: Mapping[str, Any] | None = None,
                 opener: JournalOpener = open_journal_file) -> None:
        self.path = Path(path)
        self._metadata = dict(metadata or {})
        self._opener = opener
        self._file: JournalFile | None = None
        self._lock = threading.Lock()
        #: The journal's size in bytes: whole records only.
        self._size = 0
        #: A failed write left bytes past ``_size`` that are not cut away yet.
        self._dirty = False
        #: Why the last write failed (None: it did not, or a later one succeeded).
        self.failure: str | None = None

    def open(self) -> Self:
        if self._file is not None:
            return self
        if self.path.name.endswith(".gz"):
            raise TraceFormatError("cannot append to a compressed journal", path=self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cut_torn_tail()
        file = self._opener(self.path)
        self._file, self._size, self._dirty = file, os.fstat(file.fileno()).st_size, False
        if self._size == 0:
            try:
                self._append(encode_line({HEADER_KEY: JOURNAL_VERSION, **self._metadata}))
            except BaseException:
                self.close()
                raise
        return self

    def write(self, event: SessionEvent) -> None:
        self._append(encode_checked(event_to_dict(event)))

    def write_epoch(self, record: EpochRecord) -> None:
        """Record a scheduler start (see :class:`EpochRecord`)."""
        self._append(encode_checked(record.to_dict()))

    def write_stop(self, record: StopRecord) -> None:
        """Record a clean stop (see :class:`StopRecord`): the journal's last record."""
        self._append(encode_checked(record.to_dict()))

    def _append(self, data: bytes) -> None:
        """Write ``data`` whole, or raise OSError with the journal as it was before."""
        with self._lock:
            self._write_locked(self._open_file(), data)
            self._size += len(data)

    def probe(self, nbytes: int = 4096) -> None:
        """Whether the journal takes ``nbytes`` more: a blank line of that size (readers
        skip blank lines) written and cut away again; OSError when it does not fit. Clears
        :attr:`failure` when it does. For health checks after a failed write."""
        with self._lock:
            file = self._open_file()
            self._write_locked(file, b" " * (nbytes - 1) + b"\n")
            self._cut_back(file)

    def _write_locked(self, file: JournalFile, data: bytes) -> None:
        if self._dirty:
            self._cut_back(file)
        try:
            _write_all(file, data)
        except OSError as exc:
            self.failure = exc.strerror or type(exc).__name__
            try:
                self._cut_back(file)
            except OSError as cut:
                _log.error("journal %s: cannot cut a failed write away (%s); appending "
                           "stays refused until it can", self.path, cut)
            raise
        self.failure = None

    def _open_file(self) -> JournalFile:
        if self._file is None:
            raise RuntimeError("JournalWriter is not open; call open() or use 'with'")
        return self._file

    def _cut_back(self, file: JournalFile) -> None:
        """Truncate the journal to its whole records (after a failed write)."""
        self._dirty = True
        file.truncate(self._size)
        self._dirty = False

    def flush(self, *, sync: bool = False) -> None:
        """Records are with the OS once written; ``sync`` also fsyncs them to the disk."""
        with self._lock:
            if self._file is None:
                return
            if sync:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _cut_torn_tail(self) -> None:
        """Drop a partial last line left by a crash, and refuse to append to a non-journal."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with self.path.open("r+b") as f:
            if not is_header_line(f.readline()):
                raise TraceFormatError(
                    "not a kvprefetch journal (no header line); refusing to append: "
                    "`kvprefetch journal check --repair` mends a journal that lost it",
                    path=self.path, line=1)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return
            # Find the last newline; everything after it is the torn line.
            position = size
            while position > 0:
                step = min(65536, position)
                f.seek(position - step)
                chunk = f.read(step)
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    position = position - step + cut + 1
                    break
                position -= step
            f.seek(position)
            if _whole_record(f.read(size - position)):
                # A complete record that only lacks its newline: readers accept it, keep it.
                f.seek(size)
                f.write(b"\n")
                return
            _log.warning(
                "%s: cutting a torn last line (%d bytes) before appending",
                self.path,
                size - position,
            )
            f.truncate(position)


def _write_all(file: JournalFile, data: bytes) -> None:
    """Every byte of ``data``, through short writes (a file-size limit writes what fits,
    then fails)."""
    view = memoryview(data)
    while view:
        n = file.write(view)
        if not n:
            raise OSError(errno.EIO, "the journal accepted no bytes")
        view = view[n:]


def _whole_record(raw: bytes) -> bool:
    """Whether a last line without its newline is a record readers accept: its checksum
    matches, or it has none and is a JSON object without one (a journal from before
    checksums)."""
    verified = verify_checksum(raw)
    if verified is not None:
        return verified
    try:
        obj = pydantic_core.from_json(raw)
    except ValueError:
        return False
    return isinstance(obj, dict) and CRC_KEY not in obj
