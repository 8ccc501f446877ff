"""The live scheduler's journal: the trace journal
(:mod:`kvprefetch.controlplane.journal.file`) with what an exact resume needs beyond a
:class:`~kvprefetch.controlplane.base.types.SessionEvent` (its compaction:
:mod:`kvprefetch.controlplane.journal.compaction`).

Chunk names: a session whose client sent token ids or chunk hashes names its chunks by
content. The event that changed them (a ``request_started`` with token ids, a
``request_finished`` with chunk hashes) carries the change in the optional key ``keys``:
``{"keep": n, "add": [...]}``, the session's hashes are its first ``n`` old ones followed by
``add`` (a new turn's chained hashes share the old prefix, so a turn adds a few hashes, not
the whole context). The key sits inside the record's checksum; readers of the trace journal
ignore it (version 1 gains optional keys), so the format version stays 1.

Order: every record the scheduler writes starts with its sequence number, ``{"seq": n,
...``, one more than the record before it (across restarts; compaction keeps the numbers,
so gaps are normal). A record whose number is not above the last one read is a duplicated
or reordered line, which a checksum cannot catch: it is damaged like a record that fails
its checksum. So is a record with values no live call can produce (token counts above the
API's limit, a node outside the fleet, a hint ETA over a day, a session id or tenant the API
refuses): start-up never acts on them.

Lost records: the numbers also tell what a damaged region held. Between two trusted
records, the missing numbers are records lost (:class:`LostRecords`): exactly so in a
journal never compacted, at most so in a compacted one (there, gaps are normal).

Failing closed: a record whose write fails (a full disk) is cut away again
(:mod:`kvprefetch.controlplane.journal.writer`) and :class:`LiveJournalWriter` raises
:class:`~kvprefetch.controlplane.base.errors.JournalUnavailableError` (503, a short
message; the path and the OS error go to the log); its sequence number is used again by
the next record, so a failed write leaves no gap.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic_core

from kvprefetch.controlplane.base.errors import InvalidRequestError, JournalUnavailableError
from kvprefetch.controlplane.base.names import check_session_id, check_tenant_name
from kvprefetch.controlplane.base.types import SessionEvent, SessionKey
from kvprefetch.controlplane.journal.file import (
    HEADER_KEY,
    EpochRecord,
    JournalScanner,
    RouteRecord,
    StopRecord,
    TimeLimits,
    event_to_dict,
)
from kvprefetch.controlplane.journal.file import UntrustedLine as _Damaged
from kvprefetch.controlplane.journal.file import encode_checked as _encode_checked
from kvprefetch.controlplane.journal.writer import (
    JournalOpener,
    JournalWriter,
    open_journal_file,
)

log = logging.getLogger(__name__)

#: The optional key of an event record that changes the session's chunk hashes.
KEYS_KEY = "keys"
_KEYS_MARK = b'"keys":'
#: A chunk hash as the API takes it (1-128 characters, no '/'), see ``api.RouteQuery``.
_HASH = re.compile(r"[^/\s]{1,128}")
#: More hashes than any one record can carry (the API's limit is far below).
_MAX_HASHES = 1_000_000
#: The sequence number's key, first in every record the scheduler writes.
SEQ_KEY = "seq"
_SEQ_HEAD = re.compile(rb'\{"seq":(\d{1,19}),')
#: The most tokens a live call may give (the API's ``Tokens`` bound).
MAX_TOKENS = 100_000_000
#: The longest hint ETA a live call may give (seconds).
MAX_ETA_S = 86_400.0
#: A request id as the API takes it (``api.RequestId``) and a route record's digest.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=-]{1,64}")
_DIGEST = re.compile(r"[0-9a-f]{1,64}")
#: The largest epoch an order id can carry (``epoch << 32 | n`` below 2^63).
MAX_EPOCH = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class KeysChange:
    """A session's chunk hashes after an event: its first ``keep`` old ones, then ``add``."""

    keep: int
    add: tuple[str, ...]

    @classmethod
    def between(cls, old: Sequence[str] | None, new: Sequence[str]) -> KeysChange:
        keep = 0
        if old:
            limit = min(len(old), len(new))
            while keep < limit and old[keep] == new[keep]:
                keep += 1
        return cls(keep, tuple(new[keep:]))

    def apply(self, old: Sequence[str] | None) -> tuple[str, ...]:
        return tuple((old or ())[: self.keep]) + self.add

    def to_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "add": list(self.add)}

    @classmethod
    def parse(cls, value: Any) -> KeysChange:
        """From a record's ``keys`` value; ValueError naming what is wrong."""
        if not isinstance(value, dict) or set(value) != {"keep", "add"}:
            raise ValueError("keys: expected {\"keep\": n, \"add\": [...]}")
        keep, add = value["keep"], value["add"]
        if type(keep) is not int or not 0 <= keep <= _MAX_HASHES:
            raise ValueError(f"keys.keep: expected 0..{_MAX_HASHES}, got {keep!r}")
        if not isinstance(add, list) or len(add) + keep > _MAX_HASHES or not all(
                isinstance(h, str) and _HASH.fullmatch(h) for h in add):
            raise ValueError("keys.add: expected a list of chunk hashes (1-128 characters)")
        return cls(keep, tuple(add))


