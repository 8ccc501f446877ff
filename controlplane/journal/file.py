"""The journal's file format: its records, their checksums, the scanner that reads them
line by line and sets damaged ones aside, and quarantine and repair.

File format (JSONL, UTF-8, optionally gzip-compressed as ``.jsonl.gz`` once rotated):

* line 1, a header: ``{"kvprefetch_journal": 1, ...}`` (the format version, then free
  metadata given to the writer);
* then one :class:`~kvprefetch.controlplane.base.types.SessionEvent` per line, as a flat
  object with the short keys ``kind``, ``session``, ``t``, ``turn``, ``in``, ``out``,
  ``reused``, ``stop``, ``hint``, ``eta_s``, ``node``, ``tenant``, ``parent``, ``ctx``
  (``None`` fields are omitted). ``t`` is the service clock in seconds. Unknown keys are
  ignored, so version 1 may gain optional keys; a change of meaning bumps the version;
* and, once per scheduler start, an epoch record ``{"kvprefetch_epoch": N, "t": ...,
  "wall": ..., "compression": ...}`` (:class:`EpochRecord`: the epoch its order ids carry);
  once per clean stop, a stop record ``{"kvprefetch_stop": N, "t": ..., "wall": ...}``
  (:class:`StopRecord`): a journal that does not end with one belongs to a scheduler that
  still runs, crashed, or was cut at a record boundary;
* and, after each route that carried a request id, a route record ``{"kvprefetch_route":
  <request id>, "tenant": ..., "session": ..., "digest": ..., "turn": ..., "node": ...,
  ...}`` (:class:`RouteRecord`: the answer a retry with that id gets, or that the route was
  cancelled). Route records are not session events: the trace readers skip them.

Every record but the header ends with its checksum, ``..., "crc": "1a2b3c4d"}``: the CRC-32
of the line's bytes without that key (journals written before checksums still load). A
record whose checksum does not match, an unchecked record after checked ones, a line that
is not a valid record and (for the service) a record whose time is out of range
(:class:`TimeLimits`) is *damaged*: :class:`JournalScanner` sets it aside, and the service
moves it to a side file (:func:`quarantine`) with a counted warning and starts without it
(``kvprefetch journal check [--repair]`` does the same offline). The trace readers
(:mod:`kvprefetch.controlplane.journal.trace`) are strict: a damaged line is a
:class:`~kvprefetch.controlplane.base.errors.TraceFormatError` naming file, line and field.

Writing: :class:`~kvprefetch.controlplane.journal.writer.JournalWriter` appends one
complete line per record, so a crash can only tear the *last* line; every reader here
ignores a torn last line (one without its final newline that does not check out) and logs
a warning. The quarantine side file and a repaired copy take the journal's own mode.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import stat
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic_core
from tqdm import tqdm

from kvprefetch.controlplane.base.atomic import write_atomic
from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.base.fields import FieldReader, check_exists
from kvprefetch.controlplane.base.types import EventKind, HintKind, SessionEvent
from kvprefetch.controlplane.base.vocabulary import stop_reason_or_none

HEADER_KEY = "kvprefetch_journal"
EPOCH_KEY = "kvprefetch_epoch"
STOP_KEY = "kvprefetch_stop"
ROUTE_KEY = "kvprefetch_route"
JOURNAL_VERSION = 1
#: The mode of a journal the writer creates (owner only: events name tenants and sessions).
JOURNAL_MODE = 0o600

_log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# One event <-> one JSON object.
# ---------------------------------------------------------------------------------------------


def event_to_dict(event: SessionEvent) -> dict[str, Any]:
    """The journal line of ``event`` as a dict (``None`` fields omitted)."""
    out: dict[str, Any] = {
        "kind": event.kind.value,
        "session": event.session_id,
        "t": event.time_s,
        "turn": event.turn,
        "in": event.input_tokens,
        "out": event.output_tokens,
        "reused": event.reused_tokens,
        "stop": event.stop_reason,
        "hint": event.hint.value if event.hint is not None else None,
        "eta_s": event.eta_s,
        "node": event.node,
        "tenant": event.tenant,
        "parent": event.parent_id,
        "ctx": event.context_tokens,
    }
    return {key: value for key, value in out.items() if value is not None}


def event_from_dict(
    obj: Mapping[str, Any], *, path: str | Path | None = None, line: int | None = None
) -> SessionEvent:
    """Parse one journal object; errors name ``path``, ``line`` and the field."""
    reader = FieldReader(Path(path) if path is not None else Path("<event>"), line)
    row = reader.mapping(obj, "event")
    kind = reader.member("kind", reader.text(row, "kind"), EventKind, "event kind")
    hint_text = reader.optional_text(row, "hint")
    hint = None if hint_text is None else reader.member("hint", hint_text, HintKind, "hint")
    session_id = reader.text(row, "session")
    return SessionEvent(
        kind=kind,
        session_id=session_id,
        time_s=reader.number(row, "t"),
        turn=reader.count(row, "turn", default=0),
        input_tokens=reader.count(row, "in", default=0),
        output_tokens=reader.count(row, "out", default=0),
        reused_tokens=reader.count(row, "reused", default=0),
        stop_reason=stop_reason_or_none(reader.optional_text(row, "stop")),
        hint=hint,
        eta_s=reader.seconds(row, "eta_s", optional=True),
        node=_node(reader, row),
        tenant=reader.optional_text(row, "tenant") or "default",
        parent_id=reader.optional_text(row, "parent"),
        context_tokens=reader.count(row, "ctx") if row.get("ctx") is not None else None,
    )


def _node(reader: FieldReader, row: Mapping[str, Any]) -> int | None:
    """The event's node number; journals written before it was an int hold its digits."""
    value = row.get("node")
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return reader.count(row, "node")


