"""``kvprefetch journal compact PATH``: the journal without closed sessions' records, written
atomically; a scheduler resumes from it to the same live sessions; a damaged journal is
left as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.journal.file import HEADER_KEY
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def _config(path: Path) -> ServiceConfig:
    # journal_compact_records=0: the service never compacts; the command is what is tested.
    return ServiceConfig(fleet=FLEET, policy="ondemand", predictor="last-gap",
                         time_compression=1000.0, journal_path=str(path),
                         journal_compact_records=0, chunk_tokens=4)


def _journal(path: Path) -> None:
    """Ten sessions of three turns each; s0..s7 closed, s8 and s9 (by content) live."""
    with SchedulerService(_config(path)) as svc:
        c = connect(service=svc, tenant="acme")
        for turn in range(3):
            for i in range(10):
                tokens = 12 * (turn + 1)
                hashes = [f"h{i}-{k}" for k in range(tokens // 4)] if i == 9 else None
                ans = c.route(f"s{i}", input_tokens=tokens, reused_tokens=tokens - 12,
                              chunk_hashes=hashes)
                c.request_finished(f"s{i}", node=ans.node or 0, input_tokens=tokens,
                                   output_tokens=0)
        for i in range(8):
            c.session_closed(f"s{i}")


def test_journal_compact_keeps_the_live_sessions(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "journal.jsonl"
    _journal(path)
    header_before = json.loads(path.read_bytes().splitlines()[0])
    assert main(["journal", "compact", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    # Header, scheduler start, 60 turn events and 30 route records, 8 closes, clean stop
    # -> header, start, 2 x (6 events and 3 route records).
    assert report["compacted"] and report["damaged"] == 0
    assert (report["records_before"], report["records_after"]) == (101, 20)
    assert report["bytes_after"] == path.stat().st_size < report["bytes_before"]
    assert not list(tmp_path.glob(".journal.jsonl.*"))  # no temporary file left behind
    header = json.loads(path.read_bytes().splitlines()[0])
    assert header == {**header_before, "compacted": True}
    assert header[HEADER_KEY] == header_before[HEADER_KEY]

    assert main(["journal", "check", str(path)]) == 0  # sequence numbers and checksums ok
    capsys.readouterr()
    with SchedulerService(_config(path)) as svc:
        assert svc.stats.journal_quarantined == 0
        assert svc.sessions() == 2
        assert not any(svc.has_session("acme", f"s{i}") for i in range(8))
        live = svc.registry.get(SessionKey("acme", "s9"))
        assert live is not None and live.turns == 3
        assert list(live.hashes or ()) == [f"h9-{k}" for k in range(9)]

    # A second compaction has nothing more to drop; the text report says so.
    assert main(["journal", "compact", str(path)]) == 0
    out = capsys.readouterr().out
    assert "compacted" in out and "records ->" in out


def test_journal_compact_leaves_a_damaged_journal_as_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "journal.jsonl"
    _journal(path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[5] = lines[5].replace(b'"kind"', b'"kinb"')
    path.write_bytes(b"".join(lines))
    before = path.read_bytes()
    assert main(["journal", "compact", str(path)]) == 1
    assert "1 damaged records" in capsys.readouterr().out
    assert path.read_bytes() == before
    assert main(["journal", "compact", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such journal" in capsys.readouterr().err