class LiveJournalWriter(JournalWriter):
    """The scheduler's writer: numbered records, events with their chunk-name changes (see
    the module docstring). Called under the service's lock for every session event and
    once per start and stop; ``next_seq`` continues the numbers of the journal it appends
    to. A record whose write fails raises :class:`JournalUnavailableError` and is not in
    the journal; the first failure of a run is logged as an error with the path and the
    OS error, the return to health as a warning."""

    def __init__(self, path: str | Path, *, metadata: Mapping[str, Any] | None = None,
                 next_seq: int = 1, opener: JournalOpener = open_journal_file) -> None:
        super().__init__(path, metadata=metadata, opener=opener)
        self.next_seq = next_seq
        #: Record writes refused since the journal was opened.
        self.failed_writes = 0
        self._failing = False
        self._log_lock = threading.Lock()

    def write_event(self, event: SessionEvent, keys: KeysChange | None = None) -> None:
        row = {SEQ_KEY: 0, **event_to_dict(event)}
        if keys is not None:
            row[KEYS_KEY] = keys.to_dict()
        self._numbered(row)

    def write_epoch(self, record: EpochRecord) -> None:
        self._numbered({SEQ_KEY: 0, **record.to_dict()})

    def write_stop(self, record: StopRecord) -> None:
        self._numbered({SEQ_KEY: 0, **record.to_dict()})

    def write_route(self, record: RouteRecord) -> None:
        self._numbered({SEQ_KEY: 0, **record.to_dict()})

    def _numbered(self, row: dict[str, Any]) -> None:
        row[SEQ_KEY] = self.next_seq
        try:
            self._append(_encode_checked(row))
        except OSError as exc:
            raise self._unavailable(exc) from None
        self.next_seq += 1  # only once written: a failed write leaves no gap
        self._healthy()

    def check_writable(self) -> None:
        """Raise :class:`JournalUnavailableError` while the journal takes no records: after
        a failed write, a probe (:meth:`probe`) says whether space returned. No I/O while
        writes succeed. For the service's health check."""
        if self.failure is None:
            return
        try:
            self.probe()
        except OSError as exc:
            raise self._unavailable(exc, probe=True) from None
        self._healthy()

    def _unavailable(self, exc: OSError, *, probe: bool = False) -> JournalUnavailableError:
        why = exc.strerror or type(exc).__name__
        with self._log_lock:
            first, self._failing = not self._failing, True
            if not probe:
                self.failed_writes += 1
        if first:
            log.error("journal %s: cannot write (%s); calls that record events are refused "
                      "with 503 until it can", self.path, exc)
        return JournalUnavailableError(f"the scheduler's journal cannot be written ({why}); "
                                       "nothing was recorded, the call may be sent again")

    def _healthy(self) -> None:
        if self._failing:
            with self._log_lock:
                self._failing = False
            log.warning("journal %s: writable again (%d record writes were refused)",
                        self.path, self.failed_writes)


