"""Restart safety: resuming from the journal applies events exactly as the live calls did."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kvptest.live_fleet import session_home

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.types import EventKind, HintKind, SessionEvent
from kvprefetch.controlplane.journal.compaction import compact_journal
from kvprefetch.controlplane.journal.file import EpochRecord, encode_checked
from kvprefetch.controlplane.journal.live import KeysChange, LiveJournalWriter
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 8 * GIB}})


def _turns(svc: SchedulerService, *sessions: str) -> None:
    c = connect(service=svc, tenant="t")
    for sid in sessions:
        ans = c.route(sid, input_tokens=1_000)
        c.request_finished(sid, node=ans.node, input_tokens=1_000, output_tokens=50,
                           context_tokens=1_040)


def test_a_session_closed_before_a_restart_stays_closed(tmp_path: Path) -> None:
    cfg = ServiceConfig(fleet=FLEET, journal_path=str(tmp_path / "journal.jsonl"))
    with SchedulerService(cfg) as svc:
        _turns(svc, "a", "b")
        connect(service=svc, tenant="t").session_closed("a")
        assert svc.core.sessions() == 1
    with SchedulerService(cfg) as again:
        assert not again.has_session("t", "a") and again.has_session("t", "b")
        # The core, not only the registry, forgot it: before the one apply path, resume
        # re-created the closed session's state in the core.
        assert again.core.sessions() == 1
        assert session_home(again.core, "t/a") is None
        assert session_home(again.core, "t/b") is not None
        # The context the client reported (not input + output) survives the restart.
        assert again.core.remote_tokens("t/b") == 1_040


# ---------------------------------------------------------------------------------------------
# Exact resume: context, turns and chunk names come back as they were.
# ---------------------------------------------------------------------------------------------


def _books(svc: SchedulerService) -> dict[str, tuple[object, ...]]:
    """What the scheduler holds of each live session: the registry's state, its chunk
    names, and the core's home node and remote tokens."""
    out: dict[str, tuple[object, ...]] = {}
    for info in svc.registry:
        out[info.sid] = (info.turns, info.in_flight, info.context_tokens, info.hashes,
                         tuple(svc.registry.keys_of(info, info.context_tokens)),
                         session_home(svc.core, info.sid), svc.core.remote_tokens(info.sid))
    return out


def _content_traffic(svc: SchedulerService) -> None:
    c = connect(service=svc, tenant="t")
    prompt = list(range(9_000))
    ans = c.route("tokens", token_ids=prompt)  # 9,000 tokens named by content
    c.request_finished("tokens", node=ans.node, input_tokens=9_000, output_tokens=100)
    prompt += list(range(50_000, 50_600))  # turn 2: the old context and 600 new tokens
    ans = c.route("tokens", token_ids=prompt)
    c.request_finished("tokens", node=ans.node, input_tokens=len(prompt), output_tokens=80)
    ans = c.route("hashes", input_tokens=3_000)  # the engine names the chunks at the end
    c.request_finished("hashes", node=ans.node, input_tokens=3_000, output_tokens=100,
                       chunk_hashes=[f"{i:032x}" for i in range(13)])
    c.route("running", token_ids=list(range(700, 2_000)))  # in flight at the restart
    _turns(svc, "positions")


def test_a_session_resumes_with_its_context_and_chunk_names(tmp_path: Path) -> None:
    """A context named by content comes back named by content (its chunk hashes are
    journalled): named by position, every chunk the agents hold would be missed."""
    cfg = ServiceConfig(fleet=FLEET, journal_path=str(tmp_path / "journal.jsonl"))
    with SchedulerService(cfg) as svc:
        _content_traffic(svc)
        before = _books(svc)
    assert before["t/tokens"][2] == 9_680 and len(before["t/tokens"][4]) == 38
    assert before["t/tokens"][4][0].startswith("t/h/")
    with SchedulerService(cfg) as again:
        assert _books(again) == before
        assert again.session_state({"tenant": "t", "session_id": "tokens"}).keyed_by_content
    # A new turn journals the change of names, not the whole list again.
    rows = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    changes = [r["keys"] for r in rows if r.get("session") == "t/tokens" and "keys" in r]
    assert [c["keep"] for c in changes] == [0, 35]
    assert [len(c["add"]) for c in changes] == [36, 3]


def test_a_forged_keys_record_is_quarantined(tmp_path: Path) -> None:
    """A ``keys`` value that does not parse is damage (its checksum made to match)."""
    cfg = ServiceConfig(fleet=FLEET, journal_path=str(tmp_path / "journal.jsonl"))
    with SchedulerService(cfg) as svc:
        _content_traffic(svc)
    path = tmp_path / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    bad = next(i for i, line in enumerate(lines) if b'"keys"' in line)
    row = json.loads(lines[bad])
    del row["crc"]
    row["keys"] = {"keep": -1, "add": ["x/y"]}
    lines[bad] = encode_checked(row)
    path.write_bytes(b"".join(lines))
    with SchedulerService(cfg) as again:
        assert again.stats.journal_quarantined == 1
        assert again.sessions() == 4  # the session of the forged record lost one event


# ---------------------------------------------------------------------------------------------
# Compaction: closed sessions dropped, live ones exactly as before.
# ---------------------------------------------------------------------------------------------


