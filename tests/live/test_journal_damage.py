"""A journal you can trust: per-record checksums, damaged records
quarantined to a side file and counted (never a failed start-up, so never a restart loop
under Ray), record times range-checked, ``kvprefetch journal check [--repair]``, and a
seeded fuzz of truncations and byte flips.

The suite runs 300 fuzz cases (``KVPREFETCH_JOURNAL_FUZZ_CASES`` sets the number, e.g.
1000 for a longer run; ``KVPREFETCH_JOURNAL_FUZZ_SEED`` the seed).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.types import SessionEvent
from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.journal.file import (
    JournalScanner,
    TimeLimits,
    encode_checked,
    quarantine_path,
)
from kvprefetch.controlplane.journal.trace import read_journal_events
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
COMPRESSION = 1000.0
FUZZ_CASES = int(os.environ.get("KVPREFETCH_JOURNAL_FUZZ_CASES", "300"))
FUZZ_SEED = int(os.environ.get("KVPREFETCH_JOURNAL_FUZZ_SEED", "15"))


def _config(path: Path) -> ServiceConfig:
    return ServiceConfig(fleet=FLEET, policy="ondemand", predictor="last-gap",
                         time_compression=COMPRESSION, journal_path=str(path))


def _traffic(svc: SchedulerService, sessions: int, turns: int) -> None:
    c = connect(service=svc, tenant="acme")
    for turn in range(turns):
        for i in range(sessions):
            tokens = 1000 * (turn + 1)
            ans = c.route(f"s{i}", input_tokens=tokens, reused_tokens=tokens - 1000)
            c.request_finished(f"s{i}", node=ans.node or 0, input_tokens=tokens,
                               output_tokens=20, context_tokens=tokens + 20)
        c.hint("s0", "tool_running", eta_s=3.0)
    c.session_closed(f"s{sessions - 1}")


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[SessionEvent]]:
    """A journal written by two scheduler incarnations: its bytes and its events."""
    path = tmp_path_factory.mktemp("journal") / "journal.jsonl"
    for _ in range(2):
        with SchedulerService(_config(path)) as svc:
            _traffic(svc, sessions=4, turns=3)
    return path.read_bytes(), list(read_journal_events(path))


def _write(tmp_path: Path, data: bytes, name: str = "journal.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _scan(path: Path) -> tuple[JournalScanner, list[SessionEvent]]:
    scan = JournalScanner(path, limits=TimeLimits(now_wall_s=time.time()))
    return scan, [event for _, event in scan]


def _is_subsequence(part: list[SessionEvent], whole: list[SessionEvent]) -> bool:
    it = iter(whole)
    return all(any(event == other for other in it) for event in part)


def test_records_are_checksummed_and_scheduler_starts_recorded(
        original: tuple[bytes, list[SessionEvent]], tmp_path: Path) -> None:
    data, events = original
    lines = data.splitlines()
    assert json.loads(lines[0])["kvprefetch_journal"] == 1
    assert all(line.endswith(b'"}') and b',"crc":"' in line for line in lines[1:])
    scan, got = _scan(_write(tmp_path, data))
    assert got == events and not scan.damaged
    assert scan.epochs == 2 and scan.checked == len(lines) - 1


def test_a_flipped_record_is_quarantined_and_start_up_goes_on(
        original: tuple[bytes, list[SessionEvent]], tmp_path: Path) -> None:
    data, events = original
    lines = data.splitlines(keepends=True)
    target = len(lines) // 2
    while b'"kind":' not in lines[target]:  # an event's record, not a start or a stop
        target += 1
    bad = bytearray(lines[target])
    bad[bad.index(b'"t":') + 4] ^= 0x01  # one digit of the time: still valid JSON
    lines[target] = bytes(bad)
    path = _write(tmp_path, b"".join(lines))
    with SchedulerService(_config(path)) as svc:
        assert svc.stats.journal_quarantined == 1
        assert svc.summary()["journal_quarantined"] == 1
        first_epoch = svc.epoch
    side = [json.loads(line) for line in quarantine_path(path).read_text().splitlines()]
    assert [(q["line"], q["reason"]) for q in side] == [(target + 1, "checksum mismatch")]
    # The journal was rewritten without it: the next start finds nothing to quarantine.
    with SchedulerService(_config(path)) as again:
        assert again.stats.journal_quarantined == 0 and again.epoch > first_epoch
    assert len(quarantine_path(path).read_text().splitlines()) == 1
    assert len(list(read_journal_events(path))) == len(events) - 1


def test_a_far_future_time_never_freezes_the_clock(tmp_path: Path) -> None:
    legacy = (b'{"kvprefetch_journal": 1}\n'
              b'{"kind": "request_started", "session": "t/a", "t": 1.0, "in": 100}\n'
              b'{"kind": "hint", "session": "t/a", "t": 1e300, "hint": "user_typing"}\n'
              b'{"kind": "request_finished", "session": "t/a", "t": 2.0, "out": 5}\n')
    path = _write(tmp_path, legacy)
    with SchedulerService(_config(path)) as svc:
        assert svc.stats.journal_quarantined == 1
        assert svc.clock.now_s() < 1e6
        assert svc.has_session("t", "a")
    # The same with a valid checksum (a forged or buggy writer): still out of range.
    forged = encode_checked({"kind": "hint", "session": "t/a", "t": 1e300,
                              "hint": "user_typing"})
    path.write_bytes(path.read_bytes() + forged)
    with SchedulerService(_config(path)) as svc:
        assert svc.stats.journal_quarantined == 1
        assert svc.clock.now_s() < 1e6
    reasons = [json.loads(line)["reason"] for line in
               quarantine_path(path).read_text().splitlines()]
    assert len(reasons) == 2 and all("in the future" in r for r in reasons)


def test_journals_without_checksums_still_load(tmp_path: Path) -> None:
    legacy = (b'{"kvprefetch_journal": 1, "source": "kvprefetch-service"}\n'
              b'{"kind": "request_started", "session": "t/a", "t": 1.0, "in": 100}\n'
              b'{"kind": "request_finished", "session": "t/a", "t": 2.0, "out": 5, "ctx": 105}\n'
              b'{"kind": "request_started", "session": "t/b", "t": 3.0, "in": 10}\n')
    path = _write(tmp_path, legacy)
    with SchedulerService(_config(path)) as svc:
        assert svc.stats.journal_quarantined == 0
        assert svc.has_session("t", "a") and svc.has_session("t", "b")
        assert svc.core.remote_tokens("t/a") == 105
        connect(service=svc, tenant="t").hint("a", "user_typing")
    # Appended records are checksummed; from then on an unchecked record is damage.
    scan, got = _scan(path)
    assert len(got) == 4 and not scan.damaged and scan.checked == 3  # start, hint, stop
    path.write_bytes(path.read_bytes()
                     + b'{"kind": "session_closed", "session": "t/a", "t": 9.0}\n')
    scan, got = _scan(path)
    assert len(got) == 4 and [d.reason for d in scan.damaged] == [
        "no checksum after checksummed records"]


def test_journal_check_reports_and_repairs(
        original: tuple[bytes, list[SessionEvent]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    data, events = original
    lines = data.splitlines(keepends=True)
    lines[4] = lines[4].replace(b'"kind"', b'"kinb"')
    lines[-1] = lines[-1][:-7]  # torn
    path = _write(tmp_path, b"".join(lines))
    before = path.read_bytes()
    assert main(["journal", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "2 damaged" in out and "line 5: checksum mismatch" in out
    assert f"line {len(lines)}: torn last line" in out
    assert path.read_bytes() == before  # checking alone changes nothing
    assert main(["journal", "check", "--repair", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["damaged"] == 2 and report["repaired"]
    assert [d["line"] for d in report["damaged_lines"]] == [5, len(lines)]
    assert main(["journal", "check", str(path)]) == 0
    assert "0 damaged" in capsys.readouterr().out
    # Line 1 is the header, line 2 the first scheduler start, line 3 event 0 and line 4
    # its route's record: line 5 held event 1; the torn last line was the second
    # scheduler's stop record.
    assert list(read_journal_events(path)) == events[:1] + events[2:]
    kept = [json.loads(q)["raw"] for q in quarantine_path(path).read_text().splitlines()]
    assert kept == [lines[4].decode(), lines[-1].decode()]


def _mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    if rng.random() < 0.3:
        return "truncate", data[:rng.randrange(len(data))]
    at = rng.randrange(len(data))
    flipped = bytearray(data)
    flipped[at] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)
    return "flip", bytes(flipped)


def test_journal_fuzz_truncations_and_byte_flips(
        original: tuple[bytes, list[SessionEvent]], tmp_path: Path) -> None:
    """Every case: start-up does not raise; every event it resumes is one that was
    written, in order (no flipped record changes state: the checksum catches it); every
    damaged line is quarantined and counted; the rewritten journal is clean; the clock
    is where the journal left it."""
    data, events = original
    last_t = max(e.time_s for e in events)
    rng = random.Random(FUZZ_SEED)
    damaged_total = flips = 0
    started = time.perf_counter()
    for case in range(FUZZ_CASES):
        kind, mutated = _mutate(data, rng)
        flips += kind == "flip"
        where = tmp_path / f"case{case}"
        where.mkdir()
        path = _write(where, mutated)
        scan, got = _scan(path)
        context = f"case {case} ({kind}, seed {FUZZ_SEED})"
        assert _is_subsequence(got, events), context
        if kind == "truncate":
            assert got == events[:len(got)], context
            assert len(scan.damaged) <= 1 and all(d.torn for d in scan.damaged), context
        elif got != events:
            assert scan.damaged, context  # nothing lost without a quarantined line
            assert len(events) - len(got) <= 2 * len(scan.damaged), context
        svc = SchedulerService(_config(path)).start()  # never raises
        try:
            assert svc.stats.journal_quarantined == len(scan.damaged), context
            assert svc.clock.now_s() <= last_t + 60 * COMPRESSION, context
        finally:
            svc.close()
        side = quarantine_path(path)
        quarantined = side.read_text().splitlines() if side.exists() else []
        assert len(quarantined) == len(scan.damaged), context
        rescan, regot = _scan(path)
        assert not rescan.damaged and regot == got, context
        damaged_total += len(scan.damaged)
        shutil.rmtree(where)
    elapsed = time.perf_counter() - started
    print(f"\njournal fuzz: {FUZZ_CASES} cases ({flips} flips, {FUZZ_CASES - flips} "
          f"truncations), {damaged_total} damaged lines quarantined, {elapsed:.1f} s")
    assert damaged_total > 0