# ---------------------------------------------------------------------------------------------
# Records: checksums and scheduler epochs.
# ---------------------------------------------------------------------------------------------

#: A checksummed record ends with this key, written last: ``...,"crc":"1a2b3c4d"}``.
CRC_KEY = "crc"
_CRC_TAIL = re.compile(rb',"crc":"([0-9a-f]{8})"\}\r?\n?$')


def is_header_line(raw: bytes) -> bool:
    """Whether ``raw`` (a journal's first line) is a journal header: a JSON object holding
    :data:`HEADER_KEY`. A writer appends only to a file that starts with one."""
    try:
        header = json.loads(raw)
    except ValueError:
        return False
    return isinstance(header, dict) and HEADER_KEY in header


def header_line(**metadata: Any) -> bytes:
    """A fresh header line (the format version, then ``metadata``)."""
    return encode_line({HEADER_KEY: JOURNAL_VERSION, **metadata})


def encode_line(obj: Mapping[str, Any]) -> bytes:
    """One JSON line without a checksum (the header, quarantined lines)."""
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def encode_checked(obj: Mapping[str, Any]) -> bytes:
    """One record line with its checksum: the CRC-32 of the line's bytes without the
    checksum key (the ``{...}`` the key was appended to)."""
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    assert body.endswith(b"}") and len(body) > 2, body  # a non-empty object
    return body[:-1] + b',"%s":"%08x"}\n' % (CRC_KEY.encode(), zlib.crc32(body))


def verify_checksum(raw: bytes) -> bool | None:
    """True/False: the line's checksum matches or not; None: the line has none."""
    match = _CRC_TAIL.search(raw)
    if match is None:
        return None
    body = raw[: match.start()] + b"}"
    return zlib.crc32(body) == int(match.group(1), 16)


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """A scheduler start: the epoch its order ids carry, the service clock (``t``) and the
    wall clock (Unix seconds) when it started, and its time compression. Later records'
    times are checked against it (:class:`TimeLimits`)."""

    epoch: int
    time_s: float
    wall_s: float
    compression: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {EPOCH_KEY: self.epoch, "t": self.time_s, "wall": self.wall_s,
                "compression": self.compression}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], reader: FieldReader) -> EpochRecord:
        compression = reader.number(row, "compression") if "compression" in row else 1.0
        if not compression > 0:
            raise reader.error("compression", f"must be positive, got {compression!r}")
        return cls(reader.count(row, EPOCH_KEY), reader.number(row, "t"),
                   reader.number(row, "wall"), compression)