@dataclass(frozen=True, slots=True)
class LostRecords:
    """Sequence numbers ``first_seq..last_seq`` missing between two trusted records, and
    the damaged lines between them (none: whole lines removed, or compacted away). In a
    journal never compacted (``exact``) each number is a record lost; in a compacted one
    (or one whose header is damaged) at most so."""

    first_seq: int
    last_seq: int
    damaged_lines: tuple[int, ...]
    exact: bool

    @property
    def records(self) -> int:
        return self.last_seq - self.first_seq + 1

    def to_dict(self) -> dict[str, Any]:
        return {"first_seq": self.first_seq, "last_seq": self.last_seq,
                "records": self.records, "exact": self.exact,
                "damaged_lines": list(self.damaged_lines)}


class LiveJournalScanner(JournalScanner):
    """The trace journal's scanner that also reads ``keys``: after each ``(line, event)``
    it yields, :attr:`keys` is that event's :class:`KeysChange` (None when it has none). A
    ``keys`` value that does not parse makes its record damaged like any other.

    It also accounts for lost records (see the module docstring): :meth:`lost` lists the
    gaps in the sequence numbers, :attr:`trailing_damaged` the damaged lines after the
    last numbered record (what they held is unknown)."""

    def __init__(self, path: str | Path, *, limits: TimeLimits | None = None,
                 nodes: int | None = None) -> None:
        super().__init__(path, limits=limits)
        #: The fleet's node slots: an event naming another node is damaged.
        self.nodes = nodes
        self.keys: KeysChange | None = None
        #: The last sequence number read (0: none yet), and the last record's bytes.
        self.last_seq = 0
        self.last_raw = b""
        #: Whether the last record :meth:`lines` yielded is a scheduler-start record.
        self.last_line_was_epoch = False
        #: The header's ``compacted`` mark (gaps in the numbers are then normal).
        self.compacted = False
        self._gaps: list[tuple[int, int, tuple[int, ...]]] = []
        #: Damaged lines since the last numbered record (after the scan: at the end).
        self.trailing_damaged: list[int] = []
        self._numbered_line = 0

    def lost(self) -> list[LostRecords]:
        """The gaps in the sequence numbers read so far (see :class:`LostRecords`)."""
        exact = self.header_ok and not self.compacted
        return [LostRecords(a, b, lines, exact) for a, b, lines in self._gaps]

    def _damage(self, number: int, raw: bytes, damage: _Damaged) -> None:
        super()._damage(number, raw, damage)
        if number != self._numbered_line:  # a record whose number counted is no gap
            self.trailing_damaged.append(number)

    def lines(self, upto_bytes: int | None = None
              ) -> Iterator[tuple[int, bytes, SessionEvent | None]]:
        """Every trusted record of the (uncompressed) journal's first ``upto_bytes`` bytes
        (default: all) as ``(line, raw bytes, event or None)``; damaged ones are set aside
        in :attr:`damaged` as when iterating. A writer may be appending past
        ``upto_bytes`` meanwhile."""
        with self.path.open("rb") as stream:
            position, number = 0, 0
            while upto_bytes is None or position < upto_bytes:
                raw = stream.readline()
                if not raw:
                    break
                position += len(raw)
                number += 1
                if not raw.strip():
                    continue
                self.records += 1
                epochs = self.epochs
                try:
                    event = self._read(number, raw)
                except _Damaged as damage:
                    self._damage(number, raw, damage)
                    continue
                self.last_line_was_epoch = self.epochs > epochs
                if event is not None:
                    self.events += 1
                yield number, raw, event

    def _read(self, number: int, raw: bytes) -> SessionEvent | None:
        self.keys, self.last_raw, self.route = None, raw, None
        head = _SEQ_HEAD.match(raw)
        seq = int(head.group(1)) if head is not None else None
        if seq is not None and seq <= self.last_seq:
            raise _Damaged(f"sequence number {seq} not above {self.last_seq} "
                           "(a duplicated or reordered record)", field=SEQ_KEY)
        epochs, last_epoch, start = self.epochs, self.last_epoch, self._epoch
        event = super()._read(number, raw)  # the checksum first: then trust the number
        if self.epochs > epochs and self._epoch is not None and (
                self._epoch.epoch > MAX_EPOCH):
            bad = self._epoch.epoch
            self.epochs, self.last_epoch, self._epoch = epochs, last_epoch, start
            raise _Damaged(f"epoch {bad} is above {MAX_EPOCH} (order ids would overflow)",
                           field="kvprefetch_epoch")
        if seq is not None:
            if seq > self.last_seq + 1:
                self._gaps.append((self.last_seq + 1, seq - 1, tuple(self.trailing_damaged)))
            self.last_seq, self._numbered_line, self.trailing_damaged = seq, number, []
        elif number == 1 and event is None and self.header_ok:
            self.compacted = pydantic_core.from_json(raw).get("compacted") is True
        elif self.last_seq and not raw.startswith(b'{"%s"' % HEADER_KEY.encode()):
            raise _Damaged("no sequence number after numbered records", field=SEQ_KEY)
        if event is not None:
            self._check_values(event)
        if self.route is not None:
            self._check_route(self.route)
        if event is not None and _KEYS_MARK in raw:
            value = pydantic_core.from_json(raw).get(KEYS_KEY)
            if value is not None:
                try:
                    self.keys = KeysChange.parse(value)
                except ValueError as exc:
                    raise _Damaged(str(exc), field=KEYS_KEY) from None
        return event

    def _check_values(self, event: SessionEvent) -> None:
        """Values no live call produces (see the module docstring) make a record damaged."""
        for name, value in (("in", event.input_tokens), ("out", event.output_tokens),
                            ("reused", event.reused_tokens), ("ctx", event.context_tokens),
                            ("turn", event.turn)):
            if value is not None and value > MAX_TOKENS:
                raise _Damaged(f"{name} {value} is above {MAX_TOKENS:,}", field=name)
        self._check_node(event.node)
        self._check_session(event.session_id, f"session {event.session_id!r}")
        if event.eta_s is not None and event.eta_s > MAX_ETA_S:
            raise _Damaged(f"eta_s {event.eta_s} is above a day", field="eta_s")

    def _check_node(self, node: int | None) -> None:
        """A node outside the fleet makes a record damaged."""
        if node is not None and self.nodes is not None and node >= self.nodes:
            raise _Damaged(f"node {node} is outside the fleet ({self.nodes} nodes)",
                           field="node")

    @staticmethod
    def _check_session(session_id: str, what: str, tenant: str | None = None) -> SessionKey:
        """The ``tenant/session`` key of a record (and its ``tenant`` field, if it has one),
        which must be names the API takes; ``what`` names the record in the error."""
        key = SessionKey.parse(session_id)
        try:
            if tenant is not None:
                check_tenant_name(tenant)
            check_tenant_name(key.tenant)
            check_session_id(key.session_id)
        except InvalidRequestError as exc:
            raise _Damaged(f"{what}: {exc}", field="session") from None
        return key

    def _check_route(self, route: RouteRecord) -> None:
        """A route record with values no live route produces is damaged."""
        if not _REQUEST_ID.fullmatch(route.request_id):
            raise _Damaged(f"request id {route.request_id[:80]!r} is not one the API takes",
                           field="kvprefetch_route")
        if not _DIGEST.fullmatch(route.digest):
            raise _Damaged("digest: expected 1-64 hex digits", field="digest")
        if route.turn > MAX_TOKENS:
            raise _Damaged(f"turn {route.turn} is above {MAX_TOKENS:,}", field="turn")
        if not 0.0 <= route.arrival_s <= route.time_s:
            raise _Damaged(f"arrival {route.arrival_s!r} is not in 0..t", field="arrival")
        self._check_node(route.node)
        key = self._check_session(route.session_id, f"route {route.request_id!r}",
                                  tenant=route.tenant)
        if key.tenant != route.tenant:
            raise _Damaged(f"route {route.request_id!r}: session {route.session_id!r} is "
                           f"not tenant {route.tenant!r}'s", field="tenant")
