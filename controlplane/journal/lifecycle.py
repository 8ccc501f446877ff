"""The scheduler service's journal over its life: replayed at start, opened for appending
with the incarnation's epoch record, flushed by the control loop, compacted, ended with a
stop record.

:class:`ServiceJournal` is the service's room for it; the records themselves and their
checks live in :mod:`kvprefetch.controlplane.journal.live`.

* Replay (:meth:`ServiceJournal.replay`): through the driver's ``resume``; damaged records
  are quarantined to a side file and counted, never a failed start-up (Ray would restart
  the scheduler into the same record forever).
* Fails closed: a call whose event cannot be journalled (a full disk) raises
  :class:`~kvprefetch.controlplane.base.errors.JournalUnavailableError` (503) having
  changed nothing; :meth:`ServiceJournal.check_health` reports the journal unwritable until
  it takes records again.
* Durability: every record is handed to the OS when written (a killed service loses no
  acknowledged event); the control loop fsyncs every ``journal_sync_interval_s``.
* Compaction (:func:`~kvprefetch.controlplane.journal.compaction.compact_journal`): at
  start-up after a long replay, and in a background thread once ``journal_compact_records``
  records were written since the last one (and as many as that one kept). The journal is
  rewritten atomically without closed sessions' records, so a resume costs the live
  sessions' events, not the history; of the route records, those of live sessions and of
  cancels stay while the service remembers their request ids.

Threading: :meth:`~ServiceJournal.compact` runs on its own thread and takes the service's
lock only to note where the journal ends and to swap the files; every other method runs
under the service's lock or before the control loop starts.

What it needs of the service is stated as protocols (:class:`JournalSettings`,
:class:`JournalledDriver`, :class:`ServiceTime`), which the service's config, driver and
clock (:mod:`kvprefetch.controlplane.live`) meet: the journal sits below the live service
in the layers and imports none of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from kvprefetch.controlplane.base.errors import JournalUnavailableError
from kvprefetch.controlplane.journal.compaction import (
    compact_journal,
    live_records,
    publish_compacted,
    write_compacted,
)
from kvprefetch.controlplane.journal.file import (
    EpochRecord,
    StopRecord,
    TimeLimits,
    quarantine,
)
from kvprefetch.controlplane.journal.live import LiveJournalScanner, LiveJournalWriter
from kvprefetch.controlplane.journal.writer import JournalOpener

log = logging.getLogger(__name__)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class JournalSettings(Protocol):
    """What the journal reads of the service's config (``ServiceConfig``)."""

    @property
    def journal_path(self) -> str | None: ...

    @property
    def journal_sync_interval_s(self) -> float: ...

    @property
    def journal_compact_records(self) -> int: ...

    @property
    def time_compression(self) -> float: ...

    @property
    def policy_spec(self) -> _Named: ...


class ServiceTime(Protocol):
    """The service's clock: service seconds now."""

    def now_s(self) -> float: ...


class JournalCounters(Protocol):
    """The service's counters the journal keeps."""

    journal_quarantined: int
    journal_compactions: int
    journal_records_dropped: int
    loop_errors: int


class _Session(Protocol):
    @property
    def sid(self) -> str: ...


class JournalledDriver(Protocol):
    """What the journal needs of the service's driver (``LiveDriver``): its replay, the
    writer it journals through, the records written since the last compaction, the live
    sessions and remembered route ids a compaction keeps, and its counters."""

    journal: LiveJournalWriter | None
    journal_records: int

    @property
    def stats(self) -> JournalCounters: ...

    @property
    def registry(self) -> Iterable[_Session]: ...

    @property
    def routes(self) -> Iterable[tuple[str, str]]: ...

    def resume(self, path: Path, limits: TimeLimits) -> LiveJournalScanner: ...