def _churn(svc: SchedulerService, sessions: int, *, prefix: str = "old") -> None:
    c = connect(service=svc, tenant="t")
    for i in range(sessions):
        _turns(svc, f"{prefix}{i}")
        c.session_closed(f"{prefix}{i}")


def test_compaction_at_start_drops_closed_sessions_and_keeps_live_ones(
        tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    plain = ServiceConfig(fleet=FLEET, journal_path=str(path), journal_compact_records=0)
    with SchedulerService(plain) as svc:
        _churn(svc, 50)
        _content_traffic(svc)
        before, epoch = _books(svc), svc.epoch
    records_before = len(path.read_bytes().splitlines())
    compacting = plain.model_copy(update={"journal_compact_records": 50})
    with SchedulerService(compacting) as again:
        assert _books(again) == before
        assert again.summary()["journal_compactions"] == 1
        assert again.epoch > epoch
    records_after = len(path.read_bytes().splitlines())
    # header + the last start + the 9 events of the live sessions and the route record of
    # the one route still in flight + this start and its clean stop
    assert records_after == 14 and records_after * 10 < records_before
    with SchedulerService(plain) as third:  # the compacted journal resumes the same
        assert _books(third) == before
        assert not third.has_session("t", "old0") and third.stats.journal_quarantined == 0


def test_compaction_while_serving_keeps_what_is_written_meanwhile(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    cfg = ServiceConfig(fleet=FLEET, journal_path=str(path), journal_compact_records=0)
    with SchedulerService(cfg) as svc:
        _churn(svc, 30)
        _content_traffic(svc)
        assert svc.compact_journal()
        _churn(svc, 5, prefix="new")  # appended to the compacted journal
        _turns(svc, "late")
        before = _books(svc)
        assert svc.summary()["journal_compactions"] == 1
    with SchedulerService(cfg) as again:
        assert _books(again) == before and again.stats.journal_quarantined == 0


# ---------------------------------------------------------------------------------------------
# Resume time: a long history against the live sessions it leaves.
# ---------------------------------------------------------------------------------------------

#: Events of the synthetic history (``KVPREFETCH_RESUME_EVENTS=1000000`` for a history of a
#: million); 1 in ``LIVE_EVERY`` sessions is left open.
RESUME_EVENTS = int(os.environ.get("KVPREFETCH_RESUME_EVENTS", "20000"))
LIVE_EVERY = 50


def _history(path: Path, events: int) -> int:
    """A journal of ``events`` events: sessions of 4 turns (start, hint, finish) and a
    close, 1 in LIVE_EVERY left open; returns the live sessions."""
    writer = LiveJournalWriter(path, metadata={"source": "synthetic"}).open()
    writer.write_epoch(EpochRecord(7, 0.0, time.time()))
    n, t, session, live = 0, 0.0, 0, 0
    while n < events:
        sid, closes = f"t/s{session}", session % LIVE_EVERY != 0
        hashes: list[str] = []
        for turn in range(4):
            t += 0.001
            more = [f"{session:016x}{turn:08x}{k:08x}" for k in range(4)]
            writer.write_event(SessionEvent(EventKind.REQUEST_STARTED, sid, t, turn,
                                            1_000 * (turn + 1), tenant="t"),
                               KeysChange(len(hashes), tuple(more)))
            hashes += more
            writer.write_event(SessionEvent(EventKind.HINT, sid, t, turn,
                                            hint=HintKind.TOOL_RUNNING, eta_s=2.0, tenant="t"))
            writer.write_event(SessionEvent(EventKind.REQUEST_FINISHED, sid, t + 0.0005, turn,
                                            1_000 * (turn + 1), 50, node=session % 2,
                                            tenant="t", context_tokens=1_000 * (turn + 1) + 50))
            n += 3
        if closes:
            writer.write_event(SessionEvent(EventKind.SESSION_CLOSED, sid, t + 0.0008, 3,
                                            tenant="t"))
            n += 1
        else:
            live += 1
        session += 1
    writer.close()
    return live


def test_resume_time_is_bounded_by_live_sessions_after_compaction(tmp_path: Path) -> None:
    """Resume replays every event of the journal; compaction keeps only the live sessions'
    records, so the next resume costs those. Measured side by side on one history."""
    path = tmp_path / "journal.jsonl"
    live = _history(path, RESUME_EVENTS)
    size_before = path.stat().st_size
    plain = ServiceConfig(fleet=FLEET, journal_path=str(path), journal_compact_records=0)
    t0 = time.perf_counter()
    with SchedulerService(plain) as full:
        full_s = time.perf_counter() - t0
        books = _books(full)
        assert len(books) == live and full.stats.journal_quarantined == 0
    t0 = time.perf_counter()
    result = compact_journal(path)
    compact_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with SchedulerService(plain) as again:
        compacted_s = time.perf_counter() - t0
        assert _books(again) == books
    print(f"\nresume of {RESUME_EVENTS:,} events ({size_before / 2**20:.1f} MiB, {live:,} live "
          f"sessions): {full_s:.2f} s; compaction {compact_s:.2f} s -> "
          f"{result.records_after:,} records ({result.bytes_after / 2**20:.2f} MiB); "
          f"resume after it {compacted_s:.2f} s")
    assert result.records_after <= 13 * live + 4
    # the compacted journal holds 1 in ~LIVE_EVERY/13*4 of the events; allow for noise
    assert compacted_s < full_s / 3
