"""Route records in the journal: written with a checksum, read back by the scanner (handed
to ``on_route`` between the events around them, never yielded as events), skipped by the
trace readers, and set aside as damaged when a value is out of range."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.journal.file import (
    JournalScanner,
    RouteRecord,
    TimeLimits,
    encode_checked,
)
from kvprefetch.controlplane.journal.live import LiveJournalScanner, LiveJournalWriter
from kvprefetch.controlplane.journal.trace import read_journal_events

ROUTE = RouteRecord("r-1", "acme", "acme/s1", "0f" * 16, 0, 1.5, 1, arrival_s=1.25,
                    node_name="node-1", estimated_ttft_s=0.04, local_ready=True)


def _journal(tmp_path: Path, *routes: RouteRecord) -> Path:
    path = tmp_path / "journal.jsonl"
    with LiveJournalWriter(path, metadata={"source": "test"}) as writer:
        writer.write_event(SessionEvent(EventKind.REQUEST_STARTED, "acme/s1", 1.25, 0, 100,
                                        tenant="acme"))
        for route in routes:
            writer.write_route(route)
        writer.write_event(SessionEvent(EventKind.REQUEST_FINISHED, "acme/s1", 2.0, 0, 100,
                                        10, node=1, tenant="acme"))
    return path


def test_a_route_record_round_trips_between_its_events(tmp_path: Path) -> None:
    cancelled = RouteRecord(**{**{f: getattr(ROUTE, f) for f in ROUTE.__slots__},
                               "cancelled": True, "time_s": 1.75})
    path = _journal(tmp_path, ROUTE, cancelled)
    seen: list[object] = []
    scan = LiveJournalScanner(path, limits=TimeLimits(now_wall_s=time.time()), nodes=2)
    scan.on_route = seen.append
    for _line, event in scan:
        seen.append(event.kind)
    assert seen == [EventKind.REQUEST_STARTED, ROUTE, cancelled, EventKind.REQUEST_FINISHED]
    assert scan.events == 2 and not scan.damaged and scan.last_t == 2.0
    # As a trace, the journal holds its two events only.
    assert [e.kind for e in read_journal_events(path)] == [EventKind.REQUEST_STARTED,
                                                           EventKind.REQUEST_FINISHED]


def test_none_fields_stay_out_of_the_record() -> None:
    bare = RouteRecord("r", "t", "t/s", "ab", 2, 0.0, 0)
    assert bare.to_dict() == {"kvprefetch_route": "r", "tenant": "t", "session": "t/s",
                              "digest": "ab", "turn": 2, "t": 0.0, "node": 0, "arrival": 0.0,
                              "local_ready": False, "cancelled": False}


@pytest.mark.parametrize(("change", "why"), [
    ({"node": 7}, "outside the fleet"),
    ({"kvprefetch_route": "has space"}, "request id"),
    ({"digest": "not hex"}, "digest"),
    ({"session": "other/s1"}, "not tenant"),
    ({"cancelled": "yes"}, "true or false"),
    ({"t": 1e300}, "in the future"),
])
def test_a_route_record_out_of_range_is_damaged(tmp_path: Path, change: dict[str, object],
                                                why: str) -> None:
    path = _journal(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    row = {"seq": 3, **ROUTE.to_dict(), **change}
    path.write_bytes(b"".join([*lines, encode_checked(row)]))
    seen: list[RouteRecord] = []
    scan = LiveJournalScanner(path, limits=TimeLimits(now_wall_s=time.time()), nodes=2)
    scan.on_route = seen.append
    assert len(list(scan)) == 2
    assert not seen and len(scan.damaged) == 1 and why in scan.damaged[0].reason


def test_the_trace_scanner_skips_route_records_without_a_listener(tmp_path: Path) -> None:
    scan = JournalScanner(_journal(tmp_path, ROUTE))
    assert len(list(scan)) == 2 and not scan.damaged and scan.records == 4