class ServiceJournal:
    """The journal of one :class:`~kvprefetch.controlplane.live.service.SchedulerService`
    (a no-op without ``config.journal_path``). ``wall`` is the service's monotonic clock
    (seconds), ``calendar`` Unix seconds (the journal's time checks), ``stopping`` says
    whether the service is closing (a compaction under way then gives up)."""

    def __init__(self, config: JournalSettings, clock: ServiceTime, lock: threading.RLock, *,
                 wall: Callable[[], float], calendar: Callable[[], float],
                 opener: JournalOpener, stopping: Callable[[], bool]) -> None:
        self.config = config
        self.path = Path(config.journal_path) if config.journal_path is not None else None
        self._clock = clock
        self._lock = lock
        self._wall = wall
        self._calendar = calendar
        #: Opens the journal file (a test injects one whose writes fail on demand).
        self._opener = opener
        self._stopping = stopping
        #: The open writer (None: no journal, or not open yet, or closed).
        self.writer: LiveJournalWriter | None = None
        self._driver: JournalledDriver | None = None
        #: The background compaction under way, if any.
        self._compactor: threading.Thread | None = None
        #: Records the journal kept at its last compaction (the next waits for as many).
        self._kept = 0
        self._last_sync = 0.0

    def metadata(self) -> dict[str, Any]:
        """The header's free metadata."""
        return {"source": "kvprefetch-service", "policy": self.config.policy_spec.name,
                "time_compression": self.config.time_compression}

    # ------------------------------------------------------------------ start
    def replay(self, driver: JournalledDriver) -> tuple[int, int]:
        """Replay an existing, non-empty journal into ``driver`` (and compact it when it
        held ``journal_compact_records`` records or more). Returns (the last epoch it
        records, the next sequence number); (0, 1) without one."""
        path = self.path
        if path is None or not path.exists() or path.stat().st_size == 0:
            return 0, 1
        scan = self._resume(driver, path)
        limit = self.config.journal_compact_records
        if limit and scan.records >= limit:
            self._compact_at_start(driver, path)
        return scan.last_epoch, scan.last_seq + 1

    def open(self, driver: JournalledDriver, next_seq: int, epoch: int) -> None:
        """Open the journal for appending (numbers from ``next_seq`` on) and record this
        incarnation's start, fsynced, before any call is taken."""
        self._driver = driver
        if self.path is None:
            return
        self.writer = driver.journal = LiveJournalWriter(
            self.path, metadata=self.metadata(), next_seq=next_seq,
            opener=self._opener).open()
        self.writer.write_epoch(EpochRecord(epoch, self._clock.now_s(), self._calendar(),
                                            self.config.time_compression))
        self.writer.flush(sync=True)

    def _resume(self, driver: JournalledDriver, path: Path) -> LiveJournalScanner:
        """Replay the journal; quarantine its damaged records. Returns the scan (last
        epoch, last sequence number, records read)."""
        scan = driver.resume(path, TimeLimits(now_wall_s=self._calendar()))
        damaged = scan.damaged
        if damaged:
            driver.stats.journal_quarantined = len(damaged)
            try:
                side = quarantine(path, damaged, wall_s=self._calendar())
            except OSError as exc:  # the records were skipped all the same
                log.error("journal %s: could not quarantine %d damaged records: %s", path,
                          len(damaged), exc)
            else:
                lines = ", ".join(f"{d.line} ({d.reason})" for d in damaged[:10])
                log.warning("journal %s: %d damaged records skipped and moved to %s: lines %s%s",
                            path, len(damaged), side, lines,
                            " ..." if len(damaged) > 10 else "")
        return scan

    def _compact_at_start(self, driver: JournalledDriver, path: Path) -> None:
        """Before the writer opens it: the journal without closed sessions' records (a
        failure is logged; the journal stays as it was)."""
        t0 = self._wall()
        try:
            result = compact_journal(path, metadata=self.metadata(),
                                     routes=set(driver.routes))
        except OSError as exc:
            log.error("journal %s: compaction failed: %s", path, exc)
            return
        if result.damaged:
            log.error("journal %s: not compacted: %d damaged records left in it", path,
                      result.damaged)
            return
        self._kept = result.records_after
        driver.stats.journal_compactions += 1
        driver.stats.journal_records_dropped += result.records_before - result.records_after
        log.info("journal %s compacted at start-up in %.2f s: %d records -> %d (%.1f -> "
                 "%.1f MiB)", path, self._wall() - t0, result.records_before,
                 result.records_after, result.bytes_before / (1 << 20),
                 result.bytes_after / (1 << 20))

    # ------------------------------------------------------------------ running
    def check_health(self) -> None:
        """Raise :class:`JournalUnavailableError` while the journal takes no records (see
        :meth:`LiveJournalWriter.check_writable`); no I/O while it is healthy."""
        writer = self.writer
        if writer is not None:
            writer.check_writable()

    def tick(self, wall: float) -> None:
        """From the control loop, once per iteration (``wall``: its start): records are
        already with the OS; fsync them every ``journal_sync_interval_s``, and start a
        compaction when one is due."""
        if self.writer is None:
            return
        sync = wall - self._last_sync > self.config.journal_sync_interval_s
        if sync:
            self._last_sync = wall
        self.writer.flush(sync=sync)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Compact in the background once ``journal_compact_records`` records (and as many
        as the last compaction kept) were written since."""
        limit, driver = self.config.journal_compact_records, self._driver
        if not limit or self.writer is None or driver is None or (
                self._compactor is not None and self._compactor.is_alive()):
            return
        if driver.journal_records < max(limit, self._kept):
            return
        self._compactor = threading.Thread(target=self.compact,
                                           name="kvprefetch-journal-compaction", daemon=True)
        self._compactor.start()

    def compact(self) -> bool:
        """Compact the journal while the service runs: under the lock, note where the
        journal ends and which sessions are live; without it, copy their records to a new
        file; under the lock again, append what was written meanwhile, rename the copy
        over the journal and reopen the writer on it. Returns whether it compacted (a
        failure is logged and counted in ``loop_errors``; the journal stays as it was)."""
        journal, driver = self.writer, self._driver
        if journal is None or driver is None:
            return False
        path, t0 = journal.path, self._wall()
        try:
            with self._lock:
                journal.flush()
                upto = path.stat().st_size
                live = {info.sid for info in driver.registry}
                routes = set(driver.routes)
                written, driver.journal_records = driver.journal_records, 0
            records, read, damaged = live_records(path, upto, live, routes)
            if damaged:
                log.error("journal %s: not compacted: %d damaged records (the next start "
                          "quarantines them)", path, damaged)
                with self._lock:
                    driver.journal_records += written
                return False
            tmp = write_compacted(path, records, self.metadata())
            with self._lock:
                if self._stopping() or self.writer is not journal:
                    tmp.unlink(missing_ok=True)
                    return False
                journal.flush()
                size = publish_compacted(tmp, path, upto)
                journal.close()
                journal.open()
                self._kept = len(records) + 1
                driver.stats.journal_compactions += 1
                driver.stats.journal_records_dropped += read - len(records) - 1
        except Exception:
            driver.stats.loop_errors += 1
            log.exception("journal %s: compaction failed; the journal stays as it was", path)
            return False
        log.info("journal %s compacted in %.2f s: %d records -> %d (%d live sessions, "
                 "%.1f MiB)", path, self._wall() - t0, read, len(records) + 1, len(live),
                 size / (1 << 20))
        return True

    # ------------------------------------------------------------------ stop
    def close(self, epoch: int) -> None:
        """Once the service is stopping: wait for a compaction under way (it gives up),
        then end the journal with a stop record (the scheduler stopped cleanly), fsynced."""
        if self._compactor is not None:
            self._compactor.join(timeout=60)
            self._compactor = None
        if self.writer is None:
            return
        with self._lock:
            try:
                self.writer.write_stop(StopRecord(epoch, self._clock.now_s(),
                                                  self._calendar()))
                self.writer.flush(sync=True)
            except (JournalUnavailableError, OSError) as exc:
                log.error("journal %s: not closed cleanly: %s", self.writer.path, exc)
            self.writer.close()
            self.writer = None
