"""The journal's records and writer, and the journal as a trace: the event codec, a
round trip through the writer to a trace, a torn last line (ignored, cut on reopen), a
damaged middle line (an error naming file, line and field), the writer's refusals."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.base.types import EventKind, HintKind, SessionEvent
from kvprefetch.controlplane.journal.file import event_from_dict, event_to_dict
from kvprefetch.controlplane.journal.trace import read_journal_events
from kvprefetch.controlplane.journal.writer import JournalWriter
from kvprefetch.controlplane.traces import detect_format, load_trace


def _events() -> list[SessionEvent]:
    started, finished = EventKind.REQUEST_STARTED, EventKind.REQUEST_FINISHED
    return [
        SessionEvent(started, "a", 100.0, turn=0, input_tokens=1000, tenant="t1", node=0),
        SessionEvent(finished, "a", 102.5, turn=0, input_tokens=1000, output_tokens=50,
                     stop_reason="tool_use", tenant="t1"),
        SessionEvent(EventKind.HINT, "a", 102.6, turn=0, hint=HintKind.TOOL_RUNNING, eta_s=4.0),
        SessionEvent(started, "b", 103.0, turn=0, input_tokens=10, parent_id="a"),
        SessionEvent(started, "a", 110.5, turn=1, input_tokens=1200, reused_tokens=1050,
                     tenant="t1"),
        SessionEvent(finished, "b", 104.0, turn=0, output_tokens=3),
        SessionEvent(finished, "a", 112.0, turn=1, output_tokens=20, stop_reason="end_turn"),
        SessionEvent(EventKind.SESSION_CLOSED, "a", 113.0, turn=1),
    ]  # fmt: skip


def test_event_dict_round_trip_and_omits_none() -> None:
    for event in _events():
        as_dict = event_to_dict(event)
        assert None not in as_dict.values()
        assert event_from_dict(json.loads(json.dumps(as_dict))) == event
    hint = event_to_dict(_events()[2])
    assert hint["kind"] == "hint" and hint["hint"] == "tool_running" and hint["eta_s"] == 4.0
    assert "stop" not in hint and "parent" not in hint


def test_journal_round_trip_to_trace(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with JournalWriter(path, metadata={"service": "test"}) as writer:
        for event in _events():
            writer.write(event)
        writer.flush()
    header = json.loads(path.read_text().splitlines()[0])
    assert header == {"kvprefetch_journal": 1, "service": "test"}
    assert list(read_journal_events(path)) == _events()
    assert detect_format(path) == "journal"

    trace = load_trace(path)
    assert trace.source_format == "journal"
    assert [(s.start_s, s.session_id) for s in trace.sessions] == sorted(
        (s.start_s, s.session_id) for s in trace.sessions)
    sessions = {s.session_id: s for s in trace.sessions}
    a, b = sessions["a"], sessions["b"]
    assert (a.start_s, b.start_s) == (0.0, 3.0)
    assert (a.tenant, a.parent_id, b.parent_id) == ("t1", None, "a")
    first, second = a.requests
    assert (first.turn, first.offset_s, first.gap_s) == (0, 0.0, None)
    assert (first.input_tokens, first.output_tokens, first.stop_reason) == (1000, 50, "tool_use")
    assert first.api_time_s == pytest.approx(2.5)
    assert (second.turn, second.offset_s) == (1, 10.5)
    assert second.gap_s == pytest.approx(8.0)  # 110.5 - 102.5, closed-loop
    assert (second.reused_tokens, second.output_tokens) == (1050, 20)
    assert second.api_time_s == pytest.approx(1.5)
    assert b.requests[0].output_tokens == 3


def test_journal_torn_last_line_is_ignored_and_cut_on_reopen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "crash.jsonl"
    events = _events()
    with JournalWriter(path) as writer:
        for event in events[:3]:
            writer.write(event)
    with path.open("ab") as f:  # a crash in the middle of a write
        f.write(b'{"kind":"request_started","session":"a","t":1')
    with caplog.at_level(logging.WARNING):
        assert list(read_journal_events(path)) == events[:3]
    assert "torn" in caplog.text

    with JournalWriter(path) as writer:  # appending after the crash
        for event in events[3:]:
            writer.write(event)
    assert list(read_journal_events(path)) == events


def test_journal_bad_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"kvprefetch_journal": 1}\n'
        '{"kind": "request_started", "session": "a", "t": 1.0}\n'
        '{"kind": "request_exploded", "session": "a", "t": 2.0}\n'
        '{"kind": "request_started", "session": "b", "t": 3.0}\n'
    )
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path)
    message = str(caught.value)
    assert "bad.jsonl:3" in message and "'kind'" in message and "request_finished" in message


def test_journal_writer_refuses_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "other.jsonl"
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(TraceFormatError, match="not a kvprefetch journal"):
        JournalWriter(path).open()


def test_journal_writer_constructor_does_no_io(tmp_path: Path) -> None:
    path = tmp_path / "later" / "j.jsonl"
    writer = JournalWriter(path)
    assert not path.exists()
    with pytest.raises(RuntimeError):
        writer.write(_events()[0])


def test_the_trace_loaders_export_the_journal_readers() -> None:
    """``kvprefetch.controlplane.traces`` lists the journal with the other formats: its
    names are the journal package's own objects."""
    from kvprefetch.controlplane import traces
    from kvprefetch.controlplane.journal import file as records
    from kvprefetch.controlplane.journal import trace, writer

    assert traces.load_journal is trace.load_journal
    assert traces.read_journal_events is trace.read_journal_events
    assert traces.event_to_dict is records.event_to_dict
    assert traces.event_from_dict is records.event_from_dict
    assert traces.JournalWriter is writer.JournalWriter


@pytest.mark.parametrize(("obj", "field", "listed"), [
    ({"kind": "bogus", "session": "s", "time_s": 1}, "kind", "request_started, request_finished"),
    ({"kind": "hint", "hint": "nah", "session": "s", "time_s": 1}, "hint", "user_typing"),
])
def test_an_unknown_kind_or_hint_names_the_place_and_the_known_values(
        obj: dict[str, object], field: str, listed: str) -> None:
    with pytest.raises(TraceFormatError) as err:
        event_from_dict(obj, path="j.jsonl", line=3)
    assert err.value.field == field and err.value.line == 3
    assert f"unknown {'event kind' if field == 'kind' else 'hint'} {obj[field]!r}" in str(err.value)
    assert listed in str(err.value)