@dataclass(frozen=True, slots=True)
class StopRecord:
    """A clean scheduler stop: the epoch that stops, the service clock (``t``) and the wall
    clock (Unix seconds). The last record of a journal whose scheduler stopped cleanly."""

    epoch: int
    time_s: float
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {STOP_KEY: self.epoch, "t": self.time_s, "wall": self.wall_s}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], reader: FieldReader) -> StopRecord:
        return cls(reader.count(row, STOP_KEY), reader.number(row, "t"),
                   reader.number(row, "wall"))


@dataclass(frozen=True, slots=True)
class RouteRecord:
    """A route that carried a request id: whose (``tenant``, ``session_id`` in the events'
    ``tenant/session`` form), the digest of its query, the session's ``turn`` it answered
    for, the answer (``node``, ``node_name``, ``estimated_ttft_s``, ``local_ready``), and
    whether it was since cancelled. ``time_s`` is the service clock; ``arrival_s`` the
    service time the request it answered for started (with ``turn``, which request that
    is)."""

    request_id: str
    tenant: str
    session_id: str
    digest: str
    turn: int
    time_s: float
    node: int
    arrival_s: float = 0.0
    node_name: str | None = None
    estimated_ttft_s: float | None = None
    local_ready: bool = False
    cancelled: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {ROUTE_KEY: self.request_id, "tenant": self.tenant, "session": self.session_id,
               "digest": self.digest, "turn": self.turn, "t": self.time_s, "node": self.node,
               "arrival": self.arrival_s, "node_name": self.node_name,
               "ttft_s": self.estimated_ttft_s, "local_ready": self.local_ready,
               "cancelled": self.cancelled}
        return {key: value for key, value in out.items() if value is not None}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], reader: FieldReader) -> RouteRecord:
        flags = {}
        for name in ("local_ready", "cancelled"):
            value = row.get(name, False)
            if not isinstance(value, bool):
                raise reader.error(name, f"expected true or false, got {value!r}")
            flags[name] = value
        ttft = row.get("ttft_s")
        return cls(reader.text(row, ROUTE_KEY), reader.text(row, "tenant"),
                   reader.text(row, "session"), reader.text(row, "digest"),
                   reader.count(row, "turn"), reader.number(row, "t"),
                   reader.count(row, "node"), reader.number(row, "arrival"),
                   reader.optional_text(row, "node_name"),
                   reader.number(row, "ttft_s") if ttft is not None else None,
                   flags["local_ready"], flags["cancelled"])


@dataclass(frozen=True, slots=True)
class TimeLimits:
    """How far in the future a record's time may lie (a damaged or forged ``t`` such as
    ``1e300`` must not freeze the service clock).

    A record's ``t`` must be >= 0 (the service clock starts at 0) and at most:
    after an epoch record, that start's ``t`` + (``now_wall_s`` - its wall time + ``slack_s``)
    x its compression (the service clock cannot have run further since it started);
    before any, the latest accepted ``t`` + ``max_gap_s``.
    """

    #: The wall clock now (Unix seconds).
    now_wall_s: float
    #: Allowed wall-clock skew between the machines a scheduler ran on (seconds).
    slack_s: float = 3600.0
    #: Journals without epoch records: the largest jump of the service clock between two
    #: records (service seconds; ~317 years at compression 1, a day at the highest).
    max_gap_s: float = 1e10


@dataclass(frozen=True, slots=True)
class DamagedRecord:
    """A journal line that cannot be trusted: its 1-based ``line``, why, and its bytes."""

    line: int
    reason: str
    raw: bytes
    #: The last line, without its newline: a write cut short by a crash.
    torn: bool = False
    error: TraceFormatError | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "reason": self.reason, "torn": self.torn,
                "raw": self.raw.decode("utf-8", errors="backslashreplace")}


# ---------------------------------------------------------------------------------------------
# Reading: every line checked, damaged ones set aside.
# ---------------------------------------------------------------------------------------------


class JournalScanner:
    """Reads a journal line by line, yielding ``(line, event)`` for every event it can
    trust and setting every other line aside in :attr:`damaged`.

    A line is damaged when its checksum does not match; when it has none although an
    earlier record of the file had one (a writer that checksums never writes an unchecked
    record after a checked one; journals written before checksums have none and still
    load); when it is not a valid record; or, with ``limits``, when its time is out of
    range (:class:`TimeLimits`). The header line carries no checksum (it holds no state);
    a header that does not parse is damaged too. With ``strict``, the first damaged line
    other than a torn last line raises :class:`TraceFormatError` instead.

    After iterating, :attr:`records` counts the lines read (blank ones excepted),
    :attr:`events` the events yielded, :attr:`epochs`/:attr:`last_epoch` the scheduler
    starts, :attr:`last_t` the latest accepted time.

    Route records are not yielded: each trusted one is handed to ``on_route`` (when given)
    in file order, between the events around it; :attr:`route` is the last record read when
    it was a route record (None otherwise).
    """

    def __init__(self, path: str | Path, *, limits: TimeLimits | None = None,
                 strict: bool = False, progress: bool = False) -> None:
        self.path = Path(path)
        self.limits = limits
        self.strict = strict
        self.progress = progress
        self.damaged: list[DamagedRecord] = []
        self.records = self.events = self.epochs = self.checked = self.stops = 0
        #: Whether the last trusted record is a stop record (a clean stop).
        self.stopped = False
        self.last_epoch = 0
        self.last_t = 0.0
        self.header_ok = False
        self._epoch: EpochRecord | None = None
        self.route: RouteRecord | None = None
        self.on_route: Callable[[RouteRecord], None] | None = None

    def __iter__(self) -> Iterator[tuple[int, SessionEvent]]:
        check_exists(self.path)
        opener = gzip.open if self.path.name.endswith(".gz") else open
        with opener(self.path, "rb") as stream:
            lines = tqdm(stream, desc="journal", unit="line", disable=not self.progress)
            for number, raw in enumerate(lines, start=1):
                if not raw.strip():
                    continue
                self.records += 1
                try:
                    event = self._read(number, raw)
                except UntrustedLine as damage:
                    self._damage(number, raw, damage)
                    continue
                if event is not None:
                    self.events += 1
                    yield number, event
                elif self.route is not None and self.on_route is not None:
                    self.on_route(self.route)

    def _read(self, number: int, raw: bytes) -> SessionEvent | None:
        self.route = None
        verified = verify_checksum(raw)
        if verified is False:
            raise UntrustedLine("checksum mismatch")
        if verified is None and self.checked:
            raise UntrustedLine("no checksum after checksummed records")
        try:
            obj = pydantic_core.from_json(raw)
        except ValueError as exc:
            raise UntrustedLine(f"invalid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise UntrustedLine(f"expected a JSON object, got {type(obj).__name__}")
        if verified:
            self.checked += 1
        elif CRC_KEY in obj:
            raise UntrustedLine("malformed checksum")
        reader = FieldReader(self.path, number)
        if HEADER_KEY in obj:
            version = obj[HEADER_KEY]
            if version != JOURNAL_VERSION:
                raise UntrustedLine(f"unsupported journal version {version!r} "
                               f"(this reader: {JOURNAL_VERSION})", field=HEADER_KEY)
            self.header_ok = self.header_ok or number == 1
            return None
        try:
            if STOP_KEY in obj:
                stop = StopRecord.from_dict(obj, reader)
                if (why := self._out_of_range(stop.time_s, stop.wall_s)) is not None:
                    raise UntrustedLine(why, field="t")
                self.stops += 1
                self.stopped = True
                self.last_t = max(self.last_t, stop.time_s)
                return None
            self.stopped = False
            if ROUTE_KEY in obj:
                route = RouteRecord.from_dict(obj, reader)
                if (why := self._out_of_range(route.time_s)) is not None:
                    raise UntrustedLine(why, field="t")
                self.route = route
                self.last_t = max(self.last_t, route.time_s)
                return None
            if EPOCH_KEY in obj:
                epoch = EpochRecord.from_dict(obj, reader)
                if (why := self._out_of_range(epoch.time_s, epoch.wall_s)) is not None:
                    raise UntrustedLine(why, field="t")
                self._epoch, self.last_epoch = epoch, max(self.last_epoch, epoch.epoch)
                self.epochs += 1
                self.last_t = max(self.last_t, epoch.time_s)
                return None
            event = event_from_dict(obj, path=self.path, line=number)
        except TraceFormatError as exc:
            raise UntrustedLine(str(exc), error=exc) from None
        if (why := self._out_of_range(event.time_s)) is not None:
            raise UntrustedLine(why, field="t")
        self.last_t = max(self.last_t, event.time_s)
        return event

    def _out_of_range(self, t: float, wall_s: float | None = None) -> str | None:
        limits = self.limits
        if limits is None:
            return None
        if not t >= 0.0:
            return f"time {t!r} before the service clock's start"
        if wall_s is not None and wall_s > limits.now_wall_s + limits.slack_s:
            return f"start recorded at wall time {wall_s!r}, in the future"
        start = self._epoch
        if start is None:
            bound = self.last_t + limits.max_gap_s
        else:
            ran_s = max(0.0, limits.now_wall_s - start.wall_s) + limits.slack_s
            bound = start.time_s + ran_s * start.compression
        if t > bound:
            return f"time {t!r} is in the future (at most {bound:.6g} here)"
        return None

    def _damage(self, number: int, raw: bytes, damage: UntrustedLine) -> None:
        reason = damage.reason
        torn = not raw.endswith(b"\n")
        if torn:
            _log.warning("%s:%d: ignoring a torn last line", self.path, number)
            reason = f"torn last line ({reason})"
        elif self.strict:
            raise damage.error or TraceFormatError(reason, path=self.path, line=number,
                                                   field=damage.field)
        self.damaged.append(DamagedRecord(number, reason, raw, torn, damage.error))


class UntrustedLine(Exception):
    """Raised by a scanner's record check (:meth:`JournalScanner._read` and its subclasses'
    checks) for a line it cannot trust: ``reason``, the ``field`` at fault, the format
    error behind it."""

    def __init__(self, reason: str, *, field: str | None = None,
                 error: TraceFormatError | None = None) -> None:
        super().__init__(reason)
        self.reason, self.field, self.error = reason, field, error


# ---------------------------------------------------------------------------------------------
# Quarantine and repair.
# ---------------------------------------------------------------------------------------------


def quarantine_path(path: str | Path) -> Path:
    """The side file that keeps a journal's damaged lines: ``<journal>.quarantine``."""
    p = Path(path)
    return p.with_name(p.name + ".quarantine")


def quarantine(path: str | Path, damaged: Sequence[DamagedRecord], *,
               wall_s: float | None = None) -> Path | None:
    """Set ``damaged`` lines of the journal at ``path`` aside: append them to the side file
    (one JSON object per line: ``line``, ``reason``, ``torn``, ``raw``, ``quarantined_at``),
    then replace the journal atomically by a copy without them (a fresh header first when
    the header was among them). Returns the side file, or None when nothing was damaged.
    """
    if not damaged:
        return None
    source = Path(path)
    side = quarantine_path(source)
    stamp = time.time() if wall_s is None else wall_s
    mode = file_mode(source)
    fd = os.open(side, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, mode)
    with open(fd, "ab") as f:
        for record in damaged:
            f.write(encode_line({**record.to_dict(), "journal": source.name,
                             "quarantined_at": stamp}))
        f.flush()
        os.fsync(f.fileno())
    bad = {record.line for record in damaged}
    replace_journal(source, _kept_lines(source, bad))
    return side


def file_mode(path: Path) -> int:
    """The permission bits of ``path`` (:data:`JOURNAL_MODE` when it does not exist)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return JOURNAL_MODE


def replace_journal(path: Path, chunks: Iterable[bytes]) -> None:
    """Replace the journal at ``path`` atomically by ``chunks`` (a temporary file beside it,
    fsynced, given the journal's mode, renamed over it)."""
    write_atomic(path, chunks, mode=file_mode(path))


def _kept_lines(path: Path, bad: set[int]) -> Iterator[bytes]:
    with path.open("rb") as stream:
        for number, raw in enumerate(stream, start=1):
            if number == 1 and number in bad:
                yield header_line(repaired=True)
            if number in bad or not raw.strip():
                continue
            yield raw if raw.endswith(b"\n") else raw + b"\n"
